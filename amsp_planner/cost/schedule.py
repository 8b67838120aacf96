"""The per-step collective schedule: what the runtime executes and counts (DESIGN.md 3, 3a).

One entry per collective kind. Group kinds, sizes and strides (ranks node-major; the x-group of
a rank is the s_x consecutive ranks containing it):

=========  ==========  ==============  ================  =========================================
phase      op          group           size, stride      what
=========  ==========  ==============  ================  =========================================
forward    all_gather  P               s_P, 1            parameters of each unit, per micro-batch
backward   all_gather  P or hpZ        s_P, 1 / h_z, 1   again for backward (hpZ: in-node copy)
backward   red._scat.  G               s_G, 1            unit gradients into the G shard
backward   all_to_all  G_intra         s0_G, 1           qgZ hop 1 (INT4), replaces the RS above
backward   all_to_all  G_inter         s1_G, R           qgZ hop 2 (INT4, on the hop-1 slice)
grad_sync  red._scat.  OS_shard        s_OS/s_G, s_G     G shard -> OS shard, once per step
grad_sync  all_reduce  OS_replica      N/s_OS, s_OS      across OS replicas, once per step
update     all_gather  P_update        s_OS/s_P, s_P     updated OS shards -> P shard (bf16)
update     all_reduce  world           N, 1              [loss, grad-norm^2] in fp32, one call
=========  ==========  ==============  ================  =========================================

Per-micro-batch entries have ``calls_per_step = num_units * n_micro``; once-per-step entries
``num_units`` (one call per unit). ``full_bytes_per_step`` sums the full tensor of every call:
the gathered tensor (all-gather), the input (reduce-scatter), the tensor (all-reduce), the send
buffer (all-to-all). Quantized payloads are one uint8 buffer per call: INT8 (qwZ) or packed INT4
(qgZ, two per byte) values followed by one fp32 scale per ``quant_block`` elements; laid out as
the members' chunks back to back, each chunk its own values then scales (the sizes add up to
``quantized_bytes`` of the whole, since every chunk is whole blocks).

Ring-convention bytes per rank: (m-1)/m * full (all-gather, reduce-scatter, all-to-all),
2(m-1)/m * full (all-reduce); split into intra- and inter-node parts by ``topology.split_bytes``.
Quantized entries' ``time_s`` includes the (de)quantization kernels, one pass over the 16-bit
elements each kernel reads or writes, at the GPU's ``quant_gbyte_per_s``: qwZ quantizes the
rank's own shard (phi/s_P) and dequantizes the gathered whole (phi); qgZ quantizes the whole
gradient it sends and dequantizes as much as it receives (twice the hop's elements). Step-boundary entries run on the gradient dtype (bf16 by default, fp32 with
``grad_accum_dtype: fp32`` or in fp32 mode); parameter gathers on the parameter dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from amsp_planner.cost.job import Job
from amsp_planner.strategy import Strategy
from amsp_planner.topology import split_bytes


@dataclass(frozen=True)
class ScheduleEntry:
    phase: str
    op: str
    group: str
    group_size: int
    stride: int
    members_per_node: int
    dtype: str
    calls_per_step: int
    full_bytes_per_step: int
    intra_bytes_per_rank_per_step: float
    inter_bytes_per_rank_per_step: float
    time_s: float
    """Predicted seconds per step for these collectives, before overlap."""

    @property
    def bytes_per_rank_per_step(self) -> float:
        return self.intra_bytes_per_rank_per_step + self.inter_bytes_per_rank_per_step

    def to_dict(self) -> dict:
        return asdict(self)


def quantized_bytes(elements: int, bits: int, block: int) -> int:
    """Bytes of one quantized buffer: packed values + one fp32 scale per block."""
    assert elements % block == 0 and (elements * bits) % 8 == 0
    return elements * bits // 8 + 4 * (elements // block)


def _entry(job: Job, phase: str, op: str, group: str, size: int, stride: int, dtype: str,
           calls: int, full: int, quant_elements: int = 0) -> ScheduleEntry:
    """One entry; `quant_elements` adds the (de)quantization kernels' time: that many 16-bit
    elements quantized plus dequantized, at the GPU's ``quant_gbyte_per_s``."""
    lay = job.topology.layout(size, stride)
    intra, inter = split_bytes(op, full, lay)
    time = job.topology.collective_time(op, size, stride, full, calls)
    if quant_elements:
        time += quant_elements * 2 / (job.cluster.gpu.quant_gbyte_per_s * 1e9)
    return ScheduleEntry(phase, op, group, size, stride, lay.members_per_node, dtype, calls,
                         int(full), intra, inter, time)


def build_schedule(job: Job, s: Strategy, n_micro: int | None = None) -> tuple[ScheduleEntry, ...]:
    """Every collective of one training step of `job` under strategy `s`."""
    n_micro = job.n_micro(s) if n_micro is None else n_micro
    t = job.training
    N, R, U = job.num_gpus, job.gpus_per_node, job.num_units
    phi = job.phi
    pb, gb = t.param_bytes, t.grad_bytes
    pdt, gdt = t.dtype_name, t.grad_dtype_name
    per_mb = U * n_micro
    out: list[ScheduleEntry] = []

    if s.s_p > 1:
        if s.qwz:
            fwd_full, fwd_dt = quantized_bytes(phi, 8, s.quant_block), "int8+scales"
        else:
            fwd_full, fwd_dt = phi * pb, pdt
        qe = n_micro * (phi // s.s_p + phi) if s.qwz else 0  # own shard in, whole out
        out.append(_entry(job, "forward", "all_gather", "P", s.s_p, 1, fwd_dt, per_mb,
                          n_micro * fwd_full, qe))
        if s.hpz > 1:
            out.append(_entry(job, "backward", "all_gather", "hpZ", s.hpz, 1, pdt, per_mb,
                              n_micro * phi * pb))
        else:
            out.append(_entry(job, "backward", "all_gather", "P", s.s_p, 1, fwd_dt, per_mb,
                              n_micro * fwd_full, qe))
    if s.s_g > 1:
        if s.qgz:
            s0, s1 = s.mesh("g", R)
            if s0 > 1:
                out.append(_entry(job, "backward", "all_to_all", "G_intra", s0, 1, "int4+scales",
                                  per_mb, n_micro * quantized_bytes(phi, 4, s.quant_block),
                                  2 * n_micro * phi))
            if s1 > 1:
                out.append(_entry(job, "backward", "all_to_all", "G_inter", s1, R, "int4+scales",
                                  per_mb, n_micro * quantized_bytes(phi // s0, 4, s.quant_block),
                                  2 * n_micro * phi // s0))
        else:
            out.append(_entry(job, "backward", "reduce_scatter", "G", s.s_g, 1, gdt, per_mb,
                              n_micro * phi * gb))
    k = s.s_os // s.s_g
    if k > 1:
        out.append(_entry(job, "grad_sync", "reduce_scatter", "OS_shard", k, s.s_g, gdt, U,
                          phi // s.s_g * gb))
    r = N // s.s_os
    if r > 1:
        out.append(_entry(job, "grad_sync", "all_reduce", "OS_replica", r, s.s_os, gdt, U,
                          phi // s.s_os * gb))
    q = s.s_os // s.s_p
    if q > 1:
        out.append(_entry(job, "update", "all_gather", "P_update", q, s.s_p, pdt, U,
                          phi // s.s_p * pb))
    if N > 1:
        out.append(_entry(job, "update", "all_reduce", "world", N, 1, "fp32", 1, 8))
    return tuple(out)
