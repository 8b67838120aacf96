"""The collectives of a mixture-of-experts step: both parameter classes' gathers and reductions,
and the token all-to-alls (docs/moe.md).

The dense class (``Job.units``: every unit's parameters but the routed experts) runs the
reference schedule (cost/schedule.py) over all N ranks with the dense triple; the expert class
(``Job.expert_units(e)``: the E/e experts a rank holds of each MoE layer) runs it over the
expert-data-parallel (EDP) group, the N/e ranks holding the same experts, with the expert
triple (``strategy_experts.py``: an expert x-group is s_x consecutive EDP ranks, at the EDP
stride d). One call per unit that holds elements of the class (the expert class: one per MoE
layer). Entries, per class (group names; the expert class's are prefixed ``EP_``):

=========  ==========  ==========================  ===================================
phase      op          group                       size, stride (EDP stride d; dense d=1)
=========  ==========  ==========================  ===================================
forward    all_gather  P / EP_P                    s_P, d            per micro-batch
backward   all_gather  P / EP_P                    s_P, d            per micro-batch
backward   red._scat.  G / EP_G                    s_G, d            per micro-batch
grad_sync  red._scat.  OS_shard / EP_OS_shard      s_OS/s_G, s_G d   once per step
grad_sync  all_reduce  OS_replica / EP_OS_replica  M/s_OS, s_OS d    once per step (M: N or N/e)
update     all_gather  P_update / EP_P_update      s_OS/s_P, s_P d   once per step
=========  ==========  ==========================  ===================================

The token all-to-alls, group ``EP`` (size e, the EP group's stride: 1 in the node, N/e
spanning), per MoE layer and micro-batch of b sequences of s tokens: the dispatch and the
combine, 2 calls in ``forward``, their transposes, 2 calls in ``backward``, and 2 per
checkpointed MoE layer in ``recompute`` (the recomputed forward; op-level checkpointing
repeats none). Each call's buffer is b x s x h x c elements in the parameter dtype (c the
copies of a token the dispatch sends, ``dispatch_copies``: k by default) times the imbalance (``TrainingSpec.expert_imbalance``, max/mean
tokens per expert: the busiest rank's buffer); (e-1)/e of it leaves the rank, split into
NVLink and NIC bytes by ``topology.split_bytes`` over the EP group's layout, and priced by
NCCL's all-to-all model (``collectives._all_to_all``: pairwise sends).

Step model (cost/step_time.py): the class entries take their roles as the dense ones do (a
block's seconds are the mean over the L blocks of its calls: the step model's block class is
one); the all-to-alls sit between the router and the expert matmuls and between those and the
next block, so their seconds add to the unit's compute as TP's do, none hidden (no
communication/computation overlap of the all-to-alls, such as DeepEP's or dual-batch
overlap, is modelled). Engines' call grouping (buckets, per-module gathers) is not modelled for
MoE models: one call per unit and class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from amsp_planner.ckpt_setting import is_moe_only
from amsp_planner.cost.job import Job
from amsp_planner.cost.schedule_entry import ScheduleEntry, algorithm_name
from amsp_planner.strategy import Strategy, checkpointed_blocks
from amsp_planner.topology import split_bytes

A2A_CALLS = {"forward": 2, "backward": 2, "recompute": 2}
"""All-to-all calls per MoE layer and micro-batch: dispatch + combine, their transposes in
backward, and the recomputed forward's of a checkpointed layer."""


def class_entry(job: Job, phase: str, op: str, group: str, size: int, stride: int, dtype: str,
                units: Sequence[int], n_micro: int, full: Callable[[int], int],
                copies: bool) -> ScheduleEntry | None:
    """One collective kind over a class's units: one call of ``full(u)`` bytes per unit with
    u > 0 elements, per micro-batch (``n_micro``; 1 for once-per-step entries). With `copies`,
    a gather or reduce-scatter copies its buffer once on GPUs (cost/schedule.py's ``_entry``)."""
    if size <= 1 or not any(units):
        return None
    topo, gpu = job.topology, job.cluster.gpu
    lay = topo.layout(size, stride)
    launch = job.profile.execution.launch_us * 1e-6
    secs = [topo.collective_time(op, size, stride, full(u)) + launch if u else 0.0
            for u in units]
    hbm = gpu.hbm_gbyte_per_s * 1e9 if gpu.hbm_gbyte_per_s else 0.0
    kern = [2 * full(u) / hbm if u and copies and hbm else 0.0 for u in units]
    L = job.model.num_layers
    unit_t = (secs[0], sum(secs[1:-1]) / L, secs[-1])
    unit_k = (kern[0], sum(kern[1:-1]) / L, kern[-1])
    total = n_micro * sum(full(u) for u in units if u)
    intra, inter = split_bytes(op, total, lay)
    calls = n_micro * sum(1 for u in units if u)
    algo = algorithm_name(job, op, size, stride, full(max(units)))
    return ScheduleEntry(phase, op, group, size, stride, lay.members_per_node, dtype, calls,
                         int(total), intra, inter, n_micro * sum(secs), n_micro * sum(kern),
                         unit_t, unit_k, algo)


def class_entries(job: Job, units: Sequence[int], factors: tuple[int, int, int], ranks: int,
                  stride: int, prefix: str, n_micro: int, per_micro_batch: bool = True
                  ) -> list[ScheduleEntry]:
    """The reference schedule of one parameter class (module docstring): `units` its padded
    elements per unit, `factors` its (s_P, s_G, s_OS) over `ranks` ranks at `stride`."""
    t, ex = job.training, job.profile.execution
    pb, gb, pdt, gdt = t.param_bytes, t.grad_bytes, t.dtype_name, t.grad_dtype_name
    p, g, o = factors
    d = stride
    out = []

    def add(phase, op, group, size, stride_, dtype, full, per_mb, overlap=ex.sync_overlap):
        e = class_entry(job, phase, op, prefix + group, size, stride_, dtype, units,
                        n_micro if per_mb else 1, full, copies=per_mb)
        if e is not None and phase == "grad_sync" and not overlap:
            # the engine runs it after backward: charged to the embedding's reduction, exposed
            e = replace(e, unit_time_s=(e.time_s, 0.0, 0.0))
        out.append(e)

    if per_micro_batch:
        add("forward", "all_gather", "P", p, d, pdt, lambda u: u * pb, True)
        add("backward", "all_gather", "P", p, d, pdt, lambda u: u * pb, True)
        add("backward", "reduce_scatter", "G", g, d, gdt, lambda u: u * gb, True)
    add("grad_sync", ex.replicated_reduce if g == 1 else "reduce_scatter", "OS_shard", o // g,
        g * d, gdt, lambda u: u // g * gb, False,
        ex.shard_reduce_overlaps(g))
    add("grad_sync", "all_reduce", "OS_replica", ranks // o, o * d, gdt, lambda u: u // o * gb,
        False)
    add("update", "all_gather", "P_update", o // p, p * d, pdt, lambda u: u // p * pb, False)
    return [e for e in out if e is not None]


def dispatch_copies(job: Job, ep: int) -> float:
    """Copies of a token the dispatch sends (and the combine returns) at expert-parallel
    degree `ep` (``TrainingSpec.expert_dispatch``, ``expert_routing``; docs/moe.md):

    - 'copies': k, one per routed expert;
    - 'ranks', 'uniform' routing: the expected number of distinct EP ranks among k distinct
      experts drawn uniformly from E, each rank holding E/ep consecutive ones:
      ep x (1 - C(E - E/ep, k) / C(E, k)) (a rank is missed when all k fall elsewhere);
    - 'ranks', 'round_robin' routing (slot j of token t on expert (t k + j) mod E): the mean
      over one period of E / gcd(k, E) tokens of the distinct ranks expert // (E/ep) of the
      token's k experts: exact.
    """
    m, t = job.model, job.training
    E, k = m.num_experts, m.experts_per_token
    if t.expert_dispatch == "copies" or ep <= 1:
        return float(k)
    local = E // ep
    if t.expert_routing == "uniform":
        from math import comb

        return ep * (1.0 - comb(E - local, k) / comb(E, k))
    from math import gcd

    period = E // gcd(k, E)
    ranks = sum(len({(i * k + j) % E // local for j in range(k)}) for i in range(period))
    return ranks / period


def a2a_bytes_per_call(job: Job, micro_batch: int, ep: int) -> int:
    """Bytes of one dispatch or combine buffer: b x s x h elements x the copies per token
    (``dispatch_copies``: k, one per routed expert, unless the dispatch sends one per rank)
    x imbalance."""
    m, t = job.model, job.training
    elems = micro_batch * t.seq_len * m.hidden_size * dispatch_copies(job, ep)
    return round(elems * t.param_bytes * t.expert_imbalance)


def moe_layers_checkpointed(job: Job, ckpt) -> int:
    """MoE layers whose forward checkpointing `ckpt` recomputes (full: all; the first K
    blocks: the MoE layers among them; op-level: none; 'moe': all)."""
    if is_moe_only(ckpt):
        return job.model.num_moe_layers
    k, op = checkpointed_blocks(ckpt, job.model.num_layers)
    return 0 if op else sum(job.model.is_moe_layer(i) for i in range(k))


def a2a_entries(job: Job, s: Strategy, n_micro: int) -> list[ScheduleEntry]:
    """The token all-to-alls of one step, group ``EP`` (module docstring)."""
    if s.ep <= 1:
        return []
    m, topo = job.model, job.topology
    lay_e = s.expert_layout(job.num_gpus, job.gpus_per_node)
    size, stride = lay_e.ep_size, lay_e.ep_stride
    lay = topo.layout(size, stride)
    per_call = a2a_bytes_per_call(job, s.micro_batch, s.ep)
    one = topo.collective_time("all_to_all", size, stride, per_call)
    algo = algorithm_name(job, "all_to_all", size, stride, per_call)
    layers = {"forward": m.num_moe_layers, "backward": m.num_moe_layers,
              "recompute": moe_layers_checkpointed(job, s.ckpt_value)}
    out = []
    for phase, per_layer in A2A_CALLS.items():
        calls = n_micro * per_layer * layers[phase]
        if not calls:
            continue
        total = calls * per_call
        intra, inter = split_bytes("all_to_all", total, lay)
        block = per_layer * layers[phase] / m.num_layers * one
        out.append(ScheduleEntry(phase, "all_to_all", "EP", size, stride, lay.members_per_node,
                                 job.training.dtype_name, calls, total, intra, inter,
                                 calls * one, 0.0, (0.0, block, 0.0), (0.0, 0.0, 0.0), algo))
    return out


def _cached_class_entries(job: Job, ep: int, factors, ranks: int, stride: int, prefix: str,
                          n_micro: int, per_micro_batch: bool) -> list[ScheduleEntry]:
    """``class_entries`` of the dense class (`ep` 0) or the expert class at degree `ep`,
    memoised on the job (the search prices each class's triple with every triple of the
    other)."""
    key = ("moe_class", ep, factors, ranks, stride, n_micro, per_micro_batch)
    cache = job._tp_cache
    if key not in cache:
        units = job.expert_units(ep) if ep else job.units
        cache[key] = class_entries(job, units, factors, ranks, stride, prefix, n_micro,
                                   per_micro_batch)
    return cache[key]


def moe_schedule(job: Job, s: Strategy, n_micro: int, per_micro_batch: bool = True,
                 all_to_all: bool = True) -> list[ScheduleEntry]:
    """Both classes' entries and (with `all_to_all`) the token all-to-alls of one step."""
    n, r = job.num_gpus, job.gpus_per_node
    out = list(_cached_class_entries(job, 0, (s.s_p, s.s_g, s.s_os), n, 1, "", n_micro,
                                     per_micro_batch))
    lay = s.expert_layout(n, r)
    ex = tuple(s.expert_factor(c) for c in ("p", "g", "os"))
    out += _cached_class_entries(job, s.ep, ex, lay.edp_size, lay.edp_stride, "EP_", n_micro,
                                 per_micro_batch)
    if all_to_all and per_micro_batch:
        out += a2a_entries(job, s, n_micro)
    return out
