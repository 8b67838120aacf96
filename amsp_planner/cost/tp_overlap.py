"""Tensor-parallel communication overlapped with the matmuls (``training: {tp_overlap: true}``,
``--tp-overlap on``).

Both engines that overlap TP collectives split the matmul next to each collective into t
chunks (t = the TP degree) and pipeline the chunks against the t - 1 peer transfers:

- torchtitan's asynchronous TP (``compile.enable_async_tensor_parallel``: torch._inductor's
  micro_pipeline_tp pass rewrites all_gather -> mm into ``fused_all_gather_matmul`` and
  mm -> reduce_scatter into ``fused_matmul_reduce_scatter``, SymmetricMemory,
  torch/distributed/_symmetric_memory/__init__.py): ``_pipelined_all_gather_and_consume``
  consumes the local shard first ("While consuming local shard, copy ... remote shards"),
  then copies shard k from its peer and consumes it while shard k + 1 is copied;
  ``_pipelined_produce_and_all2all`` produces the chunk of each peer in turn, sends it while
  the next is produced, the local chunk last, then sums the t partial chunks (a memory-bound
  kernel). torchtitan compiles each TransformerBlock on its own, so only the blocks' four
  forward collectives (before QKV, after the output projection, before the MLP, after it)
  and the backward all-gathers (their consumer, the input-gradient mm, takes the gathered
  gradient as its lhs: ``_find_consumer_matmuls``) are fused. The backward reduce-scatters
  are not: their input is the sum of the wq, wk, wv (w1, w3) input gradients, an add, and
  ``_find_producer_matmul`` fuses only a reduce-scatter whose input is an mm (or
  reshape-mm-reshape) (torch/_inductor/fx_passes/micro_pipeline_tp.py): exposed. So are the
  embedding's reduce-scatter, the head's all-gather and the cross-entropy's all-reduces.
- Megatron-Core with Transformer Engine's userbuffers (``--tp-comm-overlap``,
  transformer_engine/pytorch/module/base.py ``initialize_ub``): the column-parallel
  linears' forward all-gather ("qkv_fprop", "fc1_fprop": ring exchange) and the
  row-parallel linears' forward reduce-scatter ("proj_fprop", "fc2_fprop": pipelined) are
  chunked the same way; in backward the transposes ("proj_dgrad", "fc2_dgrad": ring-exchange
  all-gather) and the dgrad reduce-scatters run whole beside the wgrad GEMM ("qkv_wgrad",
  "fc1_wgrad": bulk overlap, no chunks: v = max(m + sigma c, c)). Megatron's output layer is
  not a TE module: its collectives stay exposed.

The rule, per collective of c seconds (the NCCL price of the same call, ``topology``) next to
its matmul of m seconds (``cost/compute.py``, FP8 where the linear runs FP8; bf16 QKV as
compute.py prices it, one matmul of width q + 2 kv): with t chunks of
m / t each and t - 1 transfers of c / (t - 1) each, the chunk k can start once transfer k is
in (all-gather) or the transfer k can start once chunk k is out (reduce-scatter), so the pair
takes

    v = max(m + sigma c,  c + m / t)

(the compute-bound case: every transfer hidden behind the chunk before it, the matmul slowed
by sigma per second of communication under it, ``gpu.comm_compute_slowdown``, as the
data-parallel overlap prices it; the communication-bound case: all transfers in a row, then
the last chunk's matmul, or the first chunk's before the first send). The collective then
costs v - m on the compute stream instead of c; a reduce-scatter adds the sum of its t partial
chunks, (1 + 1/t) b s h elements read and written at ``hbm_gbyte_per_s`` (the fused op's
reduction; NCCL's reduce-scatter does it inside c). Pairs, per block and micro-batch:

=========  ==============  ====================================================
phase      collective      matmul it hides behind (forward seconds of the linears)
=========  ==============  ====================================================
forward    all-gather 1    wq, wk, wv (Megatron: linear_qkv; one matmul here)
forward    reduce-scat. 1  wo (linear_proj)
forward    all-gather 2    w1, w3 (linear_fc1; GELU: fc1)
forward    reduce-scat. 2  w2 (linear_fc2; GELU: fc2)
backward   all-gather      the dgrad of wo, of w2 (as long as their forward)
backward   reduce-scat.    torchtitan: none (exposed); Megatron: the wgrad of linear_qkv,
                           of linear_fc1 (bulk)
recompute  as forward
=========  ==============  ====================================================
"""

from __future__ import annotations

from amsp_planner.cost.job import Job
from amsp_planner.engines import runs_as

OVERLAPPED = ("all_gather", "reduce_scatter")
"""The block collectives the rule hides (module docstring); every other TP call is exposed."""

_PAIRS = {("forward", "all_gather"): ("qkv", "fc1"), ("forward", "reduce_scatter"): ("proj", "fc2"),
          ("recompute", "all_gather"): ("qkv", "fc1"),
          ("recompute", "reduce_scatter"): ("proj", "fc2"),
          ("backward", "all_gather"): ("proj", "fc2"), ("backward", "reduce_scatter"): ("qkv", "fc1")}
"""(phase, op) -> the two linears (by role) its two calls per block hide behind."""

_ROLE = {"wq": "qkv", "wk": "qkv", "wv": "qkv", "linear_qkv": "qkv", "wo": "proj",
         "linear_proj": "proj", "w1": "fc1", "w3": "fc1", "fc1": "fc1", "linear_fc1": "fc1",
         "w2": "fc2", "fc2": "fc2", "linear_fc2": "fc2"}


BULK = {"megatron"}
"""Engines that overlap the backward reduce-scatters (Transformer Engine's bulk overlap with
the wgrad GEMM); the others (torch's async TP) leave them exposed (module docstring)."""


def pipelined_cost(comm_s: float, matmul_s: float, t: int | None, sigma: float) -> float:
    """Seconds a collective of `comm_s` adds to the compute stream when pipelined in `t`
    chunks against a matmul of `matmul_s` (module docstring): v - m; `t` None: a bulk
    overlap, the collective whole beside the matmul."""
    v = max(matmul_s + sigma * comm_s, comm_s + (matmul_s / t if t else 0.0))
    return v - matmul_s


def linear_seconds(job: Job, micro_batch: int, tp: int) -> dict[str, float]:
    """Forward seconds of one TP rank's linears of a block, summed by role (qkv, proj, fc1,
    fc2), on the b s tokens of a micro-batch, as cost/compute.py prices them (FP8 at the
    linear's speed-up where it runs FP8)."""
    from amsp_planner.cost.roofline import _block_matmuls, _matmul, _rates, fp8_linears

    r = _rates(job)
    tokens = micro_batch * job.training.seq_len
    out = {"qkv": 0.0, "proj": 0.0, "fc1": 0.0, "fc2": 0.0}
    if fp8_linears(job):
        from amsp_planner.cost.fp8 import check_training, fp8_matmuls, named_matmuls_s

        recipe = check_training(job.training, job.engine, job.cluster.gpu.arch)
        for x in fp8_matmuls(job.model, recipe, job.engine, tp).block:
            out[_ROLE[x.name]] += named_matmuls_s(job, tokens, tp, [x.name],
                                                  lambda k, n: _matmul(r, tokens, k, n))
        return out
    mlp = ["fc1", "fc1", "fc2"] if job.model.ffn_matrices == 3 else ["fc1", "fc2"]
    for role, (k, n) in zip(["qkv", "proj"] + mlp, _block_matmuls(job, tp), strict=True):
        out[role] += _matmul(r, tokens, k, n)
    return out


def reduction_s(job: Job, micro_batch: int, tp: int) -> float:
    """The fused reduce-scatter's sum of its t partial chunks: (1 + 1/t) b s h elements in
    the parameter dtype read and written at HBM bandwidth (0 off GPUs)."""
    hbm = job.cluster.gpu.hbm_gbyte_per_s
    if not hbm:
        return 0.0
    elems = micro_batch * job.training.seq_len * job.model.hidden_size
    return (1 + 1 / tp) * elems * job.training.param_bytes / (hbm * 1e9)


def block_call_costs(job: Job, micro_batch: int, tp: int, phase: str, op: str,
                     call_s: float) -> float:
    """Seconds on the compute stream of one block's two calls of (phase, op), each of
    `call_s` seconds when exposed, pipelined against its linear (module docstring)."""
    if (phase, op) == ("backward", "reduce_scatter"):
        if runs_as(job.engine) not in BULK:
            return 2 * call_s  # not fused: exposed
        mm, sigma = linear_seconds(job, micro_batch, tp), job.cluster.gpu.comm_compute_slowdown
        return sum(pipelined_cost(call_s, mm[role], None, sigma) for role in _PAIRS[phase, op])
    mm = linear_seconds(job, micro_batch, tp)
    sigma = job.cluster.gpu.comm_compute_slowdown
    extra = reduction_s(job, micro_batch, tp) if op == "reduce_scatter" else 0.0
    return sum(pipelined_cost(call_s, mm[role], tp, sigma) + extra
               for role in _PAIRS[phase, op])


def overlapped(job: Job, tp: int) -> bool:
    """Whether the job's TP collectives are overlapped with the matmuls."""
    return tp > 1 and job.training.tp_overlap
