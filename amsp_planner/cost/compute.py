"""Compute time of each unit, by GPU, dtype and matrix shape.

Each unit's forward and backward is priced kernel by kernel with a roofline and a fixed
per-kernel overhead (in the spirit of Calculon's size-dependent matmul efficiency):

  matmul (T x K) @ (K x N):  max(2TKN / (peak x e_mm), bytes / hbm) + t0
  attention (flash, causal):  2 x T x s x h forward (QK^T and PV over the causal half),
                              2.5x that backward (recomputed scores, dV, dP, dQ, dK), at
                              peak x e_attn
  elementwise (norms, RoPE, SwiGLU's product, residual adds): bytes / hbm, eager or compiled

T = tokens of one micro-batch (micro-batch x sequence), peak = the GPU's peak in the job's
dtype (fp32 jobs: the fp32 peak; PyTorch runs fp32 matmuls without TF32 by default), e_mm =
``achievable_fraction``, e_attn = ``attention_fraction`` (or the rate of the job's
``attention_kernel``: cost/attention_kernel.py), t0 = ``kernel_overhead_us``, hbm =
``hbm_gbyte_per_s``. Backward runs each matmul twice (input and weight gradients). Small
micro-batches and small models therefore run below the large-matrix efficiency: t0 and the
memory-bound kernels weigh more.

Units (as the runtime shards them): the embedding (a lookup: no FLOPs), each block
(QKV, output, MLP matmuls, attention, elementwise), and the head (final norm, LM head matmul,
and the fp32 cross-entropy over the vocabulary). Full activation checkpointing recomputes each
block's forward during backward; the head is not recomputed. Checkpointing K of the L blocks
recomputes K forwards per micro-batch: the block class (one class, counted L times by the step
model) takes the average, backward + (K/L) x forward, so that the step stays linear in K (the
ILP and the cost model use this same figure; docs/cost-model.md says what it approximates).
Op-level selective checkpointing keeps the matmul and attention outputs and recomputes the
elementwise kernels only: backward + the block's forward elementwise time; with torchtitan's
policy (every second matmul recomputed: ``activations.op_recomputed_matmuls``) also the
forward of wk, wo and w3 (GELU: wk, wo and fc2).

Elementwise bytes per token and block, forward (eager, a = activation bytes per element):
  2 RMSNorms 2 x 14h a  (upcast to fp32, variance, normalise, downcast, weight: ~7 passes of h;
  a LayerNorm is torch's one native kernel, aten::native_layer_norm: read h, write h, 2 x 2h a)
  RoPE on q and k 6(h + d_kv) a (none with learned positions),  2 residual adds 6h a,
  SwiGLU SiLU + product 5f a (GELU 2f a)
Under torch.compile (``training.compile``) Inductor fuses each residual add into the norm after
it and RoPE's pointwise ops and SwiGLU's into one kernel each, so every tensor is read and
written once (the rate stays ``hbm``):
  2 add + RMSNorm 2 x 4h a  (read the residual stream and the branch output, write their sum
  and the normalised output),  RoPE 2(h + d_kv) a,  SwiGLU 3f a (read gate and up, write)
backward twice the forward. Head: cross-entropy in fp32, 12V bytes per token forward and
18V backward (bf16 logits upcast, log-softmax, its gradient).

Tensor parallelism of degree t (Megatron-style, docs/cost-model.md): each TP rank runs every
matmul with its column-parallel output (QKV, gate/up, LM head) or row-parallel input (output
projection, down) divided by t, attention over its a/t heads, the elementwise kernels over its
1/t of the elements (norms on s/t tokens with sequence parallelism), the cross-entropy over its
V/t vocabulary; each kernel keeps its fixed overhead t0, so small shards run below the
large-matrix efficiency. The TP collectives are not compute: ``cost/schedule.py`` prices them.

On CPU processes (no ``hbm_gbyte_per_s``, no overhead) this reduces to matmul FLOPs / (peak x
``achievable_fraction``) (attention over its causal half), the rate ``amsp calibrate`` measures
for the runtime's own model.
"""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.ckpt_setting import is_moe_only, stops_early
from amsp_planner.cost.job import Job
from amsp_planner.cost.roofline import (  # noqa: F401 (_Rates, fp8_linears: re-exported)
    _block_matmuls,
    _div,
    _matmul,
    _Rates,
    _rates,
    fp8_linears,
)
from amsp_planner.engines import profile
from amsp_planner.strategy import checkpointed_blocks


@dataclass(frozen=True)
class UnitCompute:
    """Seconds of one micro-batch for one unit class."""

    forward: float
    backward: float
    """Including the recomputed forward under checkpointing."""


def _op_matmuls_s(job: Job, r: _Rates, t: int, tp: int) -> float:
    """Forward seconds of the matmuls the op-level policy recomputes (torchtitan's: wk, wo and
    w3 of one TP rank's shard; none for the bundled runtime's)."""
    from amsp_planner.cost.activations import op_recomputed_matmuls

    m = job.model
    h, f, kv = m.hidden_size, _div(m.ffn_hidden_size, tp), _div(m.kv_dim, tp)
    q = _div(m.num_heads * m.head_dim, tp)
    shape = {"wk": (h, kv), "wo": (q, h), "w3": (h, f), "fc2": (f, h)}
    names = op_recomputed_matmuls(job)
    if fp8_linears(job):  # recomputed in FP8 like their forward (cost/fp8.py)
        from amsp_planner.cost.fp8 import named_matmuls_s

        return named_matmuls_s(job, t, tp, names, lambda k, n: _matmul(r, t, k, n))
    return sum(_matmul(r, t, *shape[n]) for n in names)


def _last_linear_s(job: Job, r: _Rates, t: int, tp: int) -> float:
    """Forward seconds of the block's last linear, the MLP's down projection (w2, fc2,
    linear_fc2), in FP8 where the block's linears are: what a checkpoint that stops early does
    not rerun (``EngineProfile.ckpt_early_stop``: its input is the last tensor the block saves,
    and torch packs an op's inputs before it runs the op)."""
    k, n = _block_matmuls(job, tp)[-1]
    if fp8_linears(job):
        from amsp_planner.cost.fp8 import block_linears, named_matmuls_s

        name = block_linears(job.model, job.engine, tp)[-1][0]
        return named_matmuls_s(job, t, tp, [name], lambda k, n: _matmul(r, t, k, n))
    return _matmul(r, t, k, n)


def fused_elementwise(job: Job) -> bool:
    """The elementwise kernels priced fused: under torch.compile, or where the engine's own
    kernels fuse them (``EngineProfile.fused_elementwise``)."""
    return job.training.compile or profile(job.engine).fused_elementwise


def _act_elements(job: Job) -> int:
    """Forward elements per token of the MLP's activation: SwiGLU 5f eager (SiLU read and
    write, the product read two and write), 3f compiled (one kernel reads the gate and up
    outputs and writes their product); GELU 2f."""
    f = job.model.ffn_hidden_size
    return (3 if fused_elementwise(job) else 5) * f if job.model.ffn_matrices == 3 else 2 * f


def _elementwise_block(job: Job) -> float:
    """Forward elementwise bytes per token of one block (module docstring). RoPE only where
    the model rotates (``position_embedding: rope``; learned positions are added once, at the
    embedding); eager LayerNorm is torch's one native kernel (read h, write h), not RMSNorm's
    seven passes."""
    m = job.model
    h, kv = m.hidden_size, m.kv_dim
    a = job.training.param_bytes
    rope = m.position_embedding == "rope"
    if fused_elementwise(job):  # add + norm one kernel each (read 2h, write 2h), RoPE fused
        return (2 * 4 * h + (2 * (h + kv) if rope else 0) + _act_elements(job)) * a
    norms = 2 * (2 * h if m.norm_type == "layernorm" else 14 * h)
    return (norms + (6 * (h + kv) if rope else 0) + 6 * h + _act_elements(job)) * a


def _unsplit_elementwise(job: Job, tokens: int, tp: int) -> float:
    """Bytes per TP rank beyond its 1/tp share without sequence parallelism: the two norms and
    the residual adds (28h + 6h per token) run over every token on every rank."""
    if tp == 1 or job.training.sequence_parallel:
        return 0.0
    return tokens * 34 * job.model.hidden_size * job.training.param_bytes * (1 - 1 / tp)


def block_compute(job: Job, micro_batch: int, ckpt: bool | int | str,
                  tp: int = 1, ep: int = 1) -> UnitCompute:
    """One block's seconds; `ckpt` True (every block), False, K blocks or 'op'; per TP rank.
    A mixture-of-experts model's block is the mean over its L blocks, at expert-parallel
    degree `ep` (cost/moe_compute.py)."""
    r = _rates(job)
    m, s = job.model, job.training.seq_len
    t = micro_batch * s
    if fp8_linears(job):  # the blocks' linears in FP8 (cost/fp8.py)
        from amsp_planner.cost.fp8 import block_matmul_s

        mm = block_matmul_s(job, t, tp, lambda k, n: _matmul(r, t, k, n))
    else:
        mm = sum(_matmul(r, t, k, n) for k, n in _block_matmuls(job, tp))
    elems = _elementwise_block(job)
    if m.is_moe:  # the MLP part: the mean over the blocks (cost/moe_compute.py)
        from amsp_planner.cost.activations import KORTHIKANTI, profile_of
        from amsp_planner.cost.moe_compute import mean_mlp

        mats = _block_matmuls(job)[-m.ffn_matrices:]
        dense_mlp = sum(_matmul(r, t, k, n) for k, n in mats)
        if fp8_linears(job):  # mm holds the dense MLP at its FP8 price: take that back out
            from amsp_planner.cost.fp8 import mlp_linear_names, named_matmuls_s

            dense_mlp = named_matmuls_s(job, t, tp, mlp_linear_names(job.model, job.engine),
                                        lambda k, n: _matmul(r, t, k, n))
        dense_el = _act_elements(job)
        mlp_s, mlp_el = mean_mlp(job, r, t, ep, dense_mlp, dense_el,
                                  profile_of(job) in KORTHIKANTI)
        mm += mlp_s - dense_mlp
        elems += (mlp_el - dense_el) * job.training.param_bytes
    # over the whole sequence: s x C in the per-rank view of context parallelism C
    attn = _div(2.0 * t * s * job.cp * m.num_heads * m.head_dim, tp) / r.attn
    elem = (_div(t * elems, tp) + _unsplit_elementwise(job, t, tp)) / r.hbm if r.hbm else 0.0
    fwd = mm + attn + elem
    bwd = 2 * mm + 2.5 * attn + 2 * elem
    k, op = checkpointed_blocks(ckpt, m.num_layers)
    if op:
        recompute = elem + _op_matmuls_s(job, r, t, tp)
    elif k and stops_early(job, tp):  # the last linear is not rerun
        recompute = (fwd - _last_linear_s(job, r, t, tp)) * (k / m.num_layers)
    else:
        recompute = fwd * (k / m.num_layers)
    if is_moe_only(ckpt) and m.is_moe:  # the MoE layers' MLP forward, the mean over the blocks
        from amsp_planner.cost.activations import KORTHIKANTI, profile_of
        from amsp_planner.cost.moe_compute import moe_layer_forward_s

        fused = profile_of(job) in KORTHIKANTI
        recompute = m.num_moe_layers * moe_layer_forward_s(job, r, t, ep, fused) / m.num_layers
    return UnitCompute(fwd, bwd + recompute)


def head_compute(job: Job, micro_batch: int, tp: int = 1) -> UnitCompute:
    r = _rates(job)
    m = job.model
    t = micro_batch * job.training.seq_len
    mm = _matmul(r, t, m.hidden_size, _div(m.vocab_size, tp))
    ce = _div(t * m.vocab_size, tp) / r.hbm if r.hbm else 0.0
    from amsp_planner.cost.activations import eager_loss_extras

    fwd, bwd = CE_BYTES[job.profile.fused_cross_entropy]
    for name in eager_loss_extras(job):  # the eager loss's extra passes
        fwd, bwd = fwd + LOSS_EXTRA_BYTES[name][0], bwd + LOSS_EXTRA_BYTES[name][1]
    return UnitCompute(mm + fwd * ce, 2 * mm + bwd * ce)


CE_BYTES = {"": (12, 18), "te": (6, 4)}
"""HBM bytes per logit of the loss, forward and backward, by the engine's loss kernel
(``EngineProfile.fused_cross_entropy``). Eager (``F.cross_entropy(logits.float())``): the
bf16 logits upcast (read 2, write 4), log-softmax (read 4, write 4 less the max and sum
passes' reads, ~12 in all), and backward its gradient and the downcast (18). Transformer
Engine's parallel cross-entropy (transformer_engine/common/triton/cross_entropy.py at
d0067d0: ``online_softmax_kernel`` reads the row, ``cross_entropy_kernel`` reads it again and
stores the gradient in bf16; transformer_engine/pytorch/triton/cross_entropy.py
``cross_entropy_backward``: ``element_mul_kernel`` reads and writes it, skipped only when the
incoming gradient is the scalar 1.0, which Megatron's per-token losses are not)."""


LOSS_EXTRA_BYTES = {"z_loss": (8, 20), "logits_copy": (8, 12)}
"""HBM bytes per fp32 logit, forward and backward, that an eager loss adds beside CE_BYTES
(TrainingSpec fields). z-loss: ``logits.logsumexp(-1)`` reads the logits twice (the max, then
the sum of exponentials); its backward writes ``exp(x - lse)`` times the incoming gradient
(read 4, write 4) and autograd adds it into the cross-entropy's gradient of the same logits
(read 4 + 4, write 4). The shifted copy: read 4, write 4; backward, the slice's gradient is a
zero-filled tensor the copy's gradient is written into (write 4, read 4, write 4)."""


def recompute_s(job: Job, micro_batch: int, ckpt: bool | int | str, tp: int = 1,
                ep: int = 1) -> float:
    """Seconds per step that checkpointing setting `ckpt` adds to the blocks' compute (0 for
    none): what the planner's rule does not spend to save memory (docs/planner.md). With TP,
    the recomputed forward's TP collectives (``tp_schedule.tp_recompute_s``) count as recompute too."""
    a = block_compute(job, micro_batch, ckpt, tp, ep)
    b = block_compute(job, micro_batch, False, tp, ep)
    extra = a.forward + a.backward - b.forward - b.backward
    if tp > 1:
        from amsp_planner.cost.tp_schedule import tp_recompute_s

        extra += tp_recompute_s(job, micro_batch, ckpt, tp)
    return job.seqs_per_rank(tp) // micro_batch * job.model.num_layers * max(extra, 0.0)


def unit_computes(job: Job, micro_batch: int, ckpt: bool | int | str,
                  tp: int = 1, ep: int = 1) -> dict[str, UnitCompute]:
    """Per unit class ('embedding', 'block', 'head'): one micro-batch's compute seconds."""
    return {"embedding": UnitCompute(0.0, 0.0),
            "block": block_compute(job, micro_batch, ckpt, tp, ep),
            "head": head_compute(job, micro_batch, tp)}
