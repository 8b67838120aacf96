"""The tensor-parallel collectives of a step: the schedule's entries of group ``TP``.

With tensor parallelism of degree t (``tp=T``; docs/cost-model.md, "Tensor parallelism") the
TP collectives are entries of their own, group ``TP`` (size t, stride 1, in the node), per
micro-batch of b sequences of s tokens, on b*s*h activation elements per call in the parameter
dtype (sequence parallelism, Korthikanti et al. 2022):

=========  ==========  =====  ===============================================================
phase      op          group  calls per micro-batch
=========  ==========  =====  ===============================================================
forward    all_gather  TP     2 per block (before QKV, before the MLP), 1 head (before LM head)
forward    red._scat.  TP     2 per block (after the output projection, after the MLP),
                              1 embedding (the vocabulary-parallel lookup's partial sums)
backward   all_gather  TP     2 per block, 1 embedding (the transposes of the reduce-scatters)
backward   red._scat.  TP     2 per block, 1 head (the transposes of the all-gathers)
recompute  all_gather  TP     2 per checkpointed block (the recomputed forward)
recompute  red._scat.  TP     2 per checkpointed block
backward   all_reduce  TP     1 per unit with replicated weights (norms, learned positions):
                              their gradients, r_u elements in the gradient dtype
forward    all_reduce  TP     3 head (the vocabulary-parallel cross-entropy: the maximum, the
                              target logit and the sum of exponentials of each token's
                              logits), b*s fp32 values each; none in backward
=========  ==========  =====  ===============================================================

They run on the compute stream, between the matmuls that need them: the step model
(cost/step_time.py) adds them to their unit's compute, none of it hidden, unless the engine
overlaps them (``training.tp_overlap``: torchtitan's asynchronous TP, Megatron's
--tp-comm-overlap): then a block's all-gathers and reduce-scatters cost only what the
pipelined rule of cost/tp_overlap.py leaves exposed (their ``time_s`` is that cost).

FP8 (``--precision fp8``, ``cost/fp8_bytes.py: fp8_tp_wire``): with torchao's tensorwise
recipe the blocks' all-gathers (forward, recomputed forward, and backward) move 1 byte per
element, dtype ``fp8``, each after a 4-byte fp32 amax all-reduce over the TP group (an
``all_reduce`` entry of its phase); with Transformer Engine's delayed scaling likewise, without
the amax all-reduce; the reduce-scatters, the head's all-gather and the embedding's stay bf16.
"""

from __future__ import annotations

from amsp_planner.cost.job import Job
from amsp_planner.cost.schedule_entry import ScheduleEntry, algorithm_name
from amsp_planner.cost.tp_overlap import OVERLAPPED, block_call_costs, overlapped
from amsp_planner.topology import split_bytes

TP_CALLS = {
    ("forward", "all_gather"): (0, 2, 1),
    ("forward", "reduce_scatter"): (1, 2, 0),
    ("backward", "all_gather"): (1, 2, 0),
    ("backward", "reduce_scatter"): (0, 2, 1),
}
"""(embedding, block, head) calls per micro-batch of each TP collective (module docstring)."""
LOSS_CALLS = 3
"""All-reduces of b*s fp32 values per micro-batch in the vocabulary-parallel cross-entropy's
forward (Megatron's: the logits' maximum, the target logit, the sum of exponentials)."""


def _tp_entry(job: Job, phase: str, op: str, tp: int, dtype: str, calls: tuple,
              per_call: tuple, n_micro: int, micro_batch: int = 0) -> ScheduleEntry | None:
    """One TP entry: calls[c] calls of per_call[c] bytes per unit of class c and micro-batch
    (a block's count may be fractional: the average over the L blocks, as compute is). With
    ``tp_overlap`` on, a block's all-gathers and reduce-scatters cost what the pipelined rule
    leaves on the compute stream (cost/tp_overlap.py); `micro_batch` sizes their matmuls."""
    topo = job.topology
    counts = (1, job.model.num_layers, 1)
    total_calls = round(n_micro * sum(c * k for c, k in zip(counts, calls, strict=True)))
    if total_calls == 0:
        return None
    lay = topo.layout(tp, 1)
    unit_t = tuple(k * topo.collective_time(op, tp, 1, b) if k else 0.0
                   for k, b in zip(calls, per_call, strict=True))
    if calls[1] and micro_batch and op in OVERLAPPED and overlapped(job, tp):
        call_s = topo.collective_time(op, tp, 1, per_call[1])
        block = block_call_costs(job, micro_batch, tp, phase, op, call_s) * calls[1] / 2
        unit_t = (unit_t[0], block, unit_t[2])
    total = round(n_micro * sum(c * k * b for c, k, b in zip(counts, calls, per_call, strict=True)))
    intra, inter = split_bytes(op, total, lay)
    time = n_micro * sum(c * u for c, u in zip(counts, unit_t, strict=True))
    algo = algorithm_name(job, op, tp, 1, max(per_call))
    return ScheduleEntry(phase, op, "TP", tp, 1, lay.members_per_node, dtype, total_calls,
                         total, intra, inter, time, 0.0, unit_t, (0.0, 0.0, 0.0), algo)


def _block_gather_bytes(job: Job) -> tuple[int, int]:
    """(bytes per element of a block's TP all-gathers, amax all-reduces per all-gather):
    the parameter dtype's, or FP8's where the recipe gathers FP8 (module docstring)."""
    t = job.training
    if t.precision != "fp8":
        return t.param_bytes, 0
    from amsp_planner.cost.fp8 import check_training
    from amsp_planner.cost.fp8_bytes import fp8_tp_wire

    w = fp8_tp_wire(check_training(t, job.engine, job.cluster.gpu.arch), job.engine)
    return min(w.all_gather, t.param_bytes), w.amax_allreduces_per_all_gather


def tp_entries(job: Job, tp: int, micro_batch: int, ckpt, n_micro: int) -> list[ScheduleEntry]:
    """The TP collectives of one step (module docstring)."""
    from amsp_planner.ckpt_setting import stops_early
    from amsp_planner.strategy import checkpointed_blocks

    t, m = job.training, job.model
    elems = micro_batch * t.seq_len * m.hidden_size
    act = elems * t.param_bytes
    acts = (act, act, act)
    gb, amax = _block_gather_bytes(job)
    gathers = (act, elems * gb, act)
    gdtype = "fp8" if gb < t.param_bytes else t.dtype_name
    out = [_tp_entry(job, phase, op, tp, gdtype if op == "all_gather" else t.dtype_name, calls,
                     gathers if op == "all_gather" else acts, n_micro, micro_batch)
           for (phase, op), calls in TP_CALLS.items()]
    # the vocabulary-parallel cross-entropy: max, target logit, sum of exponentials per token
    ce = 4 * micro_batch * t.seq_len
    out.append(_tp_entry(job, "forward", "all_reduce", tp, "fp32", (0, 0, LOSS_CALLS),
                         (0, 0, ce), n_micro))
    k, op_level = checkpointed_blocks(ckpt, m.num_layers)
    frac = (0, 2 * k / m.num_layers, 0) if k and not op_level else (0, 0, 0)
    if k and not op_level:
        # an engine whose checkpoint stops early does not rerun the down projection, nor the
        # reduce-scatter after it (as compute.py and tp_recompute_s count it)
        skip = 1 if stops_early(job, tp) and not overlapped(job, tp) else 0
        rs = (0, (2 - skip) * k / m.num_layers, 0)
        out += [_tp_entry(job, "recompute", o, tp, gdtype if o == "all_gather" else t.dtype_name,
                          frac if o == "all_gather" else rs,
                          gathers if o == "all_gather" else acts, n_micro, micro_batch)
                for o in ("all_gather", "reduce_scatter")]
    if amax:  # one fp32 amax all-reduce before each FP8 all-gather of a block
        for phase, per in (("forward", TP_CALLS[("forward", "all_gather")][1]),
                           ("backward", TP_CALLS[("backward", "all_gather")][1]),
                           ("recompute", frac[1])):
            out.append(_tp_entry(job, phase, "all_reduce", tp, "fp32", (0, amax * per, 0),
                                 (0, 4, 0), n_micro))
    rep = m.tp_replicated_params()
    reps = (rep[0] * t.grad_bytes, rep[1] * t.grad_bytes, rep[-1] * t.grad_bytes)
    out.append(_tp_entry(job, "backward", "all_reduce", tp, t.grad_dtype_name,
                         tuple(1 if r else 0 for r in reps), reps, n_micro))
    return [e for e in out if e is not None]


def tp_block_forward_s(job: Job, micro_batch: int, tp: int) -> float:
    """Seconds of one block's forward TP collectives for one micro-batch (2 all-gathers and 2
    reduce-scatters of b*s*h elements)."""
    elems = micro_batch * job.training.seq_len * job.model.hidden_size
    gb, amax = _block_gather_bytes(job)
    topo = job.topology
    ag = topo.collective_time("all_gather", tp, 1, elems * gb)
    rs = _block_rs_s(job, micro_batch, tp)
    amax_s = 2 * amax * topo.collective_time("all_reduce", tp, 1, 4)
    if overlapped(job, tp):  # what the pipelined rule leaves exposed (cost/tp_overlap.py)
        return (block_call_costs(job, micro_batch, tp, "recompute", "all_gather", ag)
                + block_call_costs(job, micro_batch, tp, "recompute", "reduce_scatter", rs)
                + amax_s)
    return 2 * (ag + rs) + amax_s


def _block_rs_s(job: Job, micro_batch: int, tp: int) -> float:
    """Seconds of one of a block's forward TP reduce-scatters (b*s*h elements)."""
    t = job.training
    elems = micro_batch * t.seq_len * job.model.hidden_size
    return job.topology.collective_time("reduce_scatter", tp, 1, elems * t.param_bytes)


def tp_recompute_s(job: Job, micro_batch: int, ckpt, tp: int) -> float:
    """Seconds per block (the average over the L blocks) and micro-batch that checkpointing
    setting `ckpt` adds in TP collectives (the recomputed forward's; op-level repeats none)."""
    from amsp_planner.ckpt_setting import checkpointed_blocks, stops_early

    k, op_level = checkpointed_blocks(ckpt, job.model.num_layers)
    if tp == 1 or op_level or not k:
        return 0.0
    block = tp_block_forward_s(job, micro_batch, tp)
    if stops_early(job, tp) and not overlapped(job, tp):  # the down projection's is not rerun
        block -= _block_rs_s(job, micro_batch, tp)
    return block * k / job.model.num_layers
