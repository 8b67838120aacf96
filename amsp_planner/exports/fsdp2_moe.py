"""The expert part of an FSDP2 export: a separate device mesh for the routed experts.

A plan with an expert strategy (``ep=E``, ``ep.span``, ``ep.p=ep.g=ep.os=F``; docs/moe.md)
adds to the generated module (exports/fsdp2.py) its expert settings and:

- ``expert_rank_grid()``: the N ranks as an (N/E) x E grid: grid[i][j] is the rank at
  expert-data-parallel index i and EP index j; in the node rank = i*E + j (an EP group is E consecutive ranks), with ``ep.span``
  rank = j*(N/E) + i (strided by N/E). A row is an EP group (the ranks that exchange tokens by
  all-to-all); a column is an EDP group (the ranks holding the same experts);
- ``build_expert_mesh()``: a 3-D DeviceMesh (ereplicate, eshard, ep) of that grid, the EDP
  index split as (N/(E F), F): the experts are sharded over F consecutive EDP ranks and
  replicated over the rest, as the plan's expert triple (F, F, F) says;
- ``shard_experts(model)``: ``fully_shard`` on every module named in ``EXPERT_MODULES`` (a
  ``ModuleList`` of expert MLPs as one group) with the (ereplicate, eshard) sub-mesh, before
  ``apply`` shards the blocks on the dense mesh (FSDP2 leaves parameters an inner
  ``fully_shard`` already manages to it); ``apply`` calls it first.

Each rank's model must hold only its NUM_EXPERTS/E experts, and the MoE layer must dispatch
tokens over ``ep_group()``: expert parallelism itself is model code (as in
torchtitan's ``ExpertParallel``); this module places and shards, it does not route.
"""

from __future__ import annotations

from amsp_planner.cost.job import Job
from amsp_planner.strategy import Strategy


def settings(job: Job, s: Strategy) -> dict:
    """The expert constants of the generated module (empty without an expert strategy)."""
    if not s.has_experts:
        return {}
    f = s.ep_p
    assert s.ep_p == s.ep_g == s.ep_os, f"{s}: FSDP2 shards the experts' P, G and OS together"
    edp = job.num_gpus // s.ep
    return {"EP_SIZE": s.ep, "EP_SPAN": s.ep_span, "NUM_EXPERTS": job.model.num_experts,
            "EXPERT_SHARD_SIZE": f, "EXPERT_REPLICATE_SIZE": edp // f,
            "EXPERT_MODULES": ("experts",)}


BODY = '''

def expert_rank_grid(world_size: int = NUM_GPUS) -> list[list[int]]:
    """grid[i][j]: the rank at expert-data-parallel index i and EP index j (rows: EP groups,
    columns: the groups holding the same experts)."""
    if world_size % EP_SIZE:
        raise ValueError(f"world size {world_size} is not a multiple of EP_SIZE {EP_SIZE}")
    edp = world_size // EP_SIZE
    if EP_SPAN:
        return [[j * edp + i for j in range(EP_SIZE)] for i in range(edp)]
    return [[i * EP_SIZE + j for j in range(EP_SIZE)] for i in range(edp)]


def build_expert_mesh(device_type: str = "cuda", world_size: int = NUM_GPUS):
    """The (ereplicate, eshard, ep) device mesh of the experts; call after init_process_group."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.tensor(expert_rank_grid(world_size))
    shard = EXPERT_SHARD_SIZE if grid.shape[0] % EXPERT_SHARD_SIZE == 0 else 1
    mesh = grid.reshape(grid.shape[0] // shard, shard, EP_SIZE)
    return DeviceMesh(device_type, mesh, mesh_dim_names=("ereplicate", "eshard", "ep"))


def ep_group(expert_mesh=None):
    """The process group the MoE layer's dispatch and combine all-to-alls run over."""
    mesh = build_expert_mesh() if expert_mesh is None else expert_mesh
    return mesh["ep"].get_group()


def shard_experts(model, expert_mesh=None, *, strict: bool = True) -> list:
    """fully_shard every expert module (EXPERT_MODULES) on the expert mesh's (ereplicate,
    eshard) dimensions; returns the sharded modules. strict=False on another world size (a
    check on one rank) puts every rank in one expert shard group."""
    import torch
    from torch.distributed.fsdp import fully_shard

    mesh = expert_mesh
    if mesh is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else NUM_GPUS
        if world != NUM_GPUS and not strict:  # fewer ranks (a check): one expert shard group
            from torch.distributed.device_mesh import init_device_mesh

            dev = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = init_device_mesh(dev, (1, world, 1),
                                    mesh_dim_names=("ereplicate", "eshard", "ep"))
        else:
            mesh = build_expert_mesh()
    sub = mesh["ereplicate", "eshard"]
    found = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in EXPERT_MODULES]
    if strict and not found:
        raise ValueError(f"no module named {EXPERT_MODULES} in the model: pass strict=False "
                         "or rename EXPERT_MODULES")
    policy = mp_policy()
    for m in found:
        unit = list(m) if isinstance(m, torch.nn.ModuleList) else m
        fully_shard(unit, mesh=sub, reshard_after_forward=True, mp_policy=policy)
    return found


_apply_dense = apply


def apply(model, world_mesh=None, *, blocks=None, strict: bool = True, expert_mesh=None):
    """shard_experts on the expert mesh, then the dense apply (checkpointing, blocks, root)."""
    shard_experts(model, expert_mesh, strict=strict)
    return _apply_dense(model, world_mesh, blocks=blocks, strict=strict)
'''
