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
update     all_reduce  P               s_P, 1            FP8 all-gather (fp8ag): the weights' amax
update     all_reduce  world           N, 1              [loss, grad-norm^2] in fp32, one call
=========  ==========  ==============  ================  =========================================

A mixture-of-experts model's schedule (two parameter classes, the token all-to-alls) is
``cost/moe_schedule.py``'s.

With tensor parallelism of degree t (``tp=T``; docs/cost-model.md, "Tensor parallelism") the
groups above are over the N/t data-parallel ranks, R/t per node: data-parallel rank d is the TP
group of global ranks d*t .. d*t + t - 1 (consecutive, inside one node), so every size above is
counted in data-parallel ranks and every stride is t times the one above in global ranks; the
units are one TP rank's shards (``Job.tp_units``). The TP collectives are entries of their own,
group ``TP`` (``cost/tp_schedule.py``, with their table). ``ScheduleEntry`` and the unit
classes are in ``cost/schedule_entry.py``.

Per-micro-batch entries have ``calls_per_step = num_units * n_micro``; once-per-step entries
``num_units`` (one call per unit). ``full_bytes_per_step`` sums the full tensor of every call:
the gathered tensor (all-gather), the input (reduce-scatter), the tensor (all-reduce), the send
buffer (all-to-all). Quantized payloads are one uint8 buffer per call: INT8 (qwZ) or packed INT4
(qgZ, two per byte) values followed by one fp32 scale per ``quant_block`` elements; laid out as
the members' chunks back to back, each chunk its own values then scales (the sizes add up to
``quantized_bytes`` of the whole, since every chunk is whole blocks).

FP8 all-gather (``fp8ag``, or every gather with ``--fp8-all-gather on``: ``gathers_fp8``;
docs/fp8.md): the P gathers (forward, and
backward without hpZ) move each unit class's ``cost/fp8_bytes.py: unit_gathers`` bytes (1 per
FP8 element, 2 per bf16 one; scales travel as metadata), dtype ``fp8``; the weights' fp32
amaxes are all-reduced (MAX) over P once per step after the update (torchao's
``precompute_float8_dynamic_scale_for_fsdp``), a class without FP8 weights issuing none. hpZ's
backward gather stays in the parameter dtype (its copy holds the gathered, dequantized values,
as with qwZ). The bundled runtime dequantizes the gathered unit (kernels as qwZ's); torchao's
engines feed the FP8 unit to the matmuls (the cast of the shard before the gather is not
priced apart: it replaces the matmul's cast of the gathered weight, inside its speed-up).
Gradients stay in the gradient dtype: FP8 never reaches the reductions.

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

import math
from collections.abc import Callable

from amsp_planner.ckpt_setting import checkpointed_blocks
from amsp_planner.cost.fp8 import GATHER_ONLY
from amsp_planner.cost.fp8_gathers import fp8_gathers, gathers_fp8, te_param_gathers
from amsp_planner.cost.job import Job
from amsp_planner.cost.module_fetch import regather_fraction
from amsp_planner.cost.schedule_entry import (
    CLASSES,  # noqa: F401 - also this module's API
    ScheduleEntry,
    algorithm_name,
    quantized_bytes,
)
from amsp_planner.cost.tp_schedule import tp_entries
from amsp_planner.cost.unit_tensors import (  # noqa: F401 - unit_elements: also this API
    unit_elements,
    unit_tensor_counts,
    unit_tensors,
)
from amsp_planner.strategy import Strategy
from amsp_planner.topology import split_bytes


def _buckets(fraction_per_call: float) -> tuple[tuple[float, float], ...]:
    """(calls, fraction of the unit per call) when calls carry `fraction_per_call` of a unit:
    a bucket larger than the unit is one call of the bucket charged in part (u / B of it)."""
    if fraction_per_call >= 1:
        return ((1 / fraction_per_call, fraction_per_call),)
    k = math.ceil(1 / fraction_per_call - 1e-9)
    return ((k, 1 / k),)


def _module_calls(job: Job, cls: int, unit: int) -> list[tuple[float, int]]:
    """(padded elements, the modules' own elements) of each gather call of a unit under
    'module' grouping: the modules' tensors that are not kept whole, consecutive ones coalesced
    into calls of at most ``prefetch_bucket`` elements."""
    ex = job.profile.execution
    mods = unit_tensors(job.model)[cls]
    scale = unit / (sum(mods) or 1)  # a TP rank's shard and the padding, spread over modules
    cap = ex.prefetch_bucket or unit
    calls: list[tuple[float, int]] = []
    for x in mods:
        if x < ex.persistence_threshold:
            continue
        if calls and ex.gather_grouping == "module" and calls[-1][0] + x * scale <= cap:
            calls[-1] = (calls[-1][0] + x * scale, calls[-1][1] + x)
        else:
            calls.append((x * scale, x))
    return calls


def on_demand(job: Job, cls: int, unit: int, tp: int = 1) -> tuple[bool, ...]:
    """Per gather call of a unit (``call_groups``): whether the engine fetches it on demand,
    with the compute waiting for it, rather than prefetched during the previous call's compute
    (empty: every call prefetched).

    DeepSpeed prefetches after fetching a module only while the parameters it holds stay under
    ``max_live_params`` (partitioned_param_coordinator.py fetch_sub_module: max_params_to_prefetch
    = min(max_live_parameters - n_available_params, prefetch_bucket_size)); what it holds then
    is the call just fetched. So a call is fetched on demand when the call before it carries
    ``max_live_params`` elements or more. Before a block's first call comes the previous
    block's last call (the head's: the last block's); before the embedding's first, nothing
    (the step's first gather, exposed anyway). The backward runs its units in reverse; the
    step model prices it with the same calls (one gather price per unit, as the ILP's
    tables hold it).

    'parameter' grouping (DeepSpeed 0.3.14, engine_versions.py): one all-gather per parameter,
    each after a ``torch.cuda.synchronize()`` (partition_parameters.py ``_allgather_param``),
    and a prefetch takes the next parameters until they reach ``prefetch_bucket`` elements
    (stage3.py ``get_params_to_prefetch``), issued before the current module's compute is
    launched: every call of such a batch but its last waits for the one before it with
    nothing computing. Batches are counted from each unit's first call; a call is on demand
    when it is not the last of its batch, or by the ``max_live_params`` rule above.

    With ``prefetch_overlap`` off (DeepSpeed's profiles: measured, docs/cost-model.md) every
    call is waited for, whatever the rules above say the engine prefetches."""
    ex = job.profile.execution
    cap = ex.max_live_params
    if ex.gather_grouping not in ("module", "parameter"):
        return ()  # nothing fetched on demand
    calls = _module_calls(job, cls, unit)
    if not calls:
        return ()
    if not ex.prefetch_overlap:
        return (True,) * len(calls)  # every call waited for by the compute
    before = _module_calls(job, 1, unit_elements(job, tp)[1]) if cls else None
    prev = [before[-1][1] if before else 0] + [own for _, own in calls[:-1]]
    late = [cap is not None and p >= cap for p in prev]
    if ex.gather_grouping == "parameter":  # one call per parameter, batches serialised
        batch = 0
        for i, (_, own) in enumerate(calls):
            batch += own
            if batch >= (ex.prefetch_bucket or 0) or i == len(calls) - 1:
                batch = 0  # the batch's last call: prefetched, overlapping compute
            else:
                late[i] = True  # the next call's synchronize waits for it, nothing computing
    return tuple(late)


def call_groups(job: Job, role: str, cls: int, unit: int, tp: int = 1
                ) -> tuple[tuple[float, float], ...]:
    """How the job's engine issues one unit's collective of `role` ('gather', 'reduce',
    'update'): (calls, fraction of the unit's full tensor per call) pairs, from its execution
    profile (``engines.Execution``). `cls` indexes ``CLASSES``; `unit` is the unit's padded
    elements. The fractions sum to the share of the unit the engine moves (tensors it keeps
    whole are not gathered)."""
    ex = job.profile.execution
    if role == "gather" and ex.gather_grouping in ("module", "parameter"):
        return tuple((1, x / unit) for x, _ in _module_calls(job, cls, unit))
    bucket = {"reduce": ex.reduce_elements(job.num_gpus // tp),
              "update": ex.update_bucket}.get(role)
    if bucket is None or not unit:
        return ((1, 1.0),)
    return _buckets(bucket / unit)


def _entry(job: Job, phase: str, op: str, group: str, size: int, stride: int, dtype: str,
           per_unit: int, n_micro: int, full: Callable[[int], int],
           kernel_elements: Callable[[int], int] | None = None,
           copies: bool = False, tp: int = 1, role: str = "gather",
           exposed: bool = False, by_class: tuple[float, ...] | None = None,
           copy_back: float = 1.0, scale: tuple[float, ...] = (1.0, 1.0, 1.0)) -> ScheduleEntry:
    """One entry: `per_unit` calls per unit and micro-batch (``n_micro`` of them), each call
    moving ``full(unit elements)`` bytes; ``kernel_elements(unit elements)``: the 16-bit
    elements the (de)quantization kernels read or write per call, at the GPU's
    ``quant_gbyte_per_s``. With `copies`, unquantized all-gathers and reduce-scatters of a
    micro-batch on GPUs copy their buffer once (the gathered unit out to the parameters, the gradients into the send buffer:
    read + write of the full tensor at ``hbm_gbyte_per_s``), as FSDP's copy-out / copy-in do.

    The engine issues each unit's call as ``call_groups(role)`` says, each call delayed by its
    ``launch_us``; a gather call the engine fetches on demand (``on_demand``) is charged to
    the compute stream (``unit_kernel_s``: the unit's compute waits for it) and counted in
    ``time_s``, not in ``unit_time_s`` (what overlaps the previous unit's compute). `exposed`: the engine runs these collectives after backward, before the
    step; their seconds are charged to the embedding, the last unit of backward, whose
    reduction the step model exposes whole (cost/step_time.py). `by_class`: bytes per call of
    each unit class, in place of ``full`` (the FP8 all-gather; a class of 0 bytes issues no
    call). `copy_back`: of an all-reduce's buffer, the share copied back out after it.
    `scale`: per unit class, the calls' bytes, seconds and kernels multiplied (a checkpointed
    block's gathers repeated in backward: ``regather``)."""
    topo, gpu = job.topology, job.cluster.gpu
    rate = gpu.quant_gbyte_per_s * 1e9
    lay = topo.layout(size, stride)
    sizes = unit_elements(job, tp)
    counts = (1, job.model.num_layers, 1)
    launch = job.profile.execution.launch_us * 1e-6 if size > 1 else 0.0
    if by_class is not None:
        def full(u: int, c: int = 0) -> float:  # noqa: F811  the class's bytes
            return by_class[c]
    else:
        plain = full

        def full(u: int, c: int = 0) -> float:  # noqa: F811
            return plain(u)

    def seconds(c: int, u: int) -> tuple[float, float]:
        """(overlapped, on demand) seconds of one unit's calls."""
        if not u or not full(u, c):
            return 0.0, 0.0
        groups = call_groups(job, role, c, u, tp)
        late = on_demand(job, c, u, tp) if role == "gather" and size > 1 else ()
        out = [0.0, 0.0]
        for i, (k, f) in enumerate(groups):
            t = k * (topo.collective_time(op, size, stride, full(u, c) * f) + launch)
            out[i < len(late) and late[i]] += per_unit * t
        return out[0], out[1]

    both = tuple((t * scale[c], d * scale[c])
                 for c, (t, d) in ((c, seconds(c, u)) for c, u in enumerate(sizes)))
    unit_t = tuple(t for t, _ in both)
    demand = tuple(d for _, d in both)  # on the compute stream's critical path
    if role == "update" and job.profile.execution.update_collective == "broadcast" and size > 1:
        # one broadcast per member of its shard of the whole model; each unit its share
        whole = sum(c * full(u) for c, u in zip(counts, sizes, strict=True))
        per = size * (topo.collective_time("broadcast", size, stride, whole / size) + launch)
        unit_t = tuple(per * full(u) / whole for u in sizes)  # never by_class (an update)

    host = job.profile.execution.reduce_host_us * 1e-6 * size
    tensors = unit_tensor_counts(job.model)
    g_host = job.profile.execution.gather_host_us * 1e-6 * size if op == "all_gather" else 0.0

    def kernel(u: int, c: int = 0) -> float:  # the engine's host time, then the kernels
        late = g_host * len(call_groups(job, role, c, u, tp)) if g_host and role == "gather" \
            else 0.0  # per gathered parameter, the compute waiting
        return late + kernels(u, c)

    def kernels(u: int, c: int = 0) -> float:
        if kernel_elements:
            return kernel_elements(u) * 2 / rate
        if host and op == "reduce_scatter" and copies:  # the engine's per-rank interleave
            return host * tensors[c] + (2 * full(u, c) / (gpu.hbm_gbyte_per_s * 1e9)
                                        if gpu.hbm_gbyte_per_s else 0.0)
        if copies and gpu.hbm_gbyte_per_s and (op == "reduce_scatter" or op == "all_gather"
                                               and job.profile.execution.gather_copy_out):
            return 2 * full(u, c) / (gpu.hbm_gbyte_per_s * 1e9)  # copy-out / copy-in
        if copies and gpu.hbm_gbyte_per_s and op == "all_reduce":  # flatten in, copy back out
            return 2 * (1 + copy_back) * full(u, c) / (gpu.hbm_gbyte_per_s * 1e9)
        return 0.0

    unit_k = tuple(kernel(u, c) * per_unit * scale[c] + d
                   for c, (u, d) in enumerate(zip(sizes, demand, strict=True)))
    total = n_micro * sum(n * full(u, c) * scale[c]
                          for c, (n, u) in enumerate(zip(counts, sizes, strict=True))) * per_unit
    intra, inter = split_bytes(op, total, lay)
    time = n_micro * sum(c * (t + d) for c, t, d in zip(counts, unit_t, demand, strict=True))
    kern = n_micro * sum(c * k for c, k in zip(counts, unit_k, strict=True))
    if exposed:
        unit_t = (sum(c * t for c, t in zip(counts, unit_t, strict=True)), 0.0, 0.0)
    big = max(range(len(sizes)), key=lambda c: full(sizes[c], c))
    algo = algorithm_name(job, op, size, stride, full(sizes[big], big))
    calls = per_unit * n_micro * (job.num_units if by_class is None else sum(
        n for n, b in zip(counts, by_class, strict=True) if b))
    return ScheduleEntry(phase, op, group, size, stride, lay.members_per_node, dtype, calls,
                         int(total), intra, inter, time, kern, unit_t, unit_k, algo,
                         unit_demand_s=demand)


def regather(job: Job, s: Strategy) -> tuple[float, float, float]:
    """Per unit class, the backward gathers' multiple: 1 + r K / L for the blocks, with K of
    the L blocks checkpointed whole and r the share of a recomputed block the engine gathers
    once more for its backward (``cost/module_fetch.py`` ``regather_fraction``: DeepSpeed's
    reuse distance); 1 elsewhere. Averaged over the blocks, as their compute is."""
    L = job.model.num_layers
    k, _ = checkpointed_blocks(s.ckpt_value, L)
    r = regather_fraction(job, s.tp) if k else 0.0
    return (1.0, 1.0 + r * k / L, 1.0)


def build_schedule(job: Job, s: Strategy, n_micro: int | None = None,
                   tensor_parallel: bool = True, per_micro_batch: bool = True
                   ) -> tuple[ScheduleEntry, ...]:
    """Every collective of one training step of `job` under strategy `s`. The solver's probes
    leave out what they do not read: the TP collectives (not `tensor_parallel`) or the
    per-micro-batch gathers and reductions (not `per_micro_batch`)."""
    n_micro = job.n_micro(s) if n_micro is None else n_micro
    if job.model.is_moe:  # both parameter classes and the token all-to-alls
        from amsp_planner.cost.moe_schedule import moe_schedule

        out = moe_schedule(job, s, n_micro, per_micro_batch, tensor_parallel)
        return tuple(out + ([_world_entry(job)] if job.num_gpus > 1 else []))
    t = job.training
    tp = s.tp
    N, R = job.num_gpus // tp, max(1, job.gpus_per_node // tp)  # data-parallel ranks
    pb, gb = t.param_bytes, t.grad_bytes
    pdt, gdt = t.dtype_name, t.grad_dtype_name
    blk = s.quant_block
    out: list[ScheduleEntry] = []

    ex = job.profile.execution

    def add(phase, op, group, size, stride, dtype, full, kernel=None, per_mb=True, by=None,
            copy_back=1.0, overlap=ex.sync_overlap, scale=(1.0, 1.0, 1.0)):
        role = {"forward": "gather", "backward": "gather" if op == "all_gather" else "reduce",
                "grad_sync": "reduce", "update": "update"}[phase]
        out.append(_entry(job, phase, op, group, size, stride * tp, dtype, 1,
                          n_micro if per_mb else 1, full, kernel, copies=per_mb, tp=tp,
                          role="amax" if by and not per_mb else role,
                          exposed=phase == "grad_sync" and not overlap, by_class=by,
                          copy_back=copy_back, scale=scale))

    fp8 = fp8_gathers(job, tp) if gathers_fp8(job, s) else None
    if s.s_p > 1 and per_micro_batch:
        if fp8:
            fwd_full, fwd_dt = None, "fp8"
            qe = (lambda u: u // s.s_p + u) if job.engine in GATHER_ONLY else None  # noqa: E731
        elif s.qwz:
            fwd_full, fwd_dt = (lambda u: quantized_bytes(u, 8, blk)), "int8+scales"
            qe = lambda u: u // s.s_p + u  # noqa: E731  own shard in, whole out
        else:
            fwd_full, fwd_dt, qe = (lambda u: u * pb), pdt, None
        by = tuple(g.gather_bytes for g in fp8) if fp8 else None
        add("forward", "all_gather", "P", s.s_p, 1, fwd_dt, fwd_full, qe, by=by)
        again = regather(job, s)
        if s.hpz > 1:
            add("backward", "all_gather", "hpZ", s.hpz, 1, pdt, lambda u: u * pb, scale=again)
        else:
            add("backward", "all_gather", "P", s.s_p, 1, fwd_dt, fwd_full, qe, by=by,
                scale=again)
    if s.s_g > 1 and per_micro_batch:
        if s.qgz:
            s0, s1 = s.mesh("g", job.gpus_per_node)
            if s0 > 1:
                add("backward", "all_to_all", "G_intra", s0, 1, "int4+scales",
                    lambda u: quantized_bytes(u, 4, blk), lambda u: 2 * u)
            if s1 > 1:
                add("backward", "all_to_all", "G_inter", s1, R, "int4+scales",
                    lambda u: quantized_bytes(u // s0, 4, blk), lambda u: 2 * u // s0)
        else:  # ZeRO-2 (s_P = 1): the engine's zero2_reduce; ZeRO-3: its sharded_reduce
            z2 = s.s_p == 1
            add("backward", ex.zero2_reduce if z2 else ex.sharded_reduce, "G", s.s_g, 1, gdt,
                lambda u: u * gb, copy_back=1 / s.s_g if z2 else 1.0)
    k = s.s_os // s.s_g
    if k > 1:  # unsharded gradients: the engine's replicated_reduce (engines.Execution)
        add("grad_sync", ex.replicated_reduce if s.s_g == 1 else "reduce_scatter", "OS_shard",
            k, s.s_g, gdt, lambda u: u // s.s_g * gb, per_mb=False,
            overlap=ex.shard_reduce_overlaps(s.s_g))
    r = N // s.s_os
    if r > 1:
        add("grad_sync", "all_reduce", "OS_replica", r, s.s_os, gdt,
            lambda u: u // s.s_os * gb, per_mb=False)
    q = s.s_os // s.s_p
    if q > 1:
        te = te_param_gathers(job, tp)  # Megatron's --fp8-param-gather: the updated FP8 weights
        add("update", "all_gather", "P_update", q, s.s_p, "fp8" if te else pdt,
            lambda u: u // s.s_p * pb, per_mb=False,
            by=te and tuple(g.gather_bytes / s.s_p for g in te))
    if fp8:  # the amax all-reduce (MAX) of the FP8 weights, once per step after the update
        amax = tuple(g.amax_allreduce_bytes for g in fp8)
        if job.engine not in GATHER_ONLY:  # torchao's precompute: one call for every amax
            amax = (amax[0] + job.model.num_layers * amax[1] + amax[2], 0, 0)
        add("update", "all_reduce", "P", s.s_p, 1, "fp32", None, per_mb=False, by=amax)
    if tp > 1 and tensor_parallel:
        out.extend(tp_entries(job, tp, s.micro_batch, s.ckpt_value, n_micro))
    if job.num_gpus > 1:
        out.append(_world_entry(job))
    return tuple(out)


def _world_entry(job: Job) -> ScheduleEntry:  # every GPU: the TP ranks' grad-norm parts too
    """[loss, grad-norm^2] in fp32: one all-reduce of 8 bytes per step."""
    n = job.num_gpus
    lay = job.topology.layout(n, 1)
    intra, inter = split_bytes("all_reduce", 8, lay)
    time = job.topology.collective_time("all_reduce", n, 1, 8)
    algo = algorithm_name(job, "all_reduce", n, 1, 8)
    return ScheduleEntry("update", "all_reduce", "world", n, 1, lay.members_per_node, "fp32", 1,
                         8, intra, inter, time, algorithm=algo)
