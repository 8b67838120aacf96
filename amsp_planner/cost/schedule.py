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
``time_s`` is the collectives' own time: each call priced at its unit's real size (NCCL's
model on GPUs, ``collectives.py``). Quantized entries carry their (de)quantization kernels apart,
in ``kernel_s`` (they run on the compute stream), one pass over the 16-bit elements each kernel
reads or writes, at the GPU's ``quant_gbyte_per_s``: qwZ quantizes the rank's own shard
(phi/s_P) and dequantizes the gathered whole (phi); qgZ quantizes the whole gradient it sends
and dequantizes as much as it receives (twice the hop's elements). Step-boundary entries run on
the gradient dtype (bf16 by default, fp32 with ``grad_accum_dtype: fp32`` or in fp32 mode);
parameter gathers on the parameter dtype. ``algorithm`` names what NCCL runs for a block's
call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from amsp_planner.cost.job import Job
from amsp_planner.strategy import Strategy
from amsp_planner.topology import split_bytes

CLASSES = ("embedding", "block", "head")
"""The unit classes: the embedding, every transformer block (all the same size), the head."""


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
    kernel_s: float = 0.0
    """Seconds per step of the (de)quantization kernels these collectives need; they run on the
    compute stream (cost/step_time.py)."""
    unit_time_s: tuple[float, ...] = field(default=(0.0, 0.0, 0.0), compare=False)
    """Seconds of one call for a unit of each class (``CLASSES``): the step model's input."""
    unit_kernel_s: tuple[float, ...] = field(default=(0.0, 0.0, 0.0), compare=False)
    """Kernel seconds of one call for a unit of each class."""
    algorithm: str = ""
    """What NCCL runs for a block's call (e.g. 'ring/LL128'); empty off NCCL."""

    @property
    def bytes_per_rank_per_step(self) -> float:
        return self.intra_bytes_per_rank_per_step + self.inter_bytes_per_rank_per_step

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["unit_time_s"], d["unit_kernel_s"]
        return d


def quantized_bytes(elements: int, bits: int, block: int) -> int:
    """Bytes of one quantized buffer: packed values + one fp32 scale per block."""
    assert elements % block == 0 and (elements * bits) % 8 == 0
    return elements * bits // 8 + 4 * (elements // block)


def unit_elements(job: Job) -> tuple[int, int, int]:
    """Padded elements of a unit of each class."""
    u = job.units
    return u[0], u[1] if len(u) > 2 else 0, u[-1]


def _entry(job: Job, phase: str, op: str, group: str, size: int, stride: int, dtype: str,
           per_unit: int, n_micro: int, full: Callable[[int], int],
           kernel_elements: Callable[[int], int] | None = None,
           copies: bool = False) -> ScheduleEntry:
    """One entry: `per_unit` calls per unit and micro-batch (``n_micro`` of them), each call
    moving ``full(unit elements)`` bytes; ``kernel_elements(unit elements)``: the 16-bit
    elements the (de)quantization kernels read or write per call, at the GPU's
    ``quant_gbyte_per_s``. With `copies`, unquantized all-gathers and reduce-scatters of a
    micro-batch on GPUs copy their buffer once (the gathered unit out to the parameters, the gradients into the send buffer:
    read + write of the full tensor at ``hbm_gbyte_per_s``), as FSDP's copy-out / copy-in do."""
    topo, gpu = job.topology, job.cluster.gpu
    rate = gpu.quant_gbyte_per_s * 1e9
    lay = topo.layout(size, stride)
    sizes = unit_elements(job)
    counts = (1, job.model.num_layers, 1)
    unit_t = tuple(topo.collective_time(op, size, stride, full(u)) * per_unit for u in sizes)

    def kernel(u: int) -> float:
        if kernel_elements:
            return kernel_elements(u) * 2 / rate
        if copies and gpu.hbm_gbyte_per_s and op in ("all_gather", "reduce_scatter"):
            return 2 * full(u) / (gpu.hbm_gbyte_per_s * 1e9)  # copy-out / copy-in of the buffer
        return 0.0

    unit_k = tuple(kernel(u) * per_unit for u in sizes)
    total = n_micro * sum(c * full(u) for c, u in zip(counts, sizes, strict=True)) * per_unit
    intra, inter = split_bytes(op, total, lay)
    time = n_micro * sum(c * t for c, t in zip(counts, unit_t, strict=True))
    kern = n_micro * sum(c * k for c, k in zip(counts, unit_k, strict=True))
    algo = _algorithm_name(job, op, size, stride, full(max(sizes)))
    calls = per_unit * n_micro * job.num_units
    return ScheduleEntry(phase, op, group, size, stride, lay.members_per_node, dtype, calls,
                         int(total), intra, inter, time, kern, unit_t, unit_k, algo)


def build_schedule(job: Job, s: Strategy, n_micro: int | None = None) -> tuple[ScheduleEntry, ...]:
    """Every collective of one training step of `job` under strategy `s`."""
    n_micro = job.n_micro(s) if n_micro is None else n_micro
    t = job.training
    N, R = job.num_gpus, job.gpus_per_node
    pb, gb = t.param_bytes, t.grad_bytes
    pdt, gdt = t.dtype_name, t.grad_dtype_name
    blk = s.quant_block
    out: list[ScheduleEntry] = []

    def add(phase, op, group, size, stride, dtype, full, kernel=None, per_mb=True):
        out.append(_entry(job, phase, op, group, size, stride, dtype, 1,
                          n_micro if per_mb else 1, full, kernel, copies=per_mb))

    if s.s_p > 1:
        if s.qwz:
            fwd_full, fwd_dt = (lambda u: quantized_bytes(u, 8, blk)), "int8+scales"
            qe = lambda u: u // s.s_p + u  # noqa: E731  own shard in, whole out
        else:
            fwd_full, fwd_dt, qe = (lambda u: u * pb), pdt, None
        add("forward", "all_gather", "P", s.s_p, 1, fwd_dt, fwd_full, qe)
        if s.hpz > 1:
            add("backward", "all_gather", "hpZ", s.hpz, 1, pdt, lambda u: u * pb)
        else:
            add("backward", "all_gather", "P", s.s_p, 1, fwd_dt, fwd_full, qe)
    if s.s_g > 1:
        if s.qgz:
            s0, s1 = s.mesh("g", R)
            if s0 > 1:
                add("backward", "all_to_all", "G_intra", s0, 1, "int4+scales",
                    lambda u: quantized_bytes(u, 4, blk), lambda u: 2 * u)
            if s1 > 1:
                add("backward", "all_to_all", "G_inter", s1, R, "int4+scales",
                    lambda u: quantized_bytes(u // s0, 4, blk), lambda u: 2 * u // s0)
        else:
            add("backward", "reduce_scatter", "G", s.s_g, 1, gdt, lambda u: u * gb)
    k = s.s_os // s.s_g
    if k > 1:
        add("grad_sync", "reduce_scatter", "OS_shard", k, s.s_g, gdt,
            lambda u: u // s.s_g * gb, per_mb=False)
    r = N // s.s_os
    if r > 1:
        add("grad_sync", "all_reduce", "OS_replica", r, s.s_os, gdt,
            lambda u: u // s.s_os * gb, per_mb=False)
    q = s.s_os // s.s_p
    if q > 1:
        add("update", "all_gather", "P_update", q, s.s_p, pdt, lambda u: u // s.s_p * pb,
            per_mb=False)
    if N > 1:
        out.append(_world_entry(job))
    return tuple(out)


def _algorithm_name(job: Job, op: str, size: int, stride: int, per_call: float) -> str:
    """'algorithm/protocol' NCCL runs for one call; empty off NCCL or with measured tables."""
    if size <= 1 or job.cluster.collective_library != "nccl" or job.cluster.measured:
        return ""
    ch = job.topology.algorithm(op, size, stride, per_call)
    return f"{ch.algorithm}/{ch.protocol}"


def _world_entry(job: Job) -> ScheduleEntry:
    """[loss, grad-norm^2] in fp32: one all-reduce of 8 bytes per step."""
    n = job.num_gpus
    lay = job.topology.layout(n, 1)
    intra, inter = split_bytes("all_reduce", 8, lay)
    time = job.topology.collective_time("all_reduce", n, 1, 8)
    algo = _algorithm_name(job, "all_reduce", n, 1, 8)
    return ScheduleEntry("update", "all_reduce", "world", n, 1, lay.members_per_node, "fp32", 1,
                         8, intra, inter, time, algorithm=algo)
