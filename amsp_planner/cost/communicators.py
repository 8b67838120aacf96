"""Process groups of a strategy, and the NCCL buffers their communicators hold (docs/memory.md).

A group kind is (size m, stride d): the group of rank r is the m ranks r0 + j*d, j < m, with
r0 = (r // (m*d)) * m*d + r % d (DESIGN.md 3a; ``runtime/groups.py`` builds them).

NCCL creates a communicator per process group on its first collective, so a rank holds one for
each distinct (size, stride) that a collective of the schedule uses: kinds with equal members
share one (the runtime caches process groups by their ranks; ZeRO-3's P, G and world groups are
one; a mixture of experts' EP group and expert-class kinds are kinds like any other). Each holds ``COMMUNICATOR_BYTES`` of channel buffers; one that runs all-to-all (qgZ's
hops) connects every pair of members and holds more: ``A2A_NVLINK_PEER_BYTES`` per peer inside a
node, ``A2A_NET_BYTES`` across nodes. On the CPU runtime (gloo, ``intra_fabric: shm``) there
are no such buffers.
"""

from __future__ import annotations

COMMUNICATOR_BYTES = 688 * 2**20
"""Channel buffers of one NCCL communicator: 688 MB measured per communicator of 3-4 A100s on
NVLink after a 4 MB all-reduce, 544 MB for two (NVIDIA/nccl#964); 0.5-1.6 GB elsewhere
(NVIDIA/nccl#864, #986: linear in the number of channels)."""

A2A_NVLINK_PEER_BYTES = int(3.28 * 2**30 / 7)
"""Extra buffers per in-node peer of a communicator that runs all-to-all: 8 H100s went from
1.06 to 4.34 GB after their first all_to_all_single, 32 P2P channels per pair of GPUs
(NVIDIA/nccl#1685): 3.28 GB over 7 peers."""

A2A_NET_BYTES = 512 * 2**20
"""The shared network P2P buffer pool of a communicator whose all-to-all crosses nodes (the
536,870,912-byte allocation of NVIDIA/nccl#2363)."""


def group_kinds(strategy, world: int, gpus_per_node: int) -> dict[str, tuple[int, int]]:
    """name -> (size, stride) of every group kind of a Strategy on `world` ranks, R per node.
    With tp = t > 1 the data-parallel kinds are over the world/t data-parallel ranks, strided by
    t in global ranks (cost/schedule.py), and the TP group is t consecutive ranks."""
    s, t = strategy, strategy.tp
    R, dp = max(1, gpus_per_node // t), world // t
    s0_g, s1_g = s.mesh("g", gpus_per_node)
    kinds = {
        "P": (s.s_p, t),
        "hpZ": (s.hpz, t),
        "G": (s.s_g, t),
        "G_intra": (s0_g, t),
        "G_inter": (s1_g, R * t),
        "OS_shard": (s.s_os // s.s_g, s.s_g * t),
        "OS_replica": (dp // s.s_os, s.s_os * t),
        "P_update": (s.s_os // s.s_p, s.s_p * t),
        "world": (world, 1),
    }
    if t > 1:
        kinds["TP"] = (t, 1)
    if s.has_experts:  # mixture of experts (cost/moe_schedule.py): EP and the expert class
        lay = s.expert_layout(world, gpus_per_node)
        p, g, o, d = s.ep_p, s.ep_g, s.ep_os, lay.edp_stride
        kinds.update({"EP": (s.ep, lay.ep_stride), "EP_P": (p, d), "EP_G": (g, d),
                      "EP_OS_shard": (o // g, g * d), "EP_OS_replica": (lay.edp_size // o, o * d),
                      "EP_P_update": (o // p, p * d)})
    return kinds


def used_kinds(strategy, world: int, gpus_per_node: int) -> dict[str, tuple[int, int]]:
    """The kinds a collective of the schedule runs on (size > 1), with (size, stride)."""
    s = strategy
    kinds = group_kinds(s, world, gpus_per_node)
    used = {"P", "hpZ", "OS_shard", "OS_replica", "P_update", "world", "TP", "EP", "EP_P",
            "EP_G", "EP_OS_shard", "EP_OS_replica", "EP_P_update"}
    used |= {"G_intra", "G_inter"} if s.qgz else {"G"}
    return {k: v for k, v in kinds.items() if k in used and v[0] > 1}


def process_groups(strategy, world: int, gpus_per_node: int) -> int:
    """Distinct process groups (one communicator each) the schedule's collectives run on."""
    return len(set(used_kinds(strategy, world, gpus_per_node).values()))


def communicator_bytes(job, s) -> float:
    """NCCL buffer bytes per rank for the groups strategy `s` uses on `job`."""
    if job.cluster.intra_fabric == "shm":
        return 0.0
    kinds = used_kinds(s, job.num_gpus, job.gpus_per_node)
    total = COMMUNICATOR_BYTES * len(set(kinds.values()))
    if "G_intra" in kinds:
        total += (kinds["G_intra"][0] - 1) * A2A_NVLINK_PEER_BYTES
    if "G_inter" in kinds:
        total += A2A_NET_BYTES
    if "EP" in kinds:  # the token all-to-all: peers in the node, and the network pool
        lay = job.topology.layout(*kinds["EP"])
        total += (lay.members_per_node - 1) * A2A_NVLINK_PEER_BYTES
        total += A2A_NET_BYTES if lay.nodes > 1 else 0
    return float(total)
