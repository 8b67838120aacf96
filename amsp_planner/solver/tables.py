"""The coefficient tables: the cost model read off with probe strategies, in the units the
solvers use. The ILP (solver/formulation.py) and the enumeration (solver/exhaustive.py) both
price a decision with these tables only, so neither can drift from the cost model nor from
the other.

Every table is keyed by one decision: a shard factor f (P, G, OS components: gathers,
reductions, model-state and buffer GiB), an hpZ size z, a (G, OS) or (P, OS) pair (the
optimizer-state reduce-scatter, the update's gather, the step buffer), or an activation option
j = (micro-batch, checkpointing). Times are tuples over ``cost.schedule.CLASSES`` (seconds of
one unit call of that class: the embedding, one block, the head), or seconds per step, both
divided by ``time_unit`` (one step's compute at the costliest option), so that an objective is
about 1 and the solver's tolerances are relative to the job's scale; memory is in GiB.

Per micro-batch the block counts K = lo..hi >= 1 (three or more in a row) are one option
j = (b, 'K'): compute and memory are affine in K there (cost/compute.py,
cost/activations.py), so its tables hold the values at K = lo and the slopes per block
(``krange``, ``dbwd``, ``dact``, ``drec``, ``dtpc``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from amsp_planner.ckpt_setting import checkpointed_blocks
from amsp_planner.cost.communicators import communicator_bytes, used_kinds
from amsp_planner.cost.compute import recompute_s, unit_computes
from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import (
    activation_bytes,
    buffer_bytes,
    fp8_cache,
    job_state_bytes,
    model_state_bytes,
)
from amsp_planner.cost.module_fetch import regather_fraction
from amsp_planner.cost.moe_compute import dispatch_buffer_bytes
from amsp_planner.cost.schedule import CLASSES, ScheduleEntry, build_schedule
from amsp_planner.cost.step_time import optimizer_time, tp_unit_seconds
from amsp_planner.solver.expert_tables import (
    TIME_TABLES,
    a2a_seconds,
    a2a_step_seconds,
    expert_tables,
)
from amsp_planner.solver.space import SearchSpace
from amsp_planner.strategy import Strategy

_Strategy = Strategy

GIB = 1024**3


def _entries(job: Job, s: Strategy, per_micro_batch: bool = True
             ) -> dict[tuple[str, str], ScheduleEntry]:
    """(phase, group) -> entry for one micro-batch (n_micro=1) of a probe strategy (its ZeRO
    collectives; only the once-per-step ones without `per_micro_batch`)."""
    return {(e.phase, e.group): e
            for e in build_schedule(job, s, n_micro=1, tensor_parallel=False,
                                    per_micro_batch=per_micro_batch)}


def _unit(e: ScheduleEntry | None, kernel: bool = False) -> tuple[float, ...]:
    """Per unit class: seconds of one call (or of its kernels)."""
    if e is None:
        return (0.0,) * len(CLASSES)
    return e.unit_kernel_s if kernel else e.unit_time_s


def _demand(e: ScheduleEntry | None) -> tuple[float, ...]:
    """Per unit class: the seconds of one call's gathers fetched on demand (in its kernels)."""
    return e.unit_demand_s if e is not None else (0.0,) * len(CLASSES)



@dataclass
class Tables:
    """Coefficients. Time tables map a decision to a tuple over ``CLASSES`` (seconds per unit
    call of that class), or to seconds per step (upd, metrics, opt)."""

    ag: dict
    agq: dict
    ka: dict
    """Copy-out kernels of a plain gather per unit call (forward, and backward unless hpZ)."""
    kq: dict
    """qwZ kernels per unit call (forward, and backward unless hpZ)."""
    hpz: dict
    khz: dict
    rs: dict
    krs: dict
    """Copy-in kernels of a plain reduce-scatter per unit call."""
    qgz: dict
    kg: dict
    """qgZ kernels per unit call."""
    osrs: dict
    ar: dict
    upd: dict
    metrics: float
    fwd: dict
    """option j -> compute seconds per unit class, forward."""
    bwd: dict
    n: dict
    mem_p: dict
    mem_g: dict
    mem_o: dict
    mem_h: dict
    buf_ag: dict
    buf_agq: dict
    buf_gr: dict
    buf_grq: dict
    perm: float
    step_buf: dict
    act: dict
    opt: dict
    comm: float = 0.0
    """GiB per NCCL communicator (0 on gloo)."""
    a2a: dict | None = None
    """G factor -> GiB of qgZ's all-to-all buffers beyond its communicators."""
    fixed: float = 0.0
    """GiB of tensors every strategy of the space holds whatever its factors and activation
    option (Transformer Engine's FP8 weight cache at the space's TP degree, cost/memory.py
    ``fp8_cache``: its smallest over the OS factors, the rest in ``mem_o``); fragmentation
    applies to it as to the others."""
    time_unit: float = 1.0
    """Seconds per model time unit."""
    krange: dict | None = None
    kblocks: dict | None = None
    """option j -> the blocks it checkpoints whole (a range option's at K = lo)."""
    regather: float = 0.0
    """Of a checkpointed block's backward gathers, the share the engine repeats (cost/schedule.py
    ``regather``: the block class's backward gather tables times 1 + regather K / L)."""
    rec: dict | None = None
    """option j -> recompute per step of its checkpointing (model time units)."""
    drec: dict | None = None
    """Option (mb, 'K') -> (lo, hi): checkpointing K in lo..hi blocks as one binary and an
    integer k = K - lo; fwd, bwd, act hold its values at K = lo."""
    bwd_hi: dict | None = None
    """Option (mb, 'K') -> backward seconds per class at K = hi."""
    dbwd: dict | None = None
    """Option (mb, 'K') -> backward seconds per class per block more checkpointed."""
    dact: dict | None = None
    """Option (mb, 'K') -> activation GiB per block more checkpointed."""
    tpc: dict | None = None
    """option j -> TP collective seconds per step (the 'comm' objective counts them)."""
    dtpc: dict | None = None
    """Option (mb, 'K') -> TP collective seconds per step per block more checkpointed."""
    experts: dict | None = None
    """Mixture of experts: the expert class's tables by name (solver/expert_tables.py)."""
    dm: dict | None = None
    """Of ka, the gathers fetched on demand per unit call (collective seconds on the compute
    stream: the 'comm' objective counts them); dmq of kq, dmh of khz."""
    dmq: dict | None = None
    dmh: dict | None = None
    rs2: dict | None = None
    """ZeRO-2 (s_P = 1 < s_G): G factor -> the gradient reduction per unit call where it is not
    ``rs``'s (the engine's ``Execution.zero2_reduce``: DeepSpeed all-reduces); krs2 its kernels.
    Only the factors where it differs; the step rows add the difference on the pair P = 1."""
    krs2: dict | None = None

    def get(self, name: str):
        """A table by name: the expert class's ('e_...') or a field."""
        return self.experts[name] if name.startswith("e_") else getattr(self, name)


def tables_for(job: Job, sp: SearchSpace) -> Tables:
    """Coefficient tables, each read off the cost model with a probe strategy."""
    F = sp.factors
    tp = sp.tp
    # every probe at the space's tp and gather format (fp8ag: no effect at s_P = 1)
    Strategy = functools.partial(_Strategy, tp=tp, fp8ag=sp.fp8ag)  # noqa: N806
    n = job.num_gpus // tp
    t = job.training
    pb, gb = t.param_bytes, t.grad_bytes
    ag, agq, ka, kq, rs, krs, qg, kg, ar = {}, {}, {}, {}, {}, {}, {}, {}, {}
    dm, dmq, dmh = {}, {}, {}
    mem_p, mem_g, mem_o = {}, {}, {}
    buf_ag, buf_agq, buf_gr, buf_grq = {}, {}, {}, {}
    metrics = 0.0
    rs2, krs2 = {}, {}
    for f in F:
        base = Strategy(s_p=f, s_g=f, s_os=f)
        e = _entries(job, base)
        eg = e.get(("backward", "G"))
        if f > 1:  # ZeRO-2's reduction where the engine runs it otherwise than ZeRO-3's
            z2 = _entries(job, Strategy(s_p=1, s_g=f, s_os=f)).get(("backward", "G"))
            if (_unit(z2), _unit(z2, True)) != (_unit(eg), _unit(eg, True)):
                if True in sp.qgz and not job.profile.qgz_needs_p:  # qgZ at P = 1: untabulated
                    raise NotImplementedError("a ZeRO-2 reduction of its own with qgZ at s_P = 1")
                rs2[f], krs2[f] = _unit(z2), _unit(z2, True)
        ag[f], ka[f] = _unit(e.get(("forward", "P"))), _unit(e.get(("forward", "P")), True)
        dm[f] = _demand(e.get(("forward", "P")))
        rs[f], krs[f] = _unit(eg), _unit(eg, True)
        ar[f] = _unit(e.get(("grad_sync", "OS_replica")))
        w = e.get(("update", "world"))
        metrics = w.time_s if w else 0.0
        st = job_state_bytes(job, job.tp_phi(tp), base)
        mem_p[f], mem_g[f], mem_o[f] = st["params"] / GIB, st["grads"] / GIB, st["optimizer"] / GIB
        b = buffer_bytes(job, base)
        buf_ag[f], buf_gr[f] = b["gather_buffers"] / GIB, b["grad_buffers"] / GIB
        if f > 1 and True in sp.qwz:
            eq = _entries(job, base.with_(qwz=True))[("forward", "P")]
            agq[f], kq[f], dmq[f] = _unit(eq), _unit(eq, kernel=True), _demand(eq)
            buf_agq[f] = buffer_bytes(job, base.with_(qwz=True))["gather_buffers"] / GIB
        if f > 1 and True in sp.qgz:
            sq = base.with_(qgz=True)
            eq = _entries(job, sq)
            hops = [eq.get(("backward", "G_intra")), eq.get(("backward", "G_inter"))]
            qg[f] = tuple(map(sum, zip(*(_unit(h) for h in hops), strict=True)))
            kg[f] = tuple(map(sum, zip(*(_unit(h, True) for h in hops), strict=True)))
            buf_grq[f] = buffer_bytes(job, sq)["grad_buffers"] / GIB
    hpz, khz, mem_h = {}, {}, {}
    for z in sp.hpz:
        if z > 1:
            s = Strategy(s_p=n, s_g=n, s_os=n, hpz=z)
            eh = _entries(job, s).get(("backward", "hpZ"))
            hpz[z], khz[z], dmh[z] = _unit(eh), _unit(eh, True), _demand(eh)
            mem_h[z] = model_state_bytes(job.tp_phi(tp), s, pb, gb)["hpz"] / GIB
    osrs, upd, step_buf = {}, {}, {}
    for g in F:
        for o in F:
            if o % g:
                continue
            s = Strategy(s_p=g, s_g=g, s_os=o)
            e = _entries(job, s, per_micro_batch=False)
            osrs[g, o] = _unit(e.get(("grad_sync", "OS_shard")))
            u = e.get(("update", "P_update"))  # (p, o) with p = g here
            a = e.get(("update", "P"))  # fp8ag: the amax all-reduce over P, once per step
            upd[g, o] = (u.time_s if u else 0.0) + (a.time_s if a else 0.0)
            step_buf[g, o] = buffer_bytes(job, s)["step_buffer"] / GIB
    perm = job.tp_max_unit(tp) * gb / GIB
    fwd, bwd, nn, act = {}, {}, {}, {}
    kblocks: dict = {}  # option j -> the blocks it checkpoints whole (a range's at K = lo)
    krange, bwd_hi, dbwd, dact = {}, {}, {}, {}
    rec, drec = {}, {}  # recompute seconds per step of option j, and per block of K
    # A mixture of experts recomputes the all-to-alls of the MoE layers among the first K: affine
    # in K only past its last dense layer, so the K below that are options of their own
    past = max(job.model.dense_layers, default=-1) + 1 if sp.ep > 1 else 1
    blocks = sorted(c for c in sp.ckpt if not isinstance(c, str) and c >= max(1, past))
    compact = len(blocks) >= 3 and blocks == list(range(blocks[0], blocks[-1] + 1))
    listed = [c for c in sp.ckpt if not (compact and c in blocks)]

    tp_units: dict = {}
    moe = bool(sp.expert_factors)

    def tp_seconds(mb, ck):
        return _tp_seconds(job, tp, mb, ck, tp_units)

    def dispatch(mb):
        """GiB of the token all-to-all's buffers (expert parallelism): with the activations."""
        return dispatch_buffer_bytes(job, mb, sp.ep) / GIB if sp.ep > 1 else 0.0

    def compute(mb, ck):
        return _option_compute(job, sp, mb, ck, tp_units)

    tpc, dtpc = {}, {}  # TP collective seconds per step of option j, and per block of K
    counts = (1, job.model.num_layers, 1)

    def tp_step(mb, ck):
        u = tp_seconds(mb, ck)
        a2a = a2a_step_seconds(job, sp, mb, ck) if moe else 0.0
        return a2a + job.seqs_per_rank(tp) // mb * sum(
            n * (u["fwd", c] + u["bwd", c]) for n, c in zip(counts, CLASSES, strict=True))

    def probe(j, mb, ck):
        kblocks[j] = checkpointed_blocks(ck, job.model.num_layers)[0]
        rec[j] = recompute_s(job, mb, ck, tp, sp.ep)
        tpc[j] = tp_step(mb, ck)
        fwd[j], bwd[j] = compute(mb, ck)
        nn[j] = job.seqs_per_rank(tp) // mb
        act[j] = activation_bytes(job, mb, ck, tp) / GIB + dispatch(mb)

    for mb in sp.micro_batches:
        for ck in listed:
            probe((mb, ck), mb, ck)
        if compact:
            # K blocks in lo..hi: one option, its tables at K = lo, plus K - lo times the slope
            # (compute and memory are affine in K there: cost/compute.py, cost/activations.py)
            lo, hi = blocks[0], blocks[-1]
            j = (mb, "K")
            probe(j, mb, lo)
            krange[j] = (lo, hi)
            bwd_hi[j] = compute(mb, hi)[1]
            dbwd[j] = tuple((x - y) / (hi - lo) for x, y in zip(bwd_hi[j], bwd[j], strict=True))
            dact[j] = (activation_bytes(job, mb, hi, tp) / GIB + dispatch(mb) - act[j]) / (hi - lo)
            drec[j] = (recompute_s(job, mb, hi, tp, sp.ep) - rec[j]) / (hi - lo)
            dtpc[j] = (tp_step(mb, hi) - tpc[j]) / (hi - lo)
    # Times enter the model in units of one step's compute (objective about 1), so that solver
    # tolerances are relative to the job's scale.
    unit = max(nn[j] * sum(c * (x + y) for c, x, y in
                           zip(counts, fwd[j], bwd_hi.get(j, bwd[j]), strict=True))
               for j in fwd) or 1.0
    opt = {o: optimizer_time(job, o, tp) / unit for o in F}
    for d in (ag, agq, ka, kq, hpz, khz, rs, krs, qg, kg, osrs, ar, fwd, bwd, bwd_hi, dbwd,
              dm, dmq, dmh, rs2, krs2):
        for k in d:
            d[k] = tuple(x / unit for x in d[k])
    for k in upd:
        upd[k] /= unit
    tables = Tables(ag, agq, ka, kq, hpz, khz, rs, krs, qg, kg, osrs, ar, upd, metrics / unit, fwd, bwd, nn,
                     mem_p, mem_g, mem_o, mem_h, buf_ag, buf_agq, buf_gr, buf_grq, perm, step_buf,
                     act, opt)
    # Transformer Engine's FP8 weight cache: the same for every strategy of the TP space but
    # where --fp8-all-gather on drops it with the distributed optimizer (s_OS > 1): the
    # smallest is fixed, the rest rides on the OS factor
    cache = {o: fp8_cache(job, _Strategy(tp=tp, s_os=o, ep=sp.ep)) / GIB for o in F}
    tables.fixed = min(cache.values(), default=0.0)
    for o in F:
        mem_o[o] += cache[o] - tables.fixed
    tables.krange, tables.bwd_hi, tables.dbwd, tables.dact = krange, bwd_hi, dbwd, dact
    tables.dm, tables.dmq, tables.dmh = dm, dmq, dmh
    tables.rs2, tables.krs2 = rs2, krs2
    tables.rec = {j: v / unit for j, v in rec.items()}
    tables.tpc = {j: v / unit for j, v in tpc.items()}
    tables.dtpc = {j: v / unit for j, v in dtpc.items()}
    tables.drec = {j: v / unit for j, v in drec.items()}
    tables.kblocks = kblocks
    tables.regather = regather_fraction(job, tp)
    if moe:
        ex = expert_tables(job, sp)
        for name in TIME_TABLES:
            ex[name] = {k: tuple(x / unit for x in v) for k, v in ex[name].items()}
        for name in ("e_upd", "e_opt"):
            ex[name] = {k: v / unit for k, v in ex[name].items()}
        tables.experts = ex
    _comm_tables(job, tables, tp)
    tables.time_unit = unit
    return tables


def _tp_seconds(job: Job, tp: int, mb: int, ck, memo: dict) -> dict:
    if (mb, ck) not in memo:
        memo[mb, ck] = tp_unit_seconds(job, tp, mb, ck)
    return memo[mb, ck]


def _option_compute(job: Job, sp: SearchSpace, mb: int, ck, memo: dict
                    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, backward) seconds per class of activation option (mb, ck): compute and the
    TP collectives (and a mixture of experts' token all-to-alls); `memo` the TP seconds."""
    uc = unit_computes(job, mb, ck, sp.tp, sp.ep)
    tpc = _tp_seconds(job, sp.tp, mb, ck, memo)
    if sp.expert_factors:
        a2a = a2a_seconds(job, sp, mb, ck)
        tpc = {k: v + a2a[k] for k, v in tpc.items()}
    return (tuple(uc[c].forward + tpc["fwd", c] for c in CLASSES),
            tuple(uc[c].backward + tpc["bwd", c] for c in CLASSES))


def compute_bound(job: Job, sp: SearchSpace) -> float:
    """A lower bound (seconds) of the step time of every strategy in `sp`, without its
    tables: the least over its activation options of n_j micro-batches' compute (with the
    TP collectives and all-to-alls on the compute stream). The step model counts every
    micro-batch's compute in full (each stage at least its compute: cost/step_time.py's
    ``stage_time``, max(c + (1 - eta) m, m + sigma c) >= m); the checkpointed block counts
    K are the listed ones and the ends of a compact range (compute is affine in K there,
    ``tables_for``)."""
    memo: dict = {}
    counts = (1, job.model.num_layers, 1)
    n = job.seqs_per_rank(sp.tp)
    past = max(job.model.dense_layers, default=-1) + 1 if sp.ep > 1 else 1
    blocks = sorted(c for c in sp.ckpt if not isinstance(c, str) and c >= max(1, past))
    compact = len(blocks) >= 3 and blocks == list(range(blocks[0], blocks[-1] + 1))
    cks = [c for c in sp.ckpt if not compact or c not in blocks[1:-1]]
    best = float("inf")
    for mb in sp.micro_batches:
        for ck in cks:
            fwd, bwd = _option_compute(job, sp, mb, ck, memo)
            best = min(best, n // mb * sum(c * (f + b) for c, f, b in
                                           zip(counts, fwd, bwd, strict=True)))
    return best


def _comm_tables(job: Job, tables: Tables, tp: int = 1) -> None:
    """Communicator GiB, read off the cost model: one communicator (ZeRO-1's OS_replica and
    world groups coincide, so it has one when N > 1), and qgZ's all-to-all extra per G factor."""
    n = job.num_gpus
    ddp = communicator_bytes(job, _Strategy())
    tables.comm = ddp / GIB if n > 1 else 0.0
    tables.a2a = {}
    for g in tables.qgz:
        s = _Strategy(s_p=g, s_g=g, s_os=g, qgz=True, tp=tp)
        keys = set(used_kinds(s, n, job.gpus_per_node).values())
        tables.a2a[g] = communicator_bytes(job, s) / GIB - tables.comm * len(keys)

