"""The step, unit by unit: prefetch, overlap, contention, and what stays exposed.

Units run in order (embedding, blocks 1..L, head) forward and in reverse backward; the runtime
(and FSDP2) prefetch one unit ahead: while unit i computes, the gather of the next unit is in
flight (two gather buffers), and in backward also the gradient reduction of the unit just
finished (two gradient buffers). Collectives of one step run in issue order on the network.

Per micro-batch and unit i, with c = its compute (forward: f_i; backward: g_i, which under
checkpointing includes the recomputed forward) and m = the communication in flight during it:

  forward   m_i = a_{i+1}                         (the next unit's gather)
  backward  m_i = b_{i-1} + r_{i+1} (+ s_{i+1})   (next gather, last reduction, and on the last
                                                   micro-batch the step-boundary sync)

a unit takes  v_i = max(m_i + (1 - eta) c_i,  c_i + sigma m_i)

sigma = ``gpu.comm_compute_slowdown``: NCCL's kernels share the SMs and HBM with the matmuls,
so each second of communication under compute adds sigma seconds to it (with the collective
spanning the whole compute, c' = c / (1 - sigma)). eta = ``overlap_efficiency``: the fraction of
compute that can hide communication (1 on GPUs; 0 on CPU processes, whose collectives share the
cores: then v = c + m, fully serialised). The form is exact for a compute kernel slowed while a
collective overlaps it: if the collective ends first, v = c + sigma m; if it outlasts the
compute, v = m (and max() picks the right one in both cases).

What is exposed, and why:
- the first gather of each micro-batch forward, a_embedding (nothing computes before it; the
  embedding has no compute, so the first block's gather shows too, as max(0 + ..., a_block));
- the first gather of backward, b_head (the head's parameters were released after forward);
- the last reduction of backward, r_embedding (+ its sync on the last micro-batch);
- the optimizer step T_opt (it needs the synchronised gradient), and the update all-gather of
  the new parameters and the metrics all-reduce after it (the next forward needs them);
- any unit whose communication outlasts its compute: v_i - c_i.
Quantization kernels (qwZ, qgZ) run on the compute stream: they add to the unit's compute and
hide nothing.

  step = n (a_E + sum_i v_i^fwd) + (n - 1)(b_H + sum_i v_i^bwd + r_E) + (b_H + sum_i v_i^last
         + r_E + s_E) + T_opt + C_update

With one unit, sigma = 0 and eta = 1 this is the closed form of earlier versions; with equal
units it is the pipeline C/U + T + (U-1)/U max(0, C - T) per phase.

Tensor parallelism (``tp=T``): the TP collectives (group ``TP``, cost/schedule.py) sit between
a unit's matmuls, each consuming the previous kernel's output and feeding the next, so they are
on the compute stream's critical path: their seconds are added to the unit's c (forward, or
backward, where the recomputed forward's also go); with ``tp_overlap`` (torchtitan's async TP,
Megatron's --tp-comm-overlap) a block's all-gathers and reduce-scatters add only what
cost/tp_overlap.py's pipelined rule leaves exposed. The data-parallel collectives in flight
during the unit overlap all of it, TP
collectives included, and slow it by sigma as they do compute. ``StepTime.tp_comm_s`` reports
them apart, and ``exposed_comm_s`` includes them.

Mixture of experts (docs/moe.md): the token all-to-alls (group ``EP``,
cost/moe_schedule.py) are on the critical path as TP's are (the expert matmuls wait for the
dispatch, the next block for the combine): added to their unit's compute, none hidden, reported
in ``StepTime.ep_comm_s``. The expert class's gathers and reductions overlap as the dense
class's, in the same roles.

Optimizer: T_opt = (Phi / s_OS) x bytes per element / ``gpu.optimizer_gbyte_per_s``: AdamW on
the rank's optimizer shard, memory-bound.

``stage_terms`` builds these terms once, for numbers (``step_time``) and for the ILP's linear
expressions alike (solver/step_rows.py passes its own max()), so both price a strategy the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from amsp_planner.cost.compute import unit_computes
from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import OPTIMIZER_BYTES
from amsp_planner.cost.schedule_entry import CLASSES, ScheduleEntry
from amsp_planner.cost.straggler import straggler_seconds, sync_seconds
from amsp_planner.cost.tp_schedule import tp_entries

ROLES = ("gather_fwd", "gather_bwd", "reduce", "sync")
"""Per-unit communication roles (seconds per call, per unit class)."""


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    exposed_forward_s: float
    exposed_backward_s: float
    exposed_update_s: float
    comm_total_s: float
    """All collective time of the step, overlapped or not."""
    optimizer_s: float = 0.0
    """The AdamW step on the rank's optimizer shard (with the optimizer offloaded: the CPU step
    and the copy of the updated parameters to the GPU, cost/offload.py)."""
    contention_s: float = 0.0
    """Compute slowed by communication running under it."""
    kernel_s: float = 0.0
    """Quantization kernels on the compute stream."""
    tp_comm_s: float = 0.0
    """Tensor-parallel collectives, on the compute stream's critical path (none hidden)."""
    ep_comm_s: float = 0.0
    """Mixture of experts: the token all-to-alls (group EP), on the critical path as TP's."""
    cp_comm_s: float = 0.0
    """Context parallelism: the K/V exchange (group CP), on the critical path as TP's."""
    bubble_s: float = 0.0
    """Pipeline parallelism: the stage's idle time, (P-1)/V micro-batches' work (cost/pipeline.py)."""
    p2p_s: float = 0.0
    """Pipeline parallelism: the exposed point-to-point activation and gradient sends."""
    straggler_s: float = 0.0
    """Waiting for the slowest of the job's ranks: the cluster's ``rank_jitter`` x the rank's
    compute x E[max of N standard normals] (cost/straggler.py; 0 when the jitter is 0)."""
    sync_s: float = 0.0
    """The cluster's ``collective_rank_us`` x the ranks of every data-parallel collective call
    of the step, not hidden by compute (cost/straggler.py; 0 when that is 0)."""

    @property
    def exposed_comm_s(self) -> float:
        return (self.exposed_forward_s + self.exposed_backward_s + self.exposed_update_s
                + self.tp_comm_s + self.ep_comm_s + self.cp_comm_s + self.p2p_s)

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.kernel_s + self.optimizer_s + self.contention_s
                + self.exposed_comm_s + self.bubble_s + self.straggler_s
                + self.sync_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.tp_comm_s:
            del d["tp_comm_s"]  # plans without TP keep their fields
        for key in ("ep_comm_s", "cp_comm_s", "bubble_s", "p2p_s", "straggler_s", "sync_s"):
            if not d[key]:
                del d[key]  # plans without them keep their fields
        d.update(exposed_comm_s=self.exposed_comm_s, step_s=self.step_s)
        return d


def optimizer_bytes_per_element(param_bytes: int, grad_bytes: int) -> int:
    """Memory traffic of one AdamW element: read and write the fp32 master, exp_avg and
    exp_avg_sq (the optimizer state, twice), read the gradient, read the master again and write
    the new parameter in its dtype."""
    return 2 * OPTIMIZER_BYTES + grad_bytes + 4 + param_bytes


def optimizer_time(job: Job, s_os: int, tp: int = 1) -> float:
    """Seconds of the AdamW step on the Phi / s_os elements of one rank's optimizer shard
    (Phi: one TP rank's padded parameters)."""
    t = job.training
    if t.optimizer_offload == "cpu":  # the CPU step and the copy back (cost/offload.py)
        from amsp_planner.cost.offload import host_step_time

        return host_step_time(job, job.tp_phi(tp) / s_os)
    rate = job.cluster.gpu.optimizer_gbyte_per_s * 1e9
    return (job.tp_phi(tp) / s_os * optimizer_bytes_per_element(t.param_bytes, t.grad_bytes)
            / rate)


def expert_optimizer_time(job: Job, ep: int, ep_os: int) -> float:
    """Seconds of the AdamW step on a rank's expert optimizer shard (the E/ep experts it holds,
    over ep_os); 0 for a dense model."""
    if not job.model.is_moe:
        return 0.0
    t = job.training
    rate = job.cluster.gpu.optimizer_gbyte_per_s * 1e9
    return (sum(job.expert_units(ep)) / ep_os
            * optimizer_bytes_per_element(t.param_bytes, t.grad_bytes) / rate)


# ----- the terms, for numbers and for linear expressions alike -------------------------------
@dataclass
class Stage:
    """`count` units in a row with the same compute and communication."""

    phase: str
    """'forward', 'backward' (not the last micro-batch) or 'last' (the last backward)."""
    count: int
    compute: object
    comm: object
    key: tuple = ()
    """The unit classes that make the stage (units with equal keys merge)."""


def unit_sequence(num_layers: int) -> list[str]:
    return ["embedding"] + ["block"] * num_layers + ["head"]


def stages(num_layers: int, q: Callable[[str, str], object], zero) -> tuple[list[Stage], dict]:
    """The stages of one micro-batch and the exposed ends (module docstring).

    `q(role, cls)` gives a unit class's quantity: roles of ``ROLES`` (communication seconds) and
    'fwd', 'bwd' (compute incl. its kernels). Returns (stages, ends) with ends the exposed
    first gathers and last reductions per phase.

    Blocks between blocks are all alike, so the stages of L > 3 blocks are those of 3 with the
    runs of inner blocks counted L - 1 (forward: a block before a block) and L - 2 (backward:
    a block between blocks) times.
    """
    if num_layers > 3:
        out, ends = stages(3, q, zero)
        for st in out:
            if st.key == ("block", "block"):
                st.count = num_layers - 1
            elif st.key == ("block", "block", "block"):
                st.count = num_layers - 2
        return out, ends
    seq = unit_sequence(num_layers)
    out: list[Stage] = []

    def add(phase, key, compute, comm):
        if out and out[-1].phase == phase and out[-1].key == key:
            out[-1].count += 1
        else:
            out.append(Stage(phase, 1, compute, comm, key))

    for i, cls in enumerate(seq):
        nxt = seq[i + 1] if i + 1 < len(seq) else None
        add("forward", (cls, nxt), q("fwd", cls), q("gather_fwd", nxt) if nxt else zero)
    rev = seq[::-1]
    for phase in ("backward", "last"):
        for i, cls in enumerate(rev):
            prev = rev[i - 1] if i else None
            nxt = rev[i + 1] if i + 1 < len(rev) else None
            comm = zero
            if nxt:
                comm = comm + q("gather_bwd", nxt)
            if prev:
                comm = comm + q("reduce", prev)
                if phase == "last":
                    comm = comm + q("sync", prev)
            add(phase, (cls, prev, nxt), q("bwd", cls), comm)
    first, last = seq[0], seq[-1]
    ends = {"forward": q("gather_fwd", first), "backward": q("gather_bwd", last) + q("reduce", first),
            "last": q("gather_bwd", last) + q("reduce", first) + q("sync", first)}
    return out, ends


def stage_time(compute, comm, sigma: float, eta: float, maxfn):
    """v = max(m + (1 - eta) c, c + sigma m)."""
    return maxfn(comm + (1.0 - eta) * compute, compute + sigma * comm)


# ----- numbers --------------------------------------------------------------------------------
def unit_quantities(job: Job, schedule: tuple[ScheduleEntry, ...], micro_batch: int,
                    ckpt: bool | int | str, tp: int = 1, ep: int = 1
                    ) -> dict[tuple[str, str], float]:
    """(role, class) -> seconds for one micro-batch: communication per call by role, and
    compute ('fwd', 'bwd') with the quantization kernels and the TP collectives of that
    unit."""
    qty = {(r, c): 0.0 for r in ROLES + ("fwd", "bwd") for c in CLASSES}
    for e in schedule:
        role = entry_role(e)
        if role is None:
            continue
        if role in TP_ROLES:
            for c, t in zip(CLASSES, e.unit_time_s, strict=True):
                qty[TP_ROLES[role], c] += t
            continue
        assert role != "sync" or not e.kernel_s, "per-step entries have no compute-stream kernels"
        for c, t, k in zip(CLASSES, e.unit_time_s, e.unit_kernel_s, strict=True):
            qty[role, c] += t
            qty["fwd" if role == "gather_fwd" else "bwd", c] += k
    for c, uc in unit_computes(job, micro_batch, ckpt, tp, ep).items():
        qty["fwd", c] += uc.forward
        qty["bwd", c] += uc.backward
    return qty


TP_ROLES = {"tp_fwd": "fwd", "tp_bwd": "bwd"}
"""TP collectives' roles, and the compute quantity each adds to (module docstring)."""


def tp_unit_seconds(job: Job, tp: int, micro_batch: int, ckpt: bool | int | str
                    ) -> dict[tuple[str, str], float]:
    """('fwd' | 'bwd', class) -> seconds of one micro-batch's TP collectives per unit, as
    ``unit_quantities`` adds them to compute (the ILP's tables read the same entries)."""
    out = {(r, c): 0.0 for r in ("fwd", "bwd") for c in CLASSES}
    if tp > 1:
        for e in tp_entries(job, tp, micro_batch, ckpt, 1):
            for c, t in zip(CLASSES, e.unit_time_s, strict=True):
                out[TP_ROLES[entry_role(e)], c] += t
    return out


def entry_role(e: ScheduleEntry) -> str | None:
    """The per-unit role of a schedule entry (None: the update phase, exposed as a whole)."""
    if e.group in ("TP", "EP", "CP"):  # on the compute stream's critical path
        return "tp_fwd" if e.phase == "forward" else "tp_bwd"
    if e.phase == "forward":
        return "gather_fwd"
    if e.phase == "backward":
        return "gather_bwd" if e.op == "all_gather" else "reduce"
    if e.phase == "grad_sync":
        return "sync"
    return None


@dataclass(frozen=True)
class Pipeline:
    """The micro-batch pipeline of a step, its parts apart (seconds per step)."""

    compute: float
    exposed_forward: float
    exposed_backward: float
    contention: float


def pipeline(num_layers: int, qty: dict[tuple[str, str], float], n_micro: int, sigma: float,
             eta: float = 1.0) -> Pipeline:
    """Forward and backward of `n_micro` micro-batches over the units (module docstring);
    `qty` as ``unit_quantities`` gives it. A stage whose compute bound wins counts its excess
    over compute as contention; otherwise as exposed communication."""
    sts, ends = stages(num_layers, lambda r, c: qty[r, c], 0.0)
    weight = {"forward": n_micro, "backward": n_micro - 1, "last": 1}
    compute = contention = 0.0
    exposed = {"forward": ends["forward"] * n_micro,
               "backward": ends["backward"] * (n_micro - 1) + ends["last"]}
    for st in sts:
        w = weight[st.phase] * st.count
        v = stage_time(st.compute, st.comm, sigma, eta, max)
        compute += w * st.compute
        if st.compute + sigma * st.comm >= st.comm + (1.0 - eta) * st.compute:
            contention += w * (v - st.compute)
        else:
            exposed["forward" if st.phase == "forward" else "backward"] += w * (v - st.compute)
    return Pipeline(compute, exposed["forward"], exposed["backward"], contention)


def step_time(job: Job, schedule: tuple[ScheduleEntry, ...], n_micro: int, micro_batch: int,
              ckpt: bool | int | str, s_os: int, tp: int = 1, ep: int = 1,
              ep_os: int = 1) -> StepTime:
    """The step of the module docstring, with its parts apart (`ep`, `ep_os`: a mixture of
    experts' degree and expert optimizer-state factor)."""
    qty = unit_quantities(job, schedule, micro_batch, ckpt, tp, ep)
    p = pipeline(job.model.num_layers, qty, n_micro, job.cluster.gpu.comm_compute_slowdown,
                 job.cluster.overlap_efficiency)
    kernels = sum(e.kernel_s for e in schedule)
    tp_s = sum(e.time_s for e in schedule if e.group == "TP")
    ep_s = sum(e.time_s for e in schedule if e.group == "EP")
    cp_s = sum(e.time_s for e in schedule if e.group == "CP")
    update, slowed = update_exposed(job, schedule, qty)
    compute = p.compute - kernels - tp_s - ep_s - cp_s
    return StepTime(
        compute_s=compute, exposed_forward_s=p.exposed_forward,
        exposed_backward_s=p.exposed_backward, exposed_update_s=update,
        comm_total_s=sum(e.time_s for e in schedule),
        optimizer_s=optimizer_time(job, s_os, tp) + expert_optimizer_time(job, ep, ep_os),
        contention_s=p.contention + slowed, kernel_s=kernels,
        tp_comm_s=tp_s, ep_comm_s=ep_s, cp_comm_s=cp_s,
        straggler_s=straggler_seconds(compute + kernels, job.num_gpus, job.cluster.rank_jitter),
        sync_s=sync_seconds(schedule, job.cluster.collective_rank_us))


def update_exposed(job: Job, schedule: tuple[ScheduleEntry, ...],
                   qty: dict[tuple[str, str], float]) -> tuple[float, float]:
    """(exposed seconds, contention seconds) of the update phase. Exposed as a whole, unless
    the engine overlaps the updated parameters' all-gather with the next forward
    (``Execution.update_overlap``: Megatron's --overlap-param-gather, distrib_optimizer.py at
    f2e5db4: the first bucket's all-gather is launched before the forward, each next one when
    the forward's pre-hook waits on the one before, one bucket in flight). Then, with U the
    all-gather's seconds, u its first bucket (one call) and F one micro-batch's forward:
    exposed u + max(0, U - u - F), and the forward slowed by sigma min(U - u, F)."""
    update = [e for e in schedule if entry_role(e) is None]
    total = sum(e.time_s for e in update)
    ex = job.profile.execution
    if not ex.update_overlap or job.cluster.overlap_efficiency < 1.0:
        return total, 0.0
    gathers = [e for e in update if e.op == "all_gather" and e.calls_per_step]
    U = sum(e.time_s for e in gathers)
    if not U:
        return total, 0.0
    first = max(e.time_s / e.calls_per_step for e in gathers)
    forward = qty["fwd", "embedding"] + job.model.num_layers * qty["fwd", "block"] \
        + qty["fwd", "head"]
    hidden = min(U - first, forward)
    return total - hidden, job.cluster.gpu.comm_compute_slowdown * hidden
