"""Rank groups of a plan, built from its meshes with ranks node-major (DESIGN.md 3a).

A group kind is (size m, stride d): the group of rank r is the m ranks r0 + j*d, j < m, with
r0 = (r // (m*d)) * m*d + r % d. So the P-, G- and OS-groups (stride 1) are s_x consecutive
ranks; the OS_shard group holds the ranks of one OS-group with the same G shard; the OS_replica
group the ranks with the same OS shard; P_update the ranks of one OS-group sharing a P shard.

=========== ================ ==========
name        size             stride
=========== ================ ==========
P           s_P              1
hpZ         h_z              1
G           s_G              1
G_intra     s0_G             1
G_inter     s1_G             R
OS_shard    s_OS/s_G         s_G
OS_replica  N/s_OS           s_OS
P_update    s_OS/s_P         s_P
world       N                1
=========== ================ ==========

A MoE model adds the EP group (the token all-to-alls) and the expert class's kinds ``EP_P``,
``EP_G``, ``EP_OS_shard``, ``EP_OS_replica``, ``EP_P_update``: the rules above over the N/e
expert-data-parallel ranks, strided by the EDP group's stride (``cost/communicators.py``;
``Strategy.expert_layout``, docs/moe.md).
"""

from __future__ import annotations

from amsp_planner.cost.communicators import group_kinds
from amsp_planner.runtime.collectives import Group

_PG_CACHE: dict[tuple[int, ...], tuple[object, object]] = {}


def members(rank: int, size: int, stride: int) -> tuple[int, ...]:
    """The ranks of the (size, stride) group containing `rank`."""
    span = size * stride
    r0 = (rank // span) * span + rank % stride
    return tuple(r0 + j * stride for j in range(size))


def partition(world: int, size: int, stride: int) -> list[tuple[int, ...]]:
    """All groups of one kind, in a deterministic order (every rank creates them alike)."""
    seen, out = set(), []
    for r in range(world):
        g = members(r, size, stride)
        if g not in seen:
            seen.add(g)
            out.append(g)
    return out


def _process_group(ranks: tuple[int, ...], world: int):
    """(ProcessGroup, back channel) per distinct rank list; every rank must call this alike.

    Groups of two get a second ProcessGroup over the same members (``Group.pg_back``), so a
    two-member ring sends and receives on separate connections."""
    import torch.distributed as dist

    if len(ranks) == 1:
        return None, None
    if ranks not in _PG_CACHE:
        for g in partition(world, len(ranks), ranks[1] - ranks[0]):
            if g not in _PG_CACHE:
                pg = dist.group.WORLD if len(g) == world else dist.new_group(list(g))
                back = dist.new_group(list(g)) if len(g) == 2 else None
                _PG_CACHE[g] = (pg, back)
    return _PG_CACHE[ranks]


EXPERT_KINDS = ("P", "G", "OS_shard", "OS_replica", "P_update")
"""The kinds a MoE model's expert class uses, named ``EP_`` + kind."""


def build_groups(strategy, rank: int, world: int, gpus_per_node: int,
                 node_of: list[int], moe: bool = False) -> dict[str, Group]:
    """This rank's Group of every kind; `node_of[r]` is the node rank r runs on (measured).
    `moe`: the model has routed experts; without expert tokens the expert class runs on the
    dense triple at e = 1, so its kinds are the dense ones (cost/moe_schedule.py)."""
    out = {}
    kinds = group_kinds(strategy, world, gpus_per_node)
    if moe and not strategy.has_experts:
        kinds |= {"EP_" + k: kinds[k] for k in EXPERT_KINDS} | {"EP": (1, 1)}
    for name, (size, stride) in kinds.items():
        ranks = members(rank, size, stride)
        pg, back = _process_group(ranks, world)
        my_node = node_of[rank]
        nodes = len({node_of[r] for r in ranks})
        k = sum(1 for r in ranks if node_of[r] == my_node)
        out[name] = Group(name, ranks, ranks.index(rank), pg, k, nodes, back)
    return out
