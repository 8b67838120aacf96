"""TrainingSpec: the job. Sequence length, global batch, precision and the knobs users pin."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

from amsp_planner.specs.fields import Flag, Int, Maybe, Real

DEFAULT_BATCH_TOKENS = 4 * 2**20  # "4M" tokens


class TrainingSpec(BaseModel):
    """A data-parallel training job (no tensor or pipeline parallelism)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: Int(1, 1048576) = 4096
    """Tokens per sequence."""
    global_batch_seqs: Maybe(Int(1, 2**40)) = None
    """Global batch in sequences; give this or global_batch_tokens (default 4M tokens)."""
    global_batch_tokens: Maybe(Int(1, 2**50)) = None
    """Global batch in tokens; must be a multiple of seq_len."""
    micro_batch: Maybe(Int(1, 65536)) = None
    """Sequences per GPU per micro-batch; None lets the planner choose (compare uses 1)."""
    activation_checkpointing: Flag | Int(0, 2**20) | Literal["op", "moe"] | None = None
    """true: recompute every block; false: none; K: the first K blocks; 'op': op-level
    selective checkpointing of every block; 'moe': each MoE layer's MLP part only; None lets
    the planner choose (compare uses off)."""
    flash_attention: Flag = True
    """FlashAttention (no s^2 attention-score activations)."""
    activation_profile: Literal["eager", "torchtitan", "compiled", "fused"] | None = None
    """What autograd saves (cost/activations.py, docs/memory.md): eager PyTorch with SDPA (the
    bundled runtime, FSDP2 and DeepSpeed on Hugging Face models), torchtitan's Llama code,
    torch.compile'd blocks and loss, or fused kernels (Megatron-Core with Transformer Engine,
    Liger, flash-attn's ops); None: the engine's default (``EngineProfile.activation_profile``)."""
    compile: bool = False
    """The blocks run under torch.compile (torchtitan's ``compile``, FSDP with torch.compile):
    Inductor fuses the elementwise kernels (norms with their residual adds, RoPE, SwiGLU) and
    torchao's FP8 casts, which cost/compute.py and cost/fp8.py then price as fused kernels.
    Memory follows ``activation_profile``. Left out of the dump at its default."""
    attention_kernel: Literal["flash2", "flash1", "triton", "flash3"] | None = None
    """The attention kernel (cost/attention_kernel.py): flash2 (FlashAttention-2 or SDPA's
    flash kernel, the GPU's ``attention_fraction``), flash1 (FlashAttention v1), triton
    (flash-attn's Triton FlashAttention: llm-foundry's ``attn_impl: triton``) or flash3
    (FlashAttention-3, Hopper only: transformers' ``flash_attention_3``), their rates in
    presets/attention_kernels.yaml; None: flash2. Left out of the dump at its default."""
    cross_entropy: Literal["logits", "compiled", "fused_linear"] = "logits"
    """How the LM head and the loss run (cost/activations.py, docs/memory.md): 'logits' (the
    head's logits of the whole micro-batch materialised and the loss taken over them, as the
    activation profile counts it: 4 bytes per token and vocabulary entry saved, eager's 8 more
    while the loss runs backward), 'compiled' (the same loss under torch.compile: OLMo-core's
    ``compile_loss``, torchtitan's ``compile`` since 2025-04: the logits kept at the training
    dtype and their gradient written in it, 2 + 2 bytes) or 'fused_linear' (Liger's fused
    linear cross-entropy, ``liger_kernel.ops.fused_linear_cross_entropy``: the logits computed
    chunk by chunk in the forward, each chunk's gradients of the head's input and weight taken
    there; saved: the input's gradient and the weight's). Left out of the dump at its
    default."""
    z_loss: bool = False
    """PaLM's auxiliary z-loss taken eagerly over the fp32 logits beside the cross-entropy
    (OLMo-core's ``z_loss_multiplier``: ``logits.logsumexp(-1).pow(2)``,
    nn/functional/cross_entropy_loss.py at 984eb263f): priced as its HBM traffic
    (cost/compute.py ``LOSS_EXTRA_BYTES``) with the eager loss ('logits'); a compiled or
    fused loss computes it inside its own kernels. Left out of the dump at its default."""
    logits_copy: bool = False
    """The loss takes a contiguous copy of the shifted fp32 logits
    (``logits[..., :-1, :].contiguous()``: OLMo-core's ``Trainer.get_losses`` at 984eb263f):
    priced as its traffic with the eager loss. Left out of the dump at its default."""
    model_load: Literal["sharded", "whole"] = "sharded"
    """How the parameters reach the GPUs where the plan shards them (s_P > 1): 'sharded'
    (created sharded: deepspeed.zero.Init, FSDP's meta-device or per-module init, what the
    exports set up), or 'whole' (built unsharded on the host and moved whole to each GPU
    before the engine shards them: DeepSpeed ZeRO-3 on a model not created under zero.Init,
    runtime/engine.py ``_configure_distributed_model``: ``module.to(device)`` when no
    parameter has a ``ds_id``). 'whole' makes the reserved peak at least the whole model in
    its dtype (``MemoryBreakdown.load_peak``). Left out of the dump at its default."""
    precision: Literal["bf16", "fp32", "fp8"] = "bf16"
    """bf16: bf16 params/grads, fp32 master + Adam. fp32: everything fp32 (parity tests).
    fp8: as bf16, with the blocks' linears in FP8 (docs/fp8.md); never chosen by the planner."""
    fp8_recipe: Literal["tensorwise", "rowwise", "blockwise", "mxfp8", "delayed"] | None = None
    """FP8 scaling recipe (precision fp8 only); None: the engine's default (torchtitan: rowwise,
    Megatron: delayed; ``cost.fp8.default_recipe``)."""
    fp8_all_gather: Literal["auto", "on", "off"] = "auto"
    """FSDP/ZeRO-3 weight all-gather in FP8 (precision fp8 only): on, off, or auto (the
    planner's choice where the engine and recipe allow it)."""
    grad_accum_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of gradient shards and the wire for gradient reductions (bf16, the papers' 2 B)."""
    expert_imbalance: Real(1.0, 1e6) = 1.0
    """Mixture of experts: the most tokens an expert gets over the mean (max/mean tokens per
    expert); 1.0 = balanced routing, as published benchmarks force it. Scales the expert
    matmuls, the token all-to-alls and their buffers (docs/moe.md). Left out of the dump at
    its default, so dense plan files are what they were."""

    expert_dispatch: Literal["copies", "ranks"] = "copies"
    """Mixture of experts: what the token all-to-all sends for a token routed to k experts:
    one copy per routed expert ('copies': an all_to_all_single of the permuted tokens,
    torchtitan's default expert parallelism, Megatron-Core's alltoall dispatcher), or one copy
    per destination rank ('ranks': DeepEP's dispatch and combine, Megatron-Core's flex
    dispatcher with moe_enable_deepep, NeMo AutoModel's GroupedExpertsDeepEP). docs/moe.md."""
    expert_routing: Literal["uniform", "round_robin"] = "uniform"
    """Mixture of experts: how a token's k experts fall, for the ranks a 'ranks' dispatch
    reaches: 'uniform' (k distinct experts drawn uniformly: a balanced real router, or
    Megatron-Core's --moe-router-force-load-balancing, which routes on random logits) or
    'round_robin' (NeMo AutoModel's FakeBalancedGate: slot j of token t goes to expert
    (t k + j) mod E). docs/moe.md."""
    tp_overlap: Flag = False
    """Tensor parallelism: the blocks' TP all-gathers and reduce-scatters pipelined against
    their matmuls (torchtitan's compile.enable_async_tensor_parallel, Megatron's
    --tp-comm-overlap; cost/tp_overlap.py), or exposed (false). Only the user or a row sets it:
    the planner never turns it on. Left out of the dump at its default."""
    dp_overlap: Flag = False
    """The engine's opt-in overlaps of the data-parallel collectives on (its
    ``Execution.overlap_flags``: Megatron's --overlap-grad-reduce --overlap-param-gather): the
    gradient reduction during the last backward, the updated parameters' all-gather during the
    next forward. False: the engine's defaults. Left out of the dump at its default."""
    master_weights: bool = True
    """False: the model is held in its compute dtype with no fp32 master copy and the optimizer
    keeps Adam's moments in that dtype (NeMo AutoModel's MoE recipes cast the model to its
    config's torch_dtype, bf16, and run torch.optim.Adam on it); FSDP2 casts each reduced
    gradient back to the sharded parameter's dtype, so gradient shards are in that dtype too,
    while the reduction's wire stays grad_accum_dtype. cost/memory.py."""
    sequence_parallel: bool = True
    """False: tensor parallelism without sequence parallelism (Megatron-LM before Korthikanti
    et al. 2022, arXiv 2205.05198; Megatron-DeepSpeed's BLOOM): every TP rank runs the norms
    and residual adds over the whole sequence and holds their activations whole (cost/compute.py,
    cost/activations.py). The TP collectives are priced as with it: the all-reduce that
    replaces the all-gather + reduce-scatter pair moves the same bytes."""

    optimizer_offload: Literal["none", "cpu"] = "none"
    """'cpu': the optimizer states and the fp32 master live in host memory and the AdamW step
    runs on the CPU (DeepSpeed's zero_optimization.offload_optimizer {device: cpu}, ZeRO-Offload;
    cost/offload.py). Only a user sets it (--offload-optimizer): the planner never does."""

    # FP8 fields (and the MoE fields, the attention kernel) at their defaults stay out of the
    # dump: plan files and hashes unchanged.
    _OMIT_DEFAULT = {"fp8_recipe": None, "fp8_all_gather": "auto", "expert_imbalance": 1.0,
                     "attention_kernel": None, "expert_dispatch": "copies",
                     "expert_routing": "uniform", "master_weights": True,
                     "sequence_parallel": True, "optimizer_offload": "none",
                     "tp_overlap": False, "dp_overlap": False, "compile": False,
                     "cross_entropy": "logits", "model_load": "sharded", "z_loss": False,
                     "logits_copy": False}
    _FP8_FIELDS = ("fp8_recipe", "fp8_all_gather")

    @property
    def loss_extras(self) -> tuple[str, ...]:
        """The eager loss's extra passes this job takes ('z_loss', 'logits_copy'), in
        cost/compute.py ``LOSS_EXTRA_BYTES`` order."""
        return tuple(k for k in ("z_loss", "logits_copy") if getattr(self, k))

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        for key, default in self._OMIT_DEFAULT.items():
            if key in out and out[key] == default:
                del out[key]
        return out

    @model_validator(mode="after")
    def _check_fp8(self) -> TrainingSpec:
        if self.precision != "fp8":
            for key in self._FP8_FIELDS:
                default = self._OMIT_DEFAULT[key]
                if getattr(self, key) != default:
                    raise ValueError(f"{key} is set but precision is {self.precision}: give "
                                     "precision fp8, or drop it")
        return self

    @model_validator(mode="after")
    def _check_batch(self) -> TrainingSpec:
        if self.global_batch_seqs is not None and self.global_batch_tokens is not None:
            raise ValueError(
                "give global_batch_seqs or global_batch_tokens, not both: drop one of them"
            )
        if self.global_batch_tokens is not None and self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"global_batch_tokens {self.global_batch_tokens} is not a multiple of seq_len "
                f"{self.seq_len}: use a multiple such as "
                f"{max(1, self.global_batch_tokens // self.seq_len) * self.seq_len}"
            )
        if self.global_batch_seqs is None and self.global_batch_tokens is None:
            if DEFAULT_BATCH_TOKENS % self.seq_len:
                raise ValueError(
                    f"the default global batch (4M tokens) is not a multiple of seq_len "
                    f"{self.seq_len}: give global_batch_seqs"
                )
        return self

    @property
    def batch_seqs(self) -> int:
        if self.global_batch_seqs is not None:
            return self.global_batch_seqs
        tokens = self.global_batch_tokens or DEFAULT_BATCH_TOKENS
        return tokens // self.seq_len

    @property
    def batch_tokens(self) -> int:
        return self.batch_seqs * self.seq_len

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        return 4 if self.precision == "fp32" or self.grad_accum_dtype == "fp32" else 2

    @property
    def dtype_name(self) -> str:
        return "fp32" if self.precision == "fp32" else "bf16"

    @property
    def grad_dtype_name(self) -> str:
        return "fp32" if self.grad_bytes == 4 else "bf16"
