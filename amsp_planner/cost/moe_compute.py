"""A mixture-of-experts block's MLP part: its matmul seconds, elementwise traffic and saved
activations, as the mean over the L blocks (the step model's block class is one; docs/moe.md).

A dense layer's MLP is the dense model's. A MoE layer of a micro-batch of T tokens, at expert
parallelism e and imbalance u (``TrainingSpec.expert_imbalance``, max/mean tokens per expert):

  router        (T x h) @ (h x E) matmul; softmax and top-k over E scores per token
  shared        the shared-expert MLP (width f_s) on all T tokens, when the model has one
  experts       a grouped matmul per expert matrix (gate, up, down; GELU: fc1, fc2) over the
                rank's E/e experts, each with r = T k e / E x u rows (the busiest rank's
                tokens: T k u routed copies), priced by cost/compute.py's roofline per expert,
                max(2 r K N / (peak x e_mm), bytes / hbm), plus one kernel overhead t0 per
                grouped kernel. Few rows per expert make the weight reads dominate: small
                experts run below large-matrix efficiency through the same roofline and
                overhead curve the dense matmuls use (no separate grouped-GEMM efficiency
                table is used; none is published for the GPUs of presets/gpus.yaml).
  elementwise   per routed copy the expert's SwiGLU (5 f_e elements; GELU 2 f_e) and the
                permutation copies (the tokens into expert order and back: read and write
                of k x h elements each way, 4 k h; 2 (c + k) h with a per-rank dispatch of c
                copies: ``moe_layer_elementwise``), the shared expert's 5 f_s, all x u for
                the routed part.

In FP8 under Megatron (cost/fp8_bytes.py ``fp8_experts``) the shared and routed experts'
matmuls run FP8 as the dense linears do: each at its roofline speed-up with Transformer
Engine's casts (cost/fp8.py ``roofline_linear_s``, ``te_linear_cast_bytes`` on the expert's
r rows, no TP gather, the weight cast once per step), a matrix whose K or N is not a multiple
of 16 in bf16; the router stays bf16. torchao engines keep the experts in bf16 (their Float8
linear conversion touches nn.Linear only).

Saved activations per token of a MoE layer (eager count of docs/memory.md, per routed copy
x u): the permuted expert input h and the expert MLP's 4 f_e (GELU 2 f_e) and output h (the
combine's weighted sum needs it), plus the router's fp32 probabilities 4E bytes and the shared
expert's 4 f_s; the fused profiles count 3 f_e (GELU 2 f_e) per copy as Korthikanti's MLP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amsp_planner.cost.compute import _Rates
    from amsp_planner.cost.job import Job


def _roofline(r: _Rates, rows: float, k: int, n: int) -> float:
    """A matmul's seconds without its kernel overhead (cost/compute.py's ``_matmul``)."""
    time = 2.0 * rows * k * n / r.flop
    if r.hbm is not None:
        time = max(time, r.act_bytes * (rows * k + k * n + rows * n) / r.hbm)
    return time


def _fp8_speedup(job: Job, recipe: str, tokens: int, rows: float, k: int, n: int,
                 name: str) -> float:
    """bf16 / FP8 roofline seconds of one expert matrix of `rows` rows, Transformer Engine's
    casts included (module docstring); 1 where K or N is not a multiple of 16."""
    from amsp_planner.cost.fp8 import RECIPE, roofline_linear_s, weight_casts_shared
    from amsp_planner.cost.fp8_casts import te_linear_cast_bytes

    if k % 16 or n % 16:
        return 1.0
    gpu, fp8, m = job.cluster.gpu, RECIPE[recipe], max(1, round(rows))
    casts = te_linear_cast_bytes(fp8, m, k, n, name, 1, 1 / weight_casts_shared(job, tokens, 1),
                                 gathered=False)
    return roofline_linear_s(gpu, m, k, n, None) / roofline_linear_s(gpu, m, k, n, fp8,
                                                                     casts=casts)


def _fp8_mlp_s(job: Job, r: _Rates, recipe: str, tokens: int, rows: float,
               f: int) -> list[float]:
    """Seconds of each matrix of an expert MLP of width `f` on `rows` rows, in FP8."""
    names = ["linear_fc1"] * (job.model.ffn_matrices - 1) + ["linear_fc2"]
    return [_roofline(r, rows, a, b) / _fp8_speedup(job, recipe, tokens, rows, a, b, x)
            for (a, b), x in zip(job.model.mlp_matrices(f), names, strict=True)]


def moe_layer_mlp_s(job: Job, r: _Rates, tokens: int, ep: int) -> float:
    """Forward matmul seconds of one MoE layer's router, shared expert and routed experts
    (the experts in FP8 where Megatron runs them so: module docstring)."""
    m = job.model
    h, E, k = m.hidden_size, m.num_experts, m.experts_per_token
    u = job.training.expert_imbalance
    recipe = None
    if job.training.precision == "fp8":
        from amsp_planner.cost.fp8_bytes import fp8_experts

        recipe = fp8_experts(job)
    t = _roofline(r, tokens, h, E) + r.t0
    fs, fe = m.shared_expert_ffn_hidden_size, m.expert_ffn_hidden_size or m.ffn_hidden_size
    rows = tokens * k * ep / E * u
    if recipe:
        if fs:
            t += sum(x + r.t0 for x in _fp8_mlp_s(job, r, recipe, tokens, tokens, fs))
        return t + sum(E // ep * x + r.t0 for x in _fp8_mlp_s(job, r, recipe, tokens, rows, fe))
    if fs:
        t += sum(_roofline(r, tokens, a, b) + r.t0 for a, b in m.mlp_matrices(fs))
    return t + sum(E // ep * _roofline(r, rows, a, b) + r.t0 for a, b in m.mlp_matrices(fe))


def moe_layer_elementwise(job: Job, fused: bool = False, ep: int = 1) -> float:
    """Forward elementwise elements per token of one MoE layer's MLP part (module docstring).
    In the fused activation profiles (Transformer Engine, compiled blocks) the SwiGLU is one
    kernel that reads the gate and up outputs and writes their product: 3 f per copy, not
    eager's 5 (Megatron-Core's weighted_bias_swiglu_impl, which NeMo AutoModel's
    GroupedExpertsDeepEP calls between its two grouped GEMMs; Inductor fuses it likewise):
    `fused`, the job's profile is one of ``activations.KORTHIKANTI``.

    The permutation copies per token: 4 k h (the k routed copies gathered into expert order and
    scattered back, read and write each way), or, with a per-rank dispatch
    (``TrainingSpec.expert_dispatch`` 'ranks', c copies a token reaches, ``dispatch_copies``),
    2 (c + k) h: the c received copies expanded into k expert rows and summed back into c
    before the combine (Megatron-Core's MoEFlexTokenDispatcher, which NeMo AutoModel's
    GroupedExpertsDeepEP uses: ``permute`` of the dispatched tokens to
    ``tokens_per_expert.sum()`` rows, ``unpermute`` back to the dispatched shape)."""
    from amsp_planner.cost.moe_schedule import dispatch_copies

    m = job.model
    fe = m.expert_ffn_hidden_size or m.ffn_hidden_size
    per = (3 if fused else 5) if m.ffn_matrices == 3 else 2
    k, h = m.experts_per_token, m.hidden_size
    perm = 4 * k * h
    if job.training.expert_dispatch == "ranks" and ep > 1:
        perm = 2 * (dispatch_copies(job, ep) + k) * h
    routed = (k * per * fe + perm) * job.training.expert_imbalance
    return routed + per * m.shared_expert_ffn_hidden_size


def mean_mlp(job: Job, r: _Rates, tokens: int, ep: int, dense_mlp_s: float,
             dense_elem: float, fused: bool = False) -> tuple[float, float]:
    """(forward matmul seconds, elementwise elements per token) of a block's MLP part, the mean
    over the L blocks; `dense_mlp_s`, `dense_elem`: a dense layer's; `fused`: a fused
    activation profile (``moe_layer_elementwise``)."""
    m = job.model
    n_moe = m.num_moe_layers
    n_dense = m.num_layers - n_moe
    mm = (n_moe * moe_layer_mlp_s(job, r, tokens, ep) + n_dense * dense_mlp_s) / m.num_layers
    el = (n_moe * moe_layer_elementwise(job, fused, ep) + n_dense * dense_elem) / m.num_layers
    return mm, el


def moe_layer_saved(job: Job, fused: bool) -> float:
    """Bytes one MoE layer's MLP part saves per token (module docstring): what ``ckpt=moe``
    drops (the MLP's input, the pre-MLP norm's output, is counted with the norm and kept)."""
    m, ab = job.model, job.training.param_bytes
    fe = m.expert_ffn_hidden_size or m.ffn_hidden_size
    gelu = m.ffn_type == "gelu"
    if fused:
        per_copy, shared = (2 if gelu else 3) * fe * ab, (2 if gelu else 3)
    else:
        per_copy = ((2 if gelu else 4) * fe + 2 * m.hidden_size) * ab
        shared = 2 if gelu else 4
    routed = m.experts_per_token * per_copy * job.training.expert_imbalance
    return routed + 4 * m.num_experts + shared * m.shared_expert_ffn_hidden_size * ab


def mean_mlp_saved(job: Job, fused: bool, dense_mlp: float) -> float:
    """Bytes a block's MLP part saves per token, the mean over the L blocks (module
    docstring); `dense_mlp`: a dense layer's."""
    m = job.model
    n_moe = m.num_moe_layers
    return (n_moe * moe_layer_saved(job, fused) + (m.num_layers - n_moe) * dense_mlp) / m.num_layers


def moe_layer_forward_s(job: Job, r: _Rates, tokens: int, ep: int, fused: bool) -> float:
    """Seconds of one MoE layer's MLP forward (matmuls and elementwise traffic, no all-to-all):
    what ``ckpt=moe`` recomputes per MoE layer and micro-batch."""
    elem = tokens * moe_layer_elementwise(job, fused, ep) * job.training.param_bytes
    return moe_layer_mlp_s(job, r, tokens, ep) + (elem / r.hbm if r.hbm else 0.0)


def dispatch_buffer_bytes(job: Job, micro_batch: int, ep: int) -> float:
    """The transient buffers of one all-to-all: the permuted send buffer and the receive
    buffer, b x s x h elements x the copies per token x imbalance each
    (``moe_schedule.a2a_bytes_per_call``; none without expert parallelism: the tokens stay on
    the rank, and the permuted copy is the saved expert input)."""
    from amsp_planner.cost.moe_schedule import a2a_bytes_per_call

    return 2.0 * a2a_bytes_per_call(job, micro_batch, ep)
