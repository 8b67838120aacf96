"""What the bundled runtime can train, checked from the plan alone (no torch, no host).

- the model family: LLaMA-style decoders (RMSNorm, RoPE, SwiGLU, no biases, head_dim =
  hidden_size / num_heads, no qk or post norms); anything else is refused in one line.
- a mixture of experts (runtime/moe.py): each expert takes S k / E tokens of every sequence,
  so E must divide S k (``check_moe``, run with ``check_tp``).
- tensor parallelism (runtime/tp.py): tp = t > 1 splits the vocabulary, the MLP width and
  the sequence evenly over the t ranks, so t must divide each.

The lowest of the runtime's checks: runtime/model.py and runtime/preflight.py both use it,
and it imports nothing of the runtime.
"""

from __future__ import annotations

from amsp_planner.errors import AmspUserError


def check_supported(model) -> None:
    """The runtime trains LLaMA-style models; anything else is refused with one line."""
    bad = []
    if model.norm_type != "rmsnorm":
        bad.append("norm_type: rmsnorm")
    if model.position_embedding != "rope":
        bad.append("position_embedding: rope")
    if model.ffn_type != "swiglu":
        bad.append("ffn_type: swiglu")
    if model.attention_bias != "none" or model.mlp_bias:
        bad.append("attention_bias: none, mlp_bias: false")
    if model.q_dim != model.hidden_size or model.qk_norm != "none" or model.post_norms:
        bad.append("head_dim: hidden_size/num_heads, qk_norm: none, post_norms: false")
    # full grouped-query attention only: no latent attention, sinks or sliding windows
    if model.is_mla or model.attention_sinks or model.sliding_layers:
        bad.append("no kv_lora_rank, attention_sinks or sliding_layers")
    # a softmax top-k router without bias, an ungated shared expert, no MTP modules
    if (model.router_bias or model.shared_expert_gate or model.mtp_layers
            or model.routing != "softmax_topk"):
        bad.append("router_bias: false, shared_expert_gate: false, mtp_layers: 0, "
                   "routing: softmax_topk")
    if bad:
        raise AmspUserError(
            f"model {model.name}: the bundled runtime trains LLaMA-style decoders only: "
            f"set {', '.join(bad)} (or export the plan to another framework)"
        )


def check_tp(strategy, job=None) -> None:
    """What the bundled runtime runs with tp = t > 1 (runtime/tp.py): every ZeRO factor
    combination, ZeRO++ included, and every checkpointing setting, on a model whose
    vocabulary, MLP width and sequence length t divides; the rest is refused in one line,
    naming it."""
    if strategy.pp > 1:  # one line, before anything else: the runtime has no stages
        raise AmspUserError(
            f"plan has pp={strategy.pp}: the bundled runtime does not run pipeline parallelism: "
            "re-plan with --pp 1, or export the plan (amsp export --to megatron)")
    if job is not None:
        check_moe(job)
        if job.training.optimizer_offload != "none":
            raise AmspUserError("optimizer_offload cpu: the bundled runtime keeps the optimizer "
                                "on the GPU: drop --offload-optimizer, or export the plan to "
                                "DeepSpeed (amsp export PLAN --to deepspeed)")
        if job.training.cross_entropy != "logits":
            raise AmspUserError(f"cross_entropy {job.training.cross_entropy}: the bundled "
                                "runtime takes an eager loss over the whole micro-batch's "
                                "logits, so the plan's memory is not its own: re-plan with "
                                "--cross-entropy logits, or export the plan to the framework "
                                "that runs that loss")
        if extra := job.training.loss_extras:
            raise AmspUserError(f"{', '.join(extra)}: the bundled runtime takes the "
                                "cross-entropy alone: re-plan without them (--z-loss), or "
                                "export the plan to the framework that runs that loss")
    if getattr(strategy, "cp", 1) > 1:
        raise AmspUserError(
            f"plan has cp={strategy.cp}: the bundled runtime does not run context parallelism "
            "(it is priced for torchtitan, FSDP2 and DeepSpeed-Ulysses): re-plan without cp=")
    t = strategy.tp
    if t == 1 or job is None:
        return
    m = job.model
    bad = [f"{name} {v}" for name, v in (("vocab_size", m.vocab_size),
                                         ("ffn_hidden_size", m.ffn_hidden_size),
                                         ("seq_len", job.training.seq_len)) if v % t]
    if bad:
        raise AmspUserError(
            f"plan has tp={t} but {', '.join(bad)} is not a multiple of {t}: the bundled "
            "runtime splits the vocabulary, the MLP and the sequence evenly over the TP ranks: "
            "pad it to a multiple, or re-plan with another --tp")


def check_moe(job) -> int:
    """A MoE model gives each expert c S k / E slots of every sequence (c the expert
    imbalance, the capacity factor; fixed all-to-all sizes, runtime/moe.py): they must be a
    whole number, refused in one line otherwise; returns it (0 for a dense model)."""
    m, seq = job.model, job.training.seq_len
    if not m.is_moe:
        return 0
    E, k, c = m.num_experts, m.experts_per_token, job.training.expert_imbalance
    if (seq * k) % E:
        raise AmspUserError(
            f"seq_len {seq} x experts_per_token {k} is not a multiple of num_experts {E}: "
            "the bundled runtime routes S k / E tokens of every sequence to each expert (fixed "
            "all-to-all sizes): pick a sequence length that makes it whole")
    slots = seq * k // E * c
    if abs(slots - round(slots)) > 1e-9:
        raise AmspUserError(
            f"expert_imbalance {c:g} x {seq * k // E} tokens per expert per sequence is not a "
            "whole number of slots: the bundled runtime gives each expert that many (its "
            "capacity factor): pick an imbalance that makes it whole")
    return round(slots)
