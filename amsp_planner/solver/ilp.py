"""The ILP: choose the sharding of P, G and OS, the ZeRO++ switches and the activation setting.

Sets: F = shard factors (``SearchSpace.factors``), Z = hpZ sizes > 1, J = activation options
(micro-batch b_j, checkpointing c_j: the first K of the L blocks, K = 0..L, or op-level) with
n_j = sequences per GPU / b_j micro-batches. Per option the tables hold the block class's
compute (with K of L checkpointed: the average, backward + (K/L) forward) and the activation
bytes, both from the cost model. Per micro-batch the block counts K = lo..hi >= 1 (three or
more in a row) are one option j = (b, 'K') with an integer k_j = K - lo: compute and memory are
affine in K there, so its tables hold the values at K = lo and the slopes per block.
Pairs: PG = {(p, g) in F^2 : p | g}, GO = {(g, o) : g | o}, PO = {(p, o) : p | o}.

Variables (binaries unless noted; times in seconds, memory in GiB):
  xPn_f, xPq_f   P factor f without / with qwZ            sum_f (xPn_f + xPq_f) = 1
  xGn_g, xGq_g   G factor g without / with qgZ            sum_g (xGn_g + xGq_g) = 1
  xO_o           OS factor o                              sum_o xO_o = 1
  h_z            hpZ of size z                            sum_z h_z <= 1
  y_j            activation option j                      sum_j y_j = 1
  k_j            integer, for j = (b, 'K'): K - lo        0 <= k_j <= (hi - lo) y_j
  zPG, zGO, zPO  in [0, 1]: the chosen pair (linearised products of the factor binaries)
  with xP_f = xPn_f + xPq_f, xG_g = xGn_g + xGq_g and
  [link]   sum_g zPG_pg = xP_p,  sum_p zPG_pg = xG_g   (likewise GO, PO)
           A pair exists only when it nests, so the links also enforce p | g | o; at binary
           x the links force z to the product x_p * x_g.
  [hpz]    vPn_f, vPq_f in [0, 1], the P choice without hpZ: vPn_f <= xPn_f, vPq_f <= xPq_f,
           sum_f (vPn_f + vPq_f) = 1 - H (H = sum_z h_z; at binary x, h: v_f = x_f (1 - H));
           h_z <= sum_{f in F: f > z, z | f} (xP_f - vPn_f - vPq_f)
  [qwz]    xPq_1 = 0;  [qgz] xGq_1 = 0
  [engine] with the engine's triples T (SearchSpace.triples): w_t binary, sum_t w_t = 1,
           xP_f = sum_{t in T: t_P = f} w_t (likewise G, OS); with qgz_needs_p,
           sum_g xGq_g <= sum_{f > 1} xP_f

Per-micro-batch collective times (tables T from the cost model's schedule, see
``_tables``): C_f = sum_f xPn_f T_ag(f) + xPq_f T_agq(f) (forward gathers);
C_bag = sum_f vPn_f T_ag(f) + vPq_f T_agq(f) + sum_z h_z T_hpz(z) (backward gathers: the
  forward ones without hpZ, hpZ's with it; [hpz]);
C_g = sum_g xGn_g T_rs(g) + xGq_g T_qgz(g); C_b = C_bag + C_g.
Once per step: C_s = sum_GO zGO T_osrs(g, o) + sum_o xO_o T_ar(o);
C_u = sum_PO zPO T_upd(p, o) + T_metrics. Compute: T_f = sum_j y_j Tf_j,
T_b = sum_j (y_j Tb_j + k_j dTb_j); activations sum_j (y_j A_j + k_j dA_j).

Overlap (cost/step_time.py), linearised with auxiliaries (continuous, >= 0):
  e_f >= C_f - eta T_f;  e_b >= C_b - eta T_b;  e_l >= C_b + C_s - eta T_b
  (eta = the cluster's overlap_efficiency)
  with w = (U-1)/U (the units whose communication can hide behind another's compute):
  E_F >= n_j (w e_f + C_f/U) - M_Fj (1 - Y_b)        [products n x e, per micro-batch b,
  E_B >= (n_j - 1)(w e_b + C_b/U) - M_Bj (1 - Y_b)     Y_b = the sum of its options' y_j]
  step = sum_j y_j n_j (Tf_j + Tb_j) + sum_o xO_o T_opt(o) + E_F + E_B + w e_l
         + (C_b + C_s)/U + C_u                       (T_opt: the AdamW step on Phi/o elements)
With `objective="comm"`: comm >= n_j (C_f + C_b) - M (1 - Y_b), + C_s + C_u.
With several micro-batch sizes, valid inequalities without big-M bound E_F and E_B from below
(``_add_micro_batch_cuts``): the options' compute times their own n_j plus n_min times the rest.

Memory per GPU (GiB), every term linear:
  tensors = sum_f xP_f P(f) + sum_g xG_g G(g) + sum_o xO_o O(o) + sum_z h_z H(z)
          + sum_f (xPn_f B_ag(f) + xPq_f B_agq(f)) + sum_g (xGn_g B_gr(g) + xGq_g B_grq(g))
          + st + sum_GO zGO S_step(g, o) + sum_j (y_j A_j + k_j dA_j)  (A_j: activations + loss peak)
  st >= S_perm sum_{1<p<g} zPG_pg,  st >= S_perm sum_g xGq_g         [permuted gradient copy]
  comms = C_comm (sum_k u_k + [N > 1]) + sum_g xGq_g A2A(g)          [NCCL communicators]
  u_k >= every decision variable that puts a used group kind on ranks k = (size, stride):
        xP_f -> (f, 1), h_z -> (z, 1), xGn_g -> (g, 1), xGq_g -> (s0_g, 1) and (s1_g, R),
        zGO_go -> (o/g, g), xO_o -> (N/o, o), zPO_po -> (o/p, p)  (size > 1; world (N, 1) is
        always used, so its key has no u). Kinds on the same ranks share one communicator.
  [memory]  tensors (1 + frag) + comms + context <= limit

Choice (``Preference``, docs/planner.md), by lexicographic re-solves: minimise step (or comm);
when that optimum is quantized and the rule is "auto", again with xPq = xGq = 0, and keep the
quantized optimum only if it is faster beyond the band; then with the objective capped at the
band's edge (cap = best (1 + band)) minimise each tie-break in turn (groups = sum_k u_k +
[N > 1], then memory), each capped at its optimum for the next; last, with the decision
binaries fixed, minimise step again (an LP: the stage variables are only bounded below, so
under another objective they float). The memory constraint uses the limit less the headroom.
Runners-up come from no-good cuts on the decision binaries. Every solution is decoded,
re-evaluated with the cost model, and both must agree (``check_agreement``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time as _time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from amsp_planner.cost.communicators import communicator_bytes, process_groups, used_kinds
from amsp_planner.cost.compute import recompute_s, unit_computes
from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import activation_bytes, buffer_bytes, model_state_bytes
from amsp_planner.cost.schedule import CLASSES, ScheduleEntry, build_schedule
from amsp_planner.cost.step_time import optimizer_time, stage_time, stages, tp_unit_seconds
from amsp_planner.solver.space import (
    FASTEST,
    GROUPS,
    MEMORY,
    RECOMPUTE,
    TIME_RTOL,
    Preference,
    SearchSpace,
)
from amsp_planner.strategy import Strategy, ckpt_fields

_Strategy = Strategy

GIB = 1024**3
PHASE2_RTOLS = (TIME_RTOL, 1e-6)
"""Relative slack on the step time while phase 2 minimises memory, tried in turn."""


_BUILDING = threading.Lock()  # StrategyIlp.build: one model built at a time
_quieted = False  # whether a _quiet_stdout is active (one redirection for a threaded batch)


@contextlib.contextmanager
def _quiet_stdout():
    """Silence what the solver library prints on file descriptor 1 (HiGHS's banner). Inside
    an active one (a solve in a batch already silenced, possibly in another thread) it does
    nothing: file descriptor 1 is process-wide, so the threads of a batch must not swap it
    under each other. Only the outermost use sets and clears the flag, after its threads are
    joined (``solve_models``)."""
    global _quieted
    if _quieted:
        yield
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real stdout (embedded use)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    _quieted = True
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        _quieted = False
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


HIGHS_SPEED = {"mip_heuristic_effort": 0.0, "mip_allow_restart": False,
               "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
               "mip_heuristic_run_root_reduced_cost": False,
               "mip_heuristic_run_feasibility_jump": False, "presolve": "off"}
"""HiGHS options for these small models (about 60 binaries): its sub-MIP heuristics and root
restarts took most of the time without improving the incumbent; off, a solve is about 5x
faster (bench/planner.py), and optimality is still proven (gap 0). The feasibility-jump
heuristic, which runs before the root LP, off: the root LP's rounding finds the incumbent
(the root bound is within about 1 %, ``_add_micro_batch_cuts``); about 20 % less per solve.
Presolve off: on these models, whose relaxation is tight (the micro-batch cuts, hpZ without
big-M), HiGHS's MIP presolve took most of a solve (50 of 56 ms on llama-7b/1024's first) and
removed only a tenth of the rows; without it the degrees' first solves take half as long."""


class SolverError(RuntimeError):
    """The solver did not prove optimality (time limit, numerical trouble)."""


@dataclass
class IlpSolution:
    strategy: Strategy
    objective: float
    memory_gib: float
    status: str
    decision: tuple = ()
    """The decision binaries at 1 in this solution (for the runners-up's no-good cuts)."""
    groups: int = 0
    """Process groups of the decoded strategy."""


@dataclass
class IlpStats:
    solver: str
    status: str = ""
    solve_time_s: float = 0.0
    build_time_s: float = 0.0
    num_variables: int = 0
    num_constraints: int = 0
    solves: int = 0


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


def _top(i: int, *tables: dict) -> float:
    """The largest class-`i` value in the tables (0 when empty)."""
    return max([0.0] + [v[i] for d in tables for v in d.values()])


def _dot(pulp, terms, constant: float = 0.0):
    """sum(c * v for v, c in terms) + constant as one PuLP expression, built in place (PuLP's
    ``lpSum(v * c ...)`` makes two expressions per term; these models have thousands)."""
    e = pulp.LpAffineExpression(constant=constant)
    for v, c in terms:
        e[v] = e.get(v, 0.0) + c
    return e


@dataclass
class _Tables:
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
    time_unit: float = 1.0
    """Seconds per model time unit."""
    krange: dict | None = None
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


def _tables(job: Job, sp: SearchSpace) -> _Tables:
    """Coefficient tables, each read off the cost model with a probe strategy."""
    F = sp.factors
    tp = sp.tp
    Strategy = functools.partial(_Strategy, tp=tp)  # noqa: N806  every probe at the space's tp
    n = job.num_gpus // tp
    t = job.training
    pb, gb = t.param_bytes, t.grad_bytes
    ag, agq, ka, kq, rs, krs, qg, kg, ar = {}, {}, {}, {}, {}, {}, {}, {}, {}
    mem_p, mem_g, mem_o = {}, {}, {}
    buf_ag, buf_agq, buf_gr, buf_grq = {}, {}, {}, {}
    metrics = 0.0
    for f in F:
        base = Strategy(s_p=f, s_g=f, s_os=f)
        e = _entries(job, base)
        ag[f], ka[f] = _unit(e.get(("forward", "P"))), _unit(e.get(("forward", "P")), True)
        rs[f], krs[f] = _unit(e.get(("backward", "G"))), _unit(e.get(("backward", "G")), True)
        ar[f] = _unit(e.get(("grad_sync", "OS_replica")))
        w = e.get(("update", "world"))
        metrics = w.time_s if w else 0.0
        st = model_state_bytes(job.tp_phi(tp), base, pb, gb)
        mem_p[f], mem_g[f], mem_o[f] = st["params"] / GIB, st["grads"] / GIB, st["optimizer"] / GIB
        b = buffer_bytes(job, base)
        buf_ag[f], buf_gr[f] = b["gather_buffers"] / GIB, b["grad_buffers"] / GIB
        if f > 1 and True in sp.qwz:
            eq = _entries(job, base.with_(qwz=True))[("forward", "P")]
            agq[f], kq[f] = _unit(eq), _unit(eq, kernel=True)
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
            hpz[z], khz[z] = _unit(eh), _unit(eh, True)
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
            upd[g, o] = u.time_s if u else 0.0
            step_buf[g, o] = buffer_bytes(job, s)["step_buffer"] / GIB
    perm = job.tp_max_unit(tp) * gb / GIB
    fwd, bwd, nn, act = {}, {}, {}, {}
    krange, bwd_hi, dbwd, dact = {}, {}, {}, {}
    rec, drec = {}, {}  # recompute seconds per step of option j, and per block of K
    blocks = sorted(c for c in sp.ckpt if c != "op" and c >= 1)
    compact = len(blocks) >= 3 and blocks == list(range(blocks[0], blocks[-1] + 1))
    listed = [c for c in sp.ckpt if not (compact and c in blocks)]

    tp_units: dict = {}

    def tp_seconds(mb, ck):
        if (mb, ck) not in tp_units:
            tp_units[mb, ck] = tp_unit_seconds(job, tp, mb, ck)
        return tp_units[mb, ck]

    def compute(mb, ck):
        """(forward, backward) seconds per class: compute and the TP collectives."""
        uc = unit_computes(job, mb, ck, tp)
        tpc = tp_seconds(mb, ck)
        return (tuple(uc[c].forward + tpc["fwd", c] for c in CLASSES),
                tuple(uc[c].backward + tpc["bwd", c] for c in CLASSES))

    tpc, dtpc = {}, {}  # TP collective seconds per step of option j, and per block of K
    counts = (1, job.model.num_layers, 1)

    def tp_step(mb, ck):
        u = tp_seconds(mb, ck)
        return job.seqs_per_rank(tp) // mb * sum(
            n * (u["fwd", c] + u["bwd", c]) for n, c in zip(counts, CLASSES, strict=True))

    def probe(j, mb, ck):
        rec[j] = recompute_s(job, mb, ck, tp)
        tpc[j] = tp_step(mb, ck)
        fwd[j], bwd[j] = compute(mb, ck)
        nn[j] = job.seqs_per_rank(tp) // mb
        act[j] = activation_bytes(job, mb, ck, tp) / GIB

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
            dact[j] = (activation_bytes(job, mb, hi, tp) / GIB - act[j]) / (hi - lo)
            drec[j] = (recompute_s(job, mb, hi, tp) - rec[j]) / (hi - lo)
            dtpc[j] = (tp_step(mb, hi) - tpc[j]) / (hi - lo)
    # Times enter the model in units of one step's compute (objective about 1), so that solver
    # tolerances are relative to the job's scale.
    unit = max(nn[j] * sum(c * (x + y) for c, x, y in
                           zip(counts, fwd[j], bwd_hi.get(j, bwd[j]), strict=True))
               for j in fwd) or 1.0
    opt = {o: optimizer_time(job, o, tp) / unit for o in F}
    for d in (ag, agq, ka, kq, hpz, khz, rs, krs, qg, kg, osrs, ar, fwd, bwd, bwd_hi, dbwd):
        for k in d:
            d[k] = tuple(x / unit for x in d[k])
    for k in upd:
        upd[k] /= unit
    tables = _Tables(ag, agq, ka, kq, hpz, khz, rs, krs, qg, kg, osrs, ar, upd, metrics / unit, fwd, bwd, nn,
                     mem_p, mem_g, mem_o, mem_h, buf_ag, buf_agq, buf_gr, buf_grq, perm, step_buf,
                     act, opt)
    tables.krange, tables.bwd_hi, tables.dbwd, tables.dact = krange, bwd_hi, dbwd, dact
    tables.rec = {j: v / unit for j, v in rec.items()}
    tables.tpc = {j: v / unit for j, v in tpc.items()}
    tables.dtpc = {j: v / unit for j, v in dtpc.items()}
    tables.drec = {j: v / unit for j, v in drec.items()}
    _comm_tables(job, tables, tp)
    tables.time_unit = unit
    return tables


def _comm_tables(job: Job, tables: _Tables, tp: int = 1) -> None:
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


def _tag(j: tuple[int, int | str]) -> str:
    """Name part of activation option j = (micro-batch, K blocks or 'op')."""
    return f"mb{j[0]}_ck{j[1]}"


class StrategyIlp:
    """The PuLP model of one job; `solve()` returns the best strategy and runners-up."""

    def __init__(self, job: Job, space: SearchSpace, memory_limit: float,
                 objective: str = "time", solver: str = "highs", time_limit_s: float = 30.0,
                 *, defer: bool = False):
        """`defer`: the tables and the model are made by ``build()``, at the latest by the first
        solve (``solve_models`` then builds each model in its solver thread, while the models
        built before it solve)."""
        import pulp

        self.pulp = pulp
        self.job, self.space, self.objective = job, space, objective
        self.memory_limit = memory_limit
        self.solver_name = solver
        self.time_limit_s = time_limit_s
        self.built = False
        if not defer:
            self.build()

    def build(self) -> None:
        """The tables and the model, one model at a time (``_BUILDING``): building is Python
        work under the GIL, so two built at once both finish late; one after the other, the
        first starts solving (without the GIL) while the next is built."""
        with _BUILDING:
            if not self.built:
                self._build_now()

    def _build_now(self) -> None:
        pulp = self.pulp
        t0 = _time.perf_counter()
        self.T = _tables(self.job, self.space)
        self._api = None  # the HiGHS instance, built at the first solve (``_run_highs``)
        self.prob = pulp.LpProblem("amsp_strategy", pulp.LpMinimize)
        self._build()
        self.stats = IlpStats(solver=self.solver_name, build_time_s=_time.perf_counter() - t0,
                              num_variables=self.prob.numVariables(),
                              num_constraints=self.prob.numConstraints())
        self.built = True

    # ----- model ------------------------------------------------------------------------------
    def _build(self) -> None:
        pulp, T, sp, job = self.pulp, self.T, self.space, self.job
        F = sp.factors
        prob = self.prob
        B = prob.add_variable  # attached to the model as created (PuLP 4 style)
        lin = pulp.lpSum
        self.xPn = {f: B(f"xPn_{f}", cat="Binary") for f in F}
        self.xPq = {f: B(f"xPq_{f}", cat="Binary") for f in F if f in T.agq}
        self.xGn = {g: B(f"xGn_{g}", cat="Binary") for g in F}
        self.xGq = {g: B(f"xGq_{g}", cat="Binary") for g in F if g in T.qgz}
        self.xO = {o: B(f"xO_{o}", cat="Binary") for o in F}
        self.h = {z: B(f"h_{z}", cat="Binary") for z in T.hpz}
        J = list(T.fwd)
        self.y = {j: B(f"y_{_tag(j)}", cat="Binary") for j in J}
        self.k = {j: B(f"k_{_tag(j)}", lowBound=0, upBound=hi - lo, cat="Integer")
                  for j, (lo, hi) in T.krange.items()}

        def xP(f):
            return self.xPn[f] + (self.xPq[f] if f in self.xPq else 0)

        def xG(g):
            return self.xGn[g] + (self.xGq[g] if g in self.xGq else 0)

        prob += lin(xP(f) for f in F) == 1, "one_P_factor"
        prob += lin(xG(g) for g in F) == 1, "one_G_factor"
        prob += lin(self.xO.values()) == 1, "one_OS_factor"
        prob += lin(self.y.values()) == 1, "one_activation_option"
        for j, kj in self.k.items():
            lo, hi = T.krange[j]
            prob += kj <= (hi - lo) * self.y[j], f"blocks_{_tag(j)}_need_option"
        if self.h:
            prob += lin(self.h.values()) <= 1, "at_most_one_hpz"
        # the P choice without hpZ: vPn_f = xPn_f (1 - H), vPq_f = xPq_f (1 - H), H = sum_z h_z
        # (at binary x and h the rows force the products); hpZ of size z only on a P factor it
        # divides: h_z <= sum of those xP_f H = xP_f - v_f
        self.vPn = {f: B(f"vPn_{f}", lowBound=0) for f in F}
        self.vPq = {f: B(f"vPq_{f}", lowBound=0) for f in self.xPq}
        for name, v, x in (("n", self.vPn, self.xPn), ("q", self.vPq, self.xPq)):
            for f, vf in v.items():
                prob += vf <= x[f], f"p{name}_{f}_without_hpz"
        prob += (lin([*self.vPn.values(), *self.vPq.values()]) == 1 - lin(self.h.values()),
                 "p_without_hpz")
        for z, hz in self.h.items():
            prob += hz <= lin(xP(f) - self.vPn[f] - self.vPq.get(f, 0) for f in F
                              if f > z and f % z == 0), f"hpz_{z}_on_p"
        self._add_engine(xP, xG)

        def pairs(name, left, right, rows, cols):
            z = {(a, b): B(f"z{name}_{a}_{b}", lowBound=0, upBound=1)
                 for a in rows for b in cols if b % a == 0}
            for a in rows:
                prob.addConstraint(lin(v for (i, _), v in z.items() if i == a) == left(a),
                                   f"link_{name}_row_{a}")
            for b in cols:
                prob.addConstraint(lin(v for (_, k), v in z.items() if k == b) == right(b),
                                   f"link_{name}_col_{b}")
            return z

        self.zPG = pairs("PG", xP, xG, F, F)
        self.zGO = pairs("GO", xG, lambda o: self.xO[o], F, F)
        self.zPO = pairs("PO", xP, lambda o: self.xO[o], F, F)

        self._add_time(xP, xG, J)
        self.recompute_expr = _dot(pulp, [*((self.y[j], T.rec[j]) for j in J),
                                          *((kj, T.drec[j]) for j, kj in self.k.items())])

        # memory
        st = B("staging", lowBound=0)
        self.st, self.st_bounds = st, [T.perm * lin(v for (p, g), v in self.zPG.items() if 1 < p < g)]
        if self.xGq:
            self.st_bounds.append(T.perm * lin(self.xGq.values()))
        for i, bound in enumerate(self.st_bounds):
            prob += st >= bound, f"staging_{i}"
        tensors = _dot(pulp, [
            *((self.xPn[f], T.mem_p[f] + T.buf_ag[f]) for f in F),
            *((v, T.mem_p[f] + T.buf_agq[f]) for f, v in self.xPq.items()),
            *((self.xGn[g], T.mem_g[g] + T.buf_gr[g]) for g in F),
            *((v, T.mem_g[g] + T.buf_grq[g]) for g, v in self.xGq.items()),
            *((self.xO[f], T.mem_o[f]) for f in F),
            *((v, T.mem_h[z]) for z, v in self.h.items()),
            (st, 1.0), *((v, T.step_buf[k]) for k, v in self.zGO.items()),
            *((self.y[j], T.act[j]) for j in J), *((kj, T.dact[j]) for j, kj in self.k.items())])
        gpu = job.cluster.gpu
        self.mem_expr = (tensors * (1 + gpu.fragmentation_fraction) + self._comm_expr(xP)
                         + gpu.context_reserve_gib)
        # phase 2 caps the objective through this variable's upper bound (None: no cap)
        self.cap = B("objective_cap")
        prob += self.step_expr <= self.cap, "objective_cap"
        self.caps = {MEMORY: B("memory_cap"), GROUPS: B("groups_cap"),
                     RECOMPUTE: B("recompute_cap")}
        prob += self.mem_expr <= self.caps[MEMORY], "memory_cap"
        prob += self.groups_expr <= self.caps[GROUPS], "groups_cap"
        prob += self.recompute_expr <= self.caps[RECOMPUTE], "recompute_cap"
        if self.memory_limit != float("inf"):
            prob += self.mem_expr <= self.memory_limit / GIB, "memory_per_gpu"
        prob.setObjective(self.step_expr)

    def _add_engine(self, xP, xG) -> None:
        """The engine's restrictions (SearchSpace.triples, qgz_needs_p): one binary w_t per
        allowed triple t = (p, g, o), sum_t w_t = 1, and each factor binary the sum of the w_t
        that use it (so x picks an allowed triple, and w follows from x); qgZ at most where
        s_P > 1."""
        sp, prob, lin = self.space, self.prob, self.pulp.lpSum
        if sp.triples is not None:
            w = {t: prob.add_variable("w_{}_{}_{}".format(*t), cat="Binary") for t in sp.triples}
            prob += lin(w.values()) == 1, "one_engine_triple"
            for i, (name, x) in enumerate((("P", xP), ("G", xG), ("O", self.xO.__getitem__))):
                for f in sp.factors:
                    prob += x(f) == lin(v for t, v in w.items() if t[i] == f), f"engine_{name}_{f}"
        if sp.qgz_needs_p and self.xGq:
            prob += (lin(self.xGq.values()) <= lin(xP(f) for f in sp.factors if f > 1),
                     "engine_qgz_needs_p")

    def _add_time(self, xP, xG, J) -> None:
        """The step model (cost/step_time.py) as linear constraints: every stage's
        max(m + (1 - eta) c, c + sigma m) an auxiliary variable, the per-micro-batch sums times
        n_j linearised per activation option j (big-M on y_j). Sets ``step_expr``."""
        pulp, T, job, prob = self.pulp, self.T, self.job, self.prob
        B, lin, F = prob.add_variable, pulp.lpSum, self.space.factors
        idx = {c: i for i, c in enumerate(CLASSES)}
        vn, vq = self.vPn, self.vPq

        def col(d, vars_, i):
            return _dot(pulp, ((v, d[k][i]) for k, v in vars_.items()))

        q: dict = {}
        qx: dict = {}  # the compute-stream parts that are not the options' compute
        for c, i in idx.items():
            fwd_gather = col(T.ag, self.xPn, i) + col(T.agq, self.xPq, i)
            # linear in v and h: the P choice's gathers when H = 0, hpZ's when H = 1
            bwd_gather = col(T.ag, vn, i) + col(T.agq, vq, i) + col(T.hpz, self.h, i)
            fwd_kernel = col(T.ka, self.xPn, i) + col(T.kq, self.xPq, i)
            k_bwd = col(T.ka, vn, i) + col(T.kq, vq, i) + col(T.khz, self.h, i)
            q["gather_fwd", c] = fwd_gather
            q["gather_bwd", c] = bwd_gather
            q["reduce", c] = col(T.rs, self.xGn, i) + col(T.qgz, self.xGq, i)
            q["sync", c] = col(T.osrs, self.zGO, i) + col(T.ar, self.xO, i)
            qx["fwd", c] = fwd_kernel
            qx["bwd", c] = k_bwd + col(T.krs, self.xGn, i) + col(T.kg, self.xGq, i)
            q["fwd", c] = col(T.fwd, self.y, i) + fwd_kernel
            q["bwd", c] = col(T.bwd, self.y, i) + col(T.dbwd, self.k, i) + qx["bwd", c]
        Cu = _dot(pulp, ((v, T.upd[k]) for k, v in self.zPO.items()), T.metrics)
        t_opt = _dot(pulp, ((self.xO[o], T.opt[o]) for o in F))
        counts = {"embedding": 1, "block": job.model.num_layers, "head": 1}
        if self.objective == "comm":
            per_mb = lin(counts[c] * (q["gather_fwd", c] + q["gather_bwd", c] + q["reduce", c])
                         for c in CLASSES)
            bound = self._bound_comm()
            CC = B("C_micro", lowBound=0)
            for mb, (nj, ymb) in self._per_micro_batch(J).items():
                prob += CC >= nj * per_mb - nj * bound * (1 - ymb), f"comm_x_n_mb{mb}"
            tp_comm = (lin(self.y[j] * T.tpc[j] for j in J)
                       + lin(kj * T.dtpc[j] for j, kj in self.k.items()))
            self.step_expr = CC + lin(counts[c] * q["sync", c] for c in CLASSES) + Cu + tp_comm
            return
        gpu, eta = job.cluster.gpu, job.cluster.overlap_efficiency
        sig = gpu.comm_compute_slowdown
        n_aux = iter(range(10**6))

        def vmax(a, b):
            v = B(f"stage_{next(n_aux)}", lowBound=0)
            prob.addConstraint(v >= a, f"{v.name}_comm")
            prob.addConstraint(v >= b, f"{v.name}_compute")
            return v

        sts, ends = stages(job.model.num_layers, lambda r, c: q[r, c], 0)
        phase = {p: ends[p] + lin(st.count * stage_time(st.compute, st.comm, sig, eta, vmax)
                                  for st in sts if st.phase == p)
                 for p in ("forward", "backward", "last")}
        EF, EB = B("E_F", lowBound=0), B("E_B", lowBound=0)
        for mb, (nj, ymb) in self._per_micro_batch(J).items():
            prob += EF >= nj * phase["forward"] - nj * self._bound_phase("forward") * (
                1 - ymb), f"fwd_x_n_mb{mb}"
            if nj > 1:
                prob += EB >= (nj - 1) * phase["backward"] - (nj - 1) * self._bound_phase(
                    "backward") * (1 - ymb), f"bwd_x_n_mb{mb}"
        self._add_micro_batch_cuts(J, q, qx, EF, EB, sig, eta)
        self.step_expr = EF + EB + phase["last"] + t_opt + Cu

    def _add_micro_batch_cuts(self, J, q, qx, EF, EB, sig, eta) -> None:
        """Valid inequalities for E_F and E_B without the big-M of the micro-batch products.

        With several micro-batch sizes the LP relaxation splits y between them and the big-M
        rows ``E >= n (phase) - M (1 - Y_b)`` go slack: its root bound fell 45-88 % below the
        optimum (llama-7b/1024, degrees 2-8) and HiGHS branched on the micro-batch. A stage
        costs at least each argument of its max() (``stage_time``), so a phase is at least
        ``Yp(j) + Xp(x)`` with Yp the
        compute part of option j (a number per option, and per block checkpointed for k_j)
        and Xp the rest (gathers, reductions, kernels: linear in x, never negative). Times n_j,
        the compute part is exact in y and k (one option is chosen, n_j is its own), and
        n_j Xp >= n_min Xp. So, per phase p (forward: n; backward: n - 1),
            E_p >= sum_j (n_j - o) (y_j Yp1(j) + k_j dYp1(j)) + (n_min - o) Xp1(x)
        and the same with the other argument of the max(), (1 - eta) on the compute and
        comm + (1 - eta) kernels. Every integer solution satisfies them; the optimum is
        unchanged and the root bound is within about 1 %. With one micro-batch size the big-M
        rows are already exact (Y_b = 1) and no cut is added."""
        if len({j[0] for j in J}) < 2:
            return
        T, prob, lin = self.T, self.prob, self.pulp.lpSum
        L = self.job.model.num_layers
        idx = {c: i for i, c in enumerate(CLASSES)}
        phases = ("forward", "backward")

        def rest(r, c):  # everything but the options' compute
            return qx[r, c] if r in ("fwd", "bwd") else q[r, c]

        sts, ends = stages(L, rest, 0)
        x1 = {p: ends[p] + lin(st.count * (st.compute + sig * st.comm)
                               for st in sts if st.phase == p) for p in phases}
        x2 = {p: ends[p] + lin(st.count * (st.comm + (1 - eta) * st.compute)
                               for st in sts if st.phase == p) for p in phases}

        def compute_part(fwd, bwd):  # {phase: sum over stages of count x the option's compute}
            def qc(r, c):
                d = fwd if r == "fwd" else bwd if r == "bwd" else None
                return d[idx[c]] if d is not None else 0.0
            got, _ = stages(L, qc, 0.0)
            return {p: sum(st.count * st.compute for st in got if st.phase == p) for p in phases}

        Y = {j: compute_part(T.fwd[j], T.bwd[j]) for j in J}
        dY = {j: compute_part(None, T.dbwd[j]) for j in self.k}
        n_min = min(T.n[j] for j in J)
        for p, E, o in (("forward", EF, 0), ("backward", EB, 1)):
            yc = _dot(self.pulp, [*((self.y[j], (T.n[j] - o) * Y[j][p]) for j in J),
                                  *((kj, (T.n[j] - o) * dY[j][p]) for j, kj in self.k.items())])
            prob += E >= yc + (n_min - o) * x1[p], f"{p}_micro_batch_cut_1"
            prob += E >= (1 - eta) * yc + (n_min - o) * x2[p], f"{p}_micro_batch_cut_2"

    def _per_micro_batch(self, J) -> dict:
        """micro-batch -> (n, the sum of its options' y): the products with n need one big-M
        per micro-batch, not per option (the checkpointing options of a micro-batch share n)."""
        out: dict = {}
        for j in J:
            n, ys = out.get(j[0], (self.T.n[j], []))
            out[j[0]] = (n, ys + [self.y[j]])
        return {mb: (n, self.pulp.lpSum(ys)) for mb, (n, ys) in out.items()}

    def _qmax(self) -> dict:
        """Each (role, class) quantity's largest value over the space (for big-M bounds)."""
        T = self.T
        out = {}
        for i, c in enumerate(CLASSES):
            top = functools.partial(_top, i)
            out["gather_fwd", c] = top(T.ag, T.agq)
            out["gather_bwd", c] = top(T.ag, T.agq, T.hpz)
            out["reduce", c] = top(T.rs, T.qgz)
            out["sync", c] = top(T.osrs) + top(T.ar)
            out["fwd", c] = top(T.fwd) + top(T.ka, T.kq)
            out["bwd", c] = top(T.bwd, T.bwd_hi) + top(T.ka, T.kq, T.khz) + top(T.krs, T.kg)
        return out

    def _bound_phase(self, phase: str) -> float:
        """An upper bound of one micro-batch's phase time: every stage at c + m, all maximal."""
        qm = self._qmax()
        sts, ends = stages(self.job.model.num_layers, lambda r, c: qm[r, c], 0.0)
        return ends[phase] + sum(st.count * (st.compute + st.comm) for st in sts
                                 if st.phase == phase)

    def _bound_comm(self) -> float:
        """An upper bound of one micro-batch's collective time."""
        qm = self._qmax()
        L = self.job.model.num_layers
        return sum((L if c == "block" else 1) * (qm["gather_fwd", c] + qm["gather_bwd", c]
                                                 + qm["reduce", c]) for c in CLASSES)

    def _comm_expr(self, xP):
        """GiB of NCCL communicators: one per distinct (size, stride) of the used group kinds.
        Sets ``groups_expr``, the number of process groups (used by the tie-break)."""
        T, job, lin = self.T, self.job, self.pulp.lpSum
        self.u_bounds = {}
        t = self.space.tp  # data-parallel kinds: sizes over the N/t ranks, strides x t
        n, r = job.num_gpus // t, max(1, job.gpus_per_node // t)
        world = (job.num_gpus, 1)
        uses = [((f, t), xP(f)) for f in self.xPn if f > 1]
        uses += [((z, t), v) for z, v in self.h.items()]
        uses += [((g, t), v) for g, v in self.xGn.items() if g > 1]
        for g, v in self.xGq.items():
            uses += [((min(g, r), t), v), ((max(1, g // r), r * t), v)]
        uses += [((o // g, g * t), v) for (g, o), v in self.zGO.items() if o > g]
        uses += [((n // o, o * t), v) for o, v in self.xO.items() if o < n]
        uses += [((o // p, p * t), v) for (p, o), v in self.zPO.items() if o > p]
        for key, v in uses:
            if key[0] > 1 and key != world:
                self.u_bounds.setdefault(key, []).append(v)
        self.u = {k: self.prob.add_variable(f"u_{k[0]}_{k[1]}", lowBound=0)
                  for k in self.u_bounds}
        for k, bounds in self.u_bounds.items():
            for i, b in enumerate(bounds):
                self.prob += self.u[k] >= b, f"comm_{k[0]}_{k[1]}_{i}"
        # always used: the world (N > 1) and, with t > 1, the TP group unless it is the world
        self.groups_floor = (1 if job.num_gpus > 1 else 0) + (1 if 1 < t < job.num_gpus else 0)
        self.groups_expr = lin(self.u.values()) + self.groups_floor
        if not T.comm:
            return 0
        a2a = lin(v * T.a2a[g] for g, v in self.xGq.items())
        return T.comm * self.groups_expr + a2a

    # ----- solving ----------------------------------------------------------------------------
    def _solver(self):
        pulp = self.pulp
        if self.solver_name == "highs":
            return pulp.HiGHS(msg=False, timeLimit=self.time_limit_s, gapRel=0.0, gapAbs=0.0,
                              threads=1, mip_feasibility_tolerance=1e-9,
                              primal_feasibility_tolerance=1e-9, **HIGHS_SPEED)
        if self.solver_name == "cbc":
            with warnings.catch_warnings():  # PuLP 3.3 announces the bundled CBC's removal in 4.0
                warnings.simplefilter("ignore", DeprecationWarning)
                return pulp.PULP_CBC_CMD(msg=False, timeLimit=self.time_limit_s, gapRel=0.0,
                                         gapAbs=0.0)
        raise ValueError(f"unknown solver {self.solver_name}")

    def _run(self) -> int:
        pulp = self.pulp
        t0 = _time.perf_counter()
        with _quiet_stdout():
            if self.solver_name == "highs":
                status = self._run_highs()
            else:
                status = self.prob.solve(self._solver())
        self.stats.solve_time_s += _time.perf_counter() - t0
        self.stats.solves += 1
        self.stats.status = pulp.LpStatus[status]
        if status == pulp.LpStatusInfeasible:
            return status
        if status != pulp.LpStatusOptimal or self.prob.sol_status != pulp.LpSolutionOptimal:
            raise SolverError(
                f"{self.solver_name} stopped without proving optimality "
                f"(status {pulp.LpStatus[status]}, solution {pulp.LpSolution[self.prob.sol_status]}); "
                "raise --time-limit or try --solver cbc"
            )
        return status

    def _run_highs(self) -> int:
        """Solve the PuLP problem in one HiGHS instance kept across this model's re-solves:
        built once (PuLP's own HiGHS interface: columns, rows, integrality), then only what a
        re-solve changes is passed on (the objective, changed bounds, rows added since: the
        caps are variables' bounds, a no-good cut is a new row). PuLP's `prob.solve` would
        rebuild the whole HiGHS model from Python each time. The solution is read back into the
        PuLP variables, so `pulp.value` works as after `prob.solve`."""
        prob, api = self.prob, self._api
        if api is None:
            api = self._api = self._solver()
            api.createAndConfigureSolver(prob)
            api.buildSolverModel(prob)
            self._cols = prob.variables()
            assert [v.index for v in self._cols] == list(range(len(self._cols)))
            import highspy

            self._optimal = highspy.HighsModelStatus.kOptimal
            self._bounds = [(v.lowBound, v.upBound) for v in self._cols]
            self._rows = prob.numConstraints()
        else:
            self._sync_highs()
        h = prob.solverModel
        sign = -1 if prob.sense == self.pulp.LpMaximize else 1  # as PuLP's own build: the
        h.changeColsCost(len(self._cols), list(range(len(self._cols))),  # constant left out
                         [sign * prob.objective.get(v, 0.0) for v in self._cols])
        api.callSolver(prob)
        if h.getModelStatus() == self._optimal:  # the values by column index, as PuLP reads
            for v, x in zip(self._cols, h.getSolution().col_value, strict=True):  # them back
                v.varValue = x  # (without listing the problem's variables at every solve)
            status, sol_status = self.pulp.LpStatusOptimal, self.pulp.LpSolutionOptimal
        else:  # PuLP's own mapping of every other status
            status, sol_status = api.findSolutionValues(prob)
        prob.assignStatus(status, sol_status)
        return status

    def _sync_highs(self) -> None:
        """Pass the bounds changed and the rows added since the last solve to HiGHS."""
        prob, h, inf = self.prob, self.prob.solverModel, float("inf")
        changed = [(i, v.lowBound, v.upBound) for i, v in enumerate(self._cols)
                   if (v.lowBound, v.upBound) != self._bounds[i]]
        for i, lo, up in changed:
            h.changeColBounds(i, -inf if lo is None else lo, inf if up is None else up)
            self._bounds[i] = (lo, up)
        if prob.numVariables() != len(self._cols):
            raise AssertionError("a variable was added after the HiGHS model was built")
        if prob.numConstraints() == self._rows:
            return
        for c in prob.constraints()[self._rows:]:  # in the order added (PuLP 3.3 and 4)
            items = [(v.index, a) for v, a in c.items() if a != 0]
            lo, up = c.getLb(), c.getUb()
            h.addRow(-inf if lo is None else lo, inf if up is None else up, len(items),
                     [i for i, _ in items], [a for _, a in items])
            c.index = self._rows
            self._rows += 1

    def _decode(self) -> Strategy:
        val = self.pulp.value

        def pick(d):
            chosen = [k for k, v in d.items() if (val(v) or 0) > 0.5]
            return chosen[0] if chosen else None

        p = pick(self.xPn) or pick(self.xPq)
        g = pick(self.xGn) or pick(self.xGq)
        o = pick(self.xO)
        mb, ck = pick(self.y)
        if ck == "K":
            ck = self.T.krange[mb, ck][0] + round(val(self.k[mb, ck]))
        return Strategy(s_p=p, s_g=g, s_os=o, qwz=pick(self.xPq) is not None,
                        hpz=pick(self.h) or 1, qgz=pick(self.xGq) is not None, tp=self.space.tp,
                        micro_batch=mb, **ckpt_fields(ck, self.job.model.num_layers))

    def _objective(self) -> float:
        """Objective of the current solution in seconds."""
        return self.pulp.value(self.step_expr) * self.T.time_unit

    def _memory(self) -> float:
        """Memory (GiB) of the current solution, with the staging term at its true value
        (the variable is only bounded below, so it may float up when memory is not minimised)."""
        val = self.pulp.value
        true_st = max(val(b) or 0.0 for b in self.st_bounds)
        frag = self.job.cluster.gpu.fragmentation_fraction
        extra_u = sum((val(self.u[k]) or 0.0) - max(val(b) or 0.0 for b in bounds)
                      for k, bounds in self.u_bounds.items())
        return (val(self.mem_expr) - (1 + frag) * ((val(self.st) or 0.0) - true_st)
                - self.T.comm * extra_u)

    def _decision_vars(self):
        for d in (self.xPn, self.xPq, self.xGn, self.xGq, self.xO, self.h, self.y):
            yield from d.values()

    def _solution(self) -> IlpSolution:
        ones = tuple(v for v in self._decision_vars() if (self.pulp.value(v) or 0) > 0.5)
        s = self._decode()
        return IlpSolution(s, self._objective(), self._memory(), self.stats.status, ones,
                           process_groups(s, self.job.num_gpus, self.job.gpus_per_node))

    def _exact_solution(self, decision: dict) -> IlpSolution:
        """`decision` (binary -> 0/1) with its exact objective: the stage variables are only
        bounded below, so under another objective they may float up; with the decision binaries
        fixed, minimising the objective brings them down to the model's values (an LP)."""
        fixed = [(v, v.lowBound, v.upBound) for v in decision]
        for v, x in decision.items():
            v.lowBound = v.upBound = x
        self.prob.setObjective(self.step_expr)
        saved = {c: c.upBound for c in (self.cap, *self.caps.values())}
        for c in saved:
            c.upBound = None
        try:
            self._run()
            return self._solution()
        finally:
            for c, ub in saved.items():
                c.upBound = ub
            for v, lo, up in fixed:
                v.lowBound, v.upBound = lo, up

    def _quant_vars(self):
        return list(self.xPq.values()) + list(self.xGq.values())

    def _run_capped(self, cap, value: float, rtols: tuple[float, ...]) -> bool:
        """Solve the current objective with `cap` at `value`, the relative slack `rtols` tried
        in turn (HiGHS does not always re-attain a previous optimum to 1e-9: its feasibility
        tolerance is 1e-7). False when none holds."""
        for rtol in rtols:
            cap.upBound = value + abs(value) * rtol + 1e-12
            if self._run() != self.pulp.LpStatusInfeasible:
                return True
        return False

    def solve(self, runners_up: int = 0, preference: Preference = FASTEST
              ) -> tuple[list[IlpSolution], IlpStats, dict]:
        """The preferred solution of this model alone (``solve_models``)."""
        return solve_models([self], runners_up, preference)

    # ----- steps of the choice, for one model or several (``solve_models``) ------------------
    def _fastest(self) -> IlpSolution | None:
        self.build()
        self.prob.setObjective(self.step_expr)
        if self._run() == self.pulp.LpStatusInfeasible:
            return None
        return self._solution()

    def _fix_lossless(self, on: bool) -> None:
        for v in self._quant_vars():
            v.upBound = 0 if on else None

    def _tie_break(self, name: str, pending) -> float | None:
        """Minimise tie-break `name` under the caps in `pending` (cap, value, rtols); its
        optimum, or None when no slack holds. Keeps the decision in ``snapshot``."""
        expr = {RECOMPUTE: self.recompute_expr, GROUPS: self.groups_expr,
                MEMORY: self.mem_expr}[name]
        self.prob.setObjective(expr)
        if not self._run_capped(*pending):
            return None
        value = self.pulp.value
        self.snapshot = {v: round(value(v) or 0) for v in (*self._decision_vars(),
                                                            *self.k.values())}
        return value(expr)

    def _next_runner_up(self, excluded: IlpSolution) -> IlpSolution | None:
        """The best solution by objective once `excluded` is cut off (a no-good cut)."""
        pulp = self.pulp
        ones = {v.name for v in excluded.decision}
        self.prob += pulp.lpSum(1 - v if v.name in ones else v
                                for v in self._decision_vars()) >= 1, f"exclude_{self.cuts}"
        self.cuts += 1
        if self._run() == pulp.LpStatusInfeasible:
            return None
        return self._solution()

    def _release(self) -> None:
        """Back to the objective alone: no caps, quantization allowed."""
        for cap in (self.cap, *self.caps.values()):
            cap.upBound = None
        self._fix_lossless(False)
        self.prob.setObjective(self.step_expr)


def _merged_stats(models: list[StrategyIlp], owner: StrategyIlp | None = None) -> IlpStats:
    """The models' statistics summed; the status is that of the model chosen from."""
    if len(models) == 1:
        return models[0].stats
    st = [m.stats for m in models]
    return IlpStats(solver=st[0].solver, status=(owner or models[0]).stats.status,
                    solve_time_s=sum(x.solve_time_s for x in st),
                    build_time_s=sum(x.build_time_s for x in st),
                    num_variables=sum(x.num_variables for x in st),
                    num_constraints=sum(x.num_constraints for x in st),
                    solves=sum(x.solves for x in st))


def solve_models(models: list[StrategyIlp], runners_up: int = 0,
                 preference: Preference = FASTEST, idle: Callable[[], object] | None = None
                 ) -> tuple[list[IlpSolution], IlpStats, dict]:
    """The preferred solution over the models (one per tensor-parallel degree, each a part of
    the space), up to `runners_up` more by objective, and the points the choice was made
    against: {'fastest': ..., 'fastest_lossless': ...} where they differ.

    The rule (``Preference``) is applied across the models as the brute force applies it to
    their union: the fastest over all; lossless unless the fastest quantized solution of any
    model beats the fastest lossless of all by more than the band (then every model is
    restricted to lossless solutions); the band's cap at the global best; each tie-break
    minimised in every model still in the race under the caps, the models above the least
    value dropped and the caps set to it; the chosen solution the exact one of the models
    left, the lowest (objective, memory, strategy). With one model this is the sequence of
    lexicographic re-solves of the module docstring.

    `idle`: work the caller does next that does not depend on the solves (imports for the
    output), run by this thread once while the second round's models solve in the solver
    threads (``_mapper``); not run where there is no such round."""
    threads = _threads(models)
    t0 = _time.perf_counter()
    with _quiet_stdout(), _mapper(threads, idle) as each:
        sols, stats, refs = _choose(models, runners_up, preference, each)
    if len(models) > 1:  # the wall time: in threads the models' solves overlap
        stats.solve_time_s = _time.perf_counter() - t0
    return sols, stats, refs


def _threads(models: list[StrategyIlp]) -> int:
    """Solver threads for `models`: one per model up to the CPUs this process may use, HiGHS
    only (each model is its own HiGHS instance, which runs without the GIL; CBC runs as a
    subprocess through PuLP's warnings-filter juggling, which is not thread-safe)."""
    if len(models) < 2 or any(m.solver_name != "highs" for m in models):
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(len(models), cpus))


@contextlib.contextmanager
def _mapper(threads: int, idle: Callable[[], object] | None = None):
    """`each(fn, models)`: {id(m): fn(m) for m in models}, the models solved in `threads`
    threads. The models share nothing (each its own PuLP problem and HiGHS instance), so the
    results are those of the serial loop. In the first round after the first (which builds the
    models: Python work, under the GIL), the calling thread runs `idle` while the round's
    models solve (HiGHS runs without the GIL), and then collects their results; an error in
    `idle` is left to come up again when the caller does that work itself."""
    if threads < 2:
        yield lambda fn, ms: {id(m): fn(m) for m in ms}
        return
    from concurrent.futures import ThreadPoolExecutor

    rounds = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="amsp-ilp") as ex:
        def each(fn, ms):
            nonlocal rounds, idle
            rounds += 1
            if idle is not None and ms and rounds > 1:
                futures = [ex.submit(fn, m) for m in ms]
                work, idle = idle, None
                with contextlib.suppress(Exception):
                    work()
                return {id(m): f.result() for m, f in zip(ms, futures, strict=True)}
            results = ex.map(fn, ms) if len(ms) > 1 else [fn(m) for m in ms]
            return {id(m): r for m, r in zip(ms, results, strict=True)}

        yield each


LOSSLESS_BATCH = 2
"""Lossless re-solves started together (in parallel where there are threads). A fixed number,
not the thread count: which models are solved (and the solve count a plan file records) must
not depend on the machine."""


def _lossless_fastest(m: StrategyIlp) -> IlpSolution | None:
    m._fix_lossless(True)
    try:
        return m._fastest()
    finally:
        m._fix_lossless(False)


def _choose(models: list[StrategyIlp], runners_up: int, preference: Preference, each
            ) -> tuple[list[IlpSolution], IlpStats, dict]:
    """``solve_models``' rule, each round of independent solves (one per model) through
    `each` (``_mapper``)."""
    refs: dict = {}
    for m in models:
        m.snapshot, m.cuts = None, 0
    fastest = each(StrategyIlp._fastest, models)
    alive = [m for m in models if fastest[id(m)] is not None]
    if not alive:
        return [], _merged_stats(models), refs

    def best_of(sols: dict) -> tuple[StrategyIlp, IlpSolution]:
        return min(((m, sols[id(m)]) for m in alive if sols.get(id(m)) is not None),
                   key=lambda ms: ms[1].objective)

    owner, chosen = best_of(fastest)
    refs["fastest"] = chosen
    best_obj = chosen.objective
    low = {id(m): fastest[id(m)].objective for m in alive}  # each model's admissible optimum,
    if preference.quantization == "auto":                   # or a lower bound of it
        if chosen.strategy.quantized:
            # each model's lossless optimum, in the order of their fastest (a lower bound of
            # it), LOSSLESS_BATCH at a time: a model whose fastest is beyond the best lossless
            # found cannot hold the best lossless, so it is not solved (its fastest stays its
            # lower bound)
            order = sorted(alive, key=lambda m: fastest[id(m)].objective)
            lossless = {id(m): fastest[id(m)] for m in order
                        if not fastest[id(m)].strategy.quantized}
            todo = [m for m in order if fastest[id(m)].strategy.quantized]
            skipped = set()
            while todo:
                found = [v.objective for v in lossless.values() if v is not None]
                if found:
                    skipped |= {id(m) for m in todo
                                if fastest[id(m)].objective > min(found) * (1 + 1e-9)}
                    todo = [m for m in todo if id(m) not in skipped]
                batch, todo = todo[:LOSSLESS_BATCH], todo[LOSSLESS_BATCH:]
                lossless.update(each(_lossless_fastest, batch))
            if any(v is not None for v in lossless.values()):
                lo_owner, lo = best_of(lossless)
                if not lo.objective > best_obj * (1 + preference.band) * (1 + TIME_RTOL):
                    best_obj, owner, chosen = lo.objective, lo_owner, lo
                    refs["fastest_lossless"] = lo
                    alive = [m for m in alive
                             if id(m) in skipped or lossless[id(m)] is not None]
                    for m in alive:
                        m._fix_lossless(True)
                        if id(m) not in skipped:
                            low[id(m)] = lossless[id(m)].objective
        else:  # the fastest is lossless: quantized candidates are not admissible
            for m in alive:
                m._fix_lossless(True)
    # a model whose admissible optimum is beyond the band's edge has nothing in the band
    edge = best_obj * (1 + preference.band) * (1 + PHASE2_RTOLS[-1])
    alive = [m for m in alive if m is owner or low[id(m)] <= edge]
    # lexicographic re-solves inside the band: each tie-break minimised with the objective
    # capped at the band's edge and the earlier tie-breaks at their optimum
    # (objectives compare in seconds across models; each model's cap is in its time unit)
    pending = {id(m): (m.cap, best_obj / m.T.time_unit * (1 + preference.band), PHASE2_RTOLS)
               for m in alive}
    solved = False  # whether a tie-break solve has held (the chosen is then re-derived)
    for name in preference.tie_breaks:
        floor = min(m.groups_floor for m in alive)
        at_floor = (chosen.groups == floor if name == GROUPS else
                    name == RECOMPUTE and not chosen.strategy.ckpt_value)
        if at_floor and not solved:
            # the admissible optimum is already at this criterion's least: no re-solve
            for m in alive:
                cap, v, rtols = pending[id(m)]
                cap.upBound = v + abs(v) * rtols[0] + 1e-12
                pending[id(m)] = (m.caps[name], floor if name == GROUPS else 0.0, (0.0,))
            if name == GROUPS:  # models that cannot reach it drop (the others fail their solve)
                alive = [m for m in alive if m.groups_floor <= floor]
            continue

        def tie_break(ms, name=name, pending=pending):
            return each(lambda x: x._tie_break(name, pending[id(x)]), ms)

        if name == GROUPS:
            # a model has at least its floor of groups: the models of a floor above the least
            # found cannot tie with it, so they are not solved (levels in increasing order)
            values: dict = {}
            for level in sorted({m.groups_floor for m in alive}):
                found = [v for v in values.values() if v is not None]
                if found and round(min(found)) < level:
                    break
                values.update(tie_break([m for m in alive if m.groups_floor == level]))
        else:
            values = tie_break(alive)
        held = [m for m in alive if values.get(id(m)) is not None]
        if not held:
            break  # no slack holds: the last decision that held stands
        solved = True
        # compared across models in common units: recompute is in each model's time unit
        scale = {id(m): m.T.time_unit if name == RECOMPUTE else 1.0 for m in held}
        least = min(values[id(m)] * scale[id(m)] for m in held)
        if name == GROUPS:
            alive = [m for m in held if round(values[id(m)]) <= round(least)]
            pending = {id(m): (m.caps[name], round(least), (0.0,)) for m in alive}
        else:
            alive = [m for m in held
                     if values[id(m)] * scale[id(m)] <= least * (1 + 1e-6) + 1e-12]
            pending = {id(m): (m.caps[name], values[id(m)], PHASE2_RTOLS) for m in alive}
    if solved:
        held = [m for m in alive if m.snapshot is not None]
        got = each(lambda m: m._exact_solution(m.snapshot), held)
        exact = [(m, got[id(m)]) for m in held]
        owner, chosen = min(exact, key=lambda ms: (ms[1].objective, ms[1].memory_gib,
                                                   str(ms[1].strategy)))
    out = [chosen]
    # runners-up: exclude each found decision, back to the objective alone
    for m in models:
        m._release()
    if runners_up:
        # another model's best by objective alone is its fastest (the same problem as the
        # first solve: caps released, quantization allowed, no cut in it)
        pool = {id(m): (m, m._next_runner_up(chosen) if m is owner else fastest.get(id(m)))
                for m in models}
        for k in range(runners_up):
            left = [(m, sol) for m, sol in pool.values() if sol is not None]
            if not left:
                break
            m, sol = min(left, key=lambda ms: ms[1].objective)
            out.append(sol)
            pool[id(m)] = (m, m._next_runner_up(sol) if k < runners_up - 1 else None)
    return out, _merged_stats(models, owner), refs
