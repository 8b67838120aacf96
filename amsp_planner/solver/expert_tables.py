"""The expert class's coefficient tables (mixture of experts, docs/moe.md): the cost model read
off with probe strategies at the space's expert-parallel degree e and placement, keyed by an
expert shard factor f (gathers, reductions, model-state and buffer GiB) or an (ep.g, ep.os) or
(ep.p, ep.os) pair, in the units of solver/tables.py (seconds of one unit call per class,
divided by the time unit later; GiB). The token all-to-alls depend on the activation option
only (micro-batch, checkpointing): ``a2a_seconds`` gives them per class, as the TP
collectives are.
"""

from __future__ import annotations

from amsp_planner.cost.communicators import A2A_NET_BYTES, A2A_NVLINK_PEER_BYTES
from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import expert_bytes
from amsp_planner.cost.moe_schedule import a2a_entries
from amsp_planner.cost.schedule import CLASSES, build_schedule
from amsp_planner.cost.step_time import expert_optimizer_time
from amsp_planner.strategy import Strategy

GIB = 1024**3
ZERO = (0.0,) * len(CLASSES)

TIME_TABLES = ("e_ag", "e_ka", "e_rs", "e_krs", "e_ar", "e_osrs")
"""The expert tables of seconds per unit call and class (scaled by the time unit)."""


def _probe(sp, p: int, g: int, o: int) -> Strategy:
    return Strategy(ep=sp.ep, ep_span=sp.ep_span, ep_p=p, ep_g=g, ep_os=o)


def _entries(job: Job, s: Strategy, per_micro_batch: bool = True) -> dict:
    return {(e.phase, e.group): e for e in build_schedule(job, s, n_micro=1,
                                                          per_micro_batch=per_micro_batch)
            if e.group.startswith("EP_")}


def expert_tables(job: Job, sp) -> dict:
    """The expert tables of space `sp` (module docstring), by name."""
    F = sp.expert_factors
    out = {name: {} for name in TIME_TABLES + ("e_upd", "e_opt", "e_mem_p", "e_mem_g",
                                               "e_mem_o", "e_buf_ag", "e_buf_gr", "e_step_buf")}

    def unit(e, kernel=False):
        return ZERO if e is None else (e.unit_kernel_s if kernel else e.unit_time_s)

    for f in F:
        s = _probe(sp, f, f, f)
        e = _entries(job, s)
        out["e_ag"][f], out["e_ka"][f] = unit(e.get(("forward", "EP_P"))), unit(
            e.get(("forward", "EP_P")), True)
        out["e_rs"][f], out["e_krs"][f] = unit(e.get(("backward", "EP_G"))), unit(
            e.get(("backward", "EP_G")), True)
        out["e_ar"][f] = unit(e.get(("grad_sync", "EP_OS_replica")))
        b = expert_bytes(job, s)
        out["e_mem_p"][f] = b["expert_params"] / GIB
        out["e_mem_g"][f] = b["expert_grads"] / GIB
        out["e_mem_o"][f] = b["expert_optimizer"] / GIB
        u = max(job.expert_units(sp.ep))
        t = job.training
        out["e_buf_ag"][f] = (2 * u * t.param_bytes if f > 1 else 0) / GIB
        out["e_buf_gr"][f] = (2 * u * t.grad_bytes if f > 1 else 0) / GIB
        out["e_opt"][f] = expert_optimizer_time(job, sp.ep, f)
    for g in F:
        for o in F:
            if o % g:
                continue
            e = _entries(job, _probe(sp, g, g, o), per_micro_batch=False)
            out["e_osrs"][g, o] = unit(e.get(("grad_sync", "EP_OS_shard")))
            upd = e.get(("update", "EP_P_update"))
            out["e_upd"][g, o] = upd.time_s if upd else 0.0
            step = max(job.expert_units(sp.ep)) // o * job.training.grad_bytes if o > g else 0
            out["e_step_buf"][g, o] = step / GIB
    out["e_perm"] = max(job.expert_units(sp.ep)) * job.training.grad_bytes / GIB
    out["ep_comm"] = ep_communicator_gib(job, sp)
    return out


def ep_communicator_gib(job: Job, sp) -> float:
    """GiB the EP group's all-to-all adds beyond its communicator (cost/communicators.py)."""
    if sp.ep <= 1 or job.cluster.intra_fabric == "shm":
        return 0.0
    lay_e = _probe(sp, 1, 1, 1).expert_layout(job.num_gpus, job.gpus_per_node)
    lay = job.topology.layout(lay_e.ep_size, lay_e.ep_stride)
    extra = (lay.members_per_node - 1) * A2A_NVLINK_PEER_BYTES
    return (extra + (A2A_NET_BYTES if lay.nodes > 1 else 0)) / GIB


def a2a_seconds(job: Job, sp, micro_batch: int, ckpt) -> dict[tuple[str, str], float]:
    """('fwd' | 'bwd', class) -> seconds of one micro-batch's token all-to-alls, as the step
    model adds them to compute (the recomputed forward's to backward)."""
    out = {(r, c): 0.0 for r in ("fwd", "bwd") for c in CLASSES}
    s = _probe(sp, 1, 1, 1).with_(micro_batch=micro_batch, **_ckpt(ckpt, job))
    for e in a2a_entries(job, s, 1):
        for c, t in zip(CLASSES, e.unit_time_s, strict=True):
            out["fwd" if e.phase == "forward" else "bwd", c] += t
    return out


def a2a_step_seconds(job: Job, sp, micro_batch: int, ckpt) -> float:
    """Seconds per step of the token all-to-alls (the 'comm' objective counts them)."""
    s = _probe(sp, 1, 1, 1).with_(micro_batch=micro_batch, **_ckpt(ckpt, job))
    n = job.seqs_per_rank(1) // micro_batch
    return sum(e.time_s for e in a2a_entries(job, s, n))


def _ckpt(ckpt, job: Job) -> dict:
    from amsp_planner.strategy import ckpt_fields

    return ckpt_fields(ckpt, job.model.num_layers)
