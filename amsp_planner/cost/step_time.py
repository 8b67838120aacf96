"""Compute time, and the overlap model that turns collective times into a step time.

Compute (PaLM appendix B): model FLOPs per token 6*N + 12*L*h*s, forward one third, backward
two thirds; full recomputation adds one forward (x4/3 overall). Time = FLOPs / (peak x
achievable fraction). MFU = model FLOPs per second / (N_gpus x peak); recomputation is not
model FLOPs.

Overlap, per micro-batch, with U units, forward compute T_f, backward compute T_b, and the
collective times of the schedule grouped as
  C_f = forward all-gathers,  C_b = backward all-gathers + gradient reduce-scatters / qgZ hops,
  C_s = step-boundary gradient sync (grad_sync),  C_u = update all-gather + metrics:

  forward:  E_f = C_f / U + (U-1)/U * max(0, C_f - eta T_f)
            (the first unit's gather cannot hide; each later unit's gather, C_f/U, runs during
            the previous unit's compute, T_f/U, and shows only by what that compute cannot
            cover: summed over U-1 units, (U-1)/U * max(0, C_f - eta T_f))
  backward: E_b = C_b / U + (U-1)/U * max(0, C_b - eta T_b)
            (the same pipeline in reverse: the last unit's reduce-scatter runs after the last
            backward compute)
  last micro-batch: E_b' = (C_b + C_s)/U + (U-1)/U * max(0, C_b + C_s - eta T_b)
            (the step-boundary sync of each unit starts as soon as its gradient is final, behind
            the rest of the last backward)
  update:   E_u = C_u (after the optimizer, exposed)

With eta = 0 every phase is exposed exactly once (E_f = C_f); with eta = 1 and communication
longer than compute, the step is communication-bound plus one unit's compute.

  step = n_micro (T_f + T_b) + T_opt + n_micro E_f + (n_micro - 1) E_b + E_b' + E_u

The cluster's ``overlap_efficiency`` eta multiplies T_f and T_b inside the max(0, .) terms:
eta = 1 hides communication fully behind compute (GPUs: collectives on their own engines),
eta = 0 serialises them (CPU processes that share cores with their own communication).

Optimizer: T_opt = (Phi / s_OS) x bytes per element / ``gpu.optimizer_gbyte_per_s``: AdamW on
the rank's optimizer shard after the gradients are final, before the parameters are gathered
back; memory-bound, not hidden (it needs the synchronised gradient and the update needs it).

The ILP (solver/ilp.py) linearises exactly these max(0, .) terms with auxiliary variables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import OPTIMIZER_BYTES
from amsp_planner.cost.schedule import ScheduleEntry


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    exposed_forward_s: float
    exposed_backward_s: float
    exposed_update_s: float
    comm_total_s: float
    """All collective time of the step, overlapped or not."""
    optimizer_s: float = 0.0
    """The AdamW step on the rank's optimizer shard."""

    @property
    def exposed_comm_s(self) -> float:
        return self.exposed_forward_s + self.exposed_backward_s + self.exposed_update_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.exposed_comm_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(exposed_comm_s=self.exposed_comm_s, step_s=self.step_s)
        return d


def compute_times(job: Job, micro_batch: int, ckpt: bool) -> tuple[float, float]:
    """(T_f, T_b): forward and backward compute seconds of one micro-batch."""
    tokens = micro_batch * job.training.seq_len
    flops = tokens * job.model.flops_per_token(job.training.seq_len)
    rate = job.cluster.achievable_flop_per_s
    fwd = flops / 3 / rate
    bwd = 2 * flops / 3 / rate + (fwd if ckpt else 0.0)
    return fwd, bwd


def optimizer_bytes_per_element(param_bytes: int, grad_bytes: int) -> int:
    """Memory traffic of one AdamW element: read and write the fp32 master, exp_avg and
    exp_avg_sq (the optimizer state, twice), read the gradient, read the master again and write
    the new parameter in its dtype."""
    return 2 * OPTIMIZER_BYTES + grad_bytes + 4 + param_bytes


def optimizer_time(job: Job, s_os: int) -> float:
    """Seconds of the AdamW step on the Phi / s_os elements of one rank's optimizer shard."""
    t = job.training
    rate = job.cluster.gpu.optimizer_gbyte_per_s * 1e9
    return job.phi / s_os * optimizer_bytes_per_element(t.param_bytes, t.grad_bytes) / rate


def phase_times(schedule: tuple[ScheduleEntry, ...], n_micro: int) -> dict[str, float]:
    """Collective seconds by phase: per micro-batch for forward/backward, per step otherwise."""
    out = {"forward": 0.0, "backward": 0.0, "grad_sync": 0.0, "update": 0.0}
    for e in schedule:
        per = n_micro if e.phase in ("forward", "backward") else 1
        out[e.phase] += e.time_s / per
    return out


def overlap(t_f: float, t_b: float, c: dict[str, float], n_micro: int, num_units: int,
            efficiency: float = 1.0, t_opt: float = 0.0) -> StepTime:
    """The overlap model of the module docstring; `efficiency` (the cluster's
    ``overlap_efficiency``, eta) scales the compute time that can hide communication; `t_opt`
    is the optimizer step, added as it is."""
    u = num_units
    w = (u - 1) / u  # the units whose communication can hide behind another unit's compute
    h_f, h_b = efficiency * t_f, efficiency * t_b
    e_f = w * max(0.0, c["forward"] - h_f) + c["forward"] / u
    e_b = w * max(0.0, c["backward"] - h_b) + c["backward"] / u
    last = c["backward"] + c["grad_sync"]
    e_last = w * max(0.0, last - h_b) + last / u
    comm = n_micro * (c["forward"] + c["backward"]) + c["grad_sync"] + c["update"]
    return StepTime(
        compute_s=n_micro * (t_f + t_b),
        exposed_forward_s=n_micro * e_f,
        exposed_backward_s=(n_micro - 1) * e_b + e_last,
        exposed_update_s=c["update"],
        comm_total_s=comm,
        optimizer_s=t_opt,
    )


def step_time(job: Job, schedule: tuple[ScheduleEntry, ...], n_micro: int, micro_batch: int,
              ckpt: bool, s_os: int) -> StepTime:
    t_f, t_b = compute_times(job, micro_batch, ckpt)
    return overlap(t_f, t_b, phase_times(schedule, n_micro), n_micro, job.num_units,
                   job.cluster.overlap_efficiency, optimizer_time(job, s_os))
