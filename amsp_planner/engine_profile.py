"""EngineProfile: what one training engine executes exactly, and how it behaves there.

The profiles themselves, with their sources, are in ``engines.py``; this module holds the
record and the questions asked of it (the shapes it runs, its gradient dtype, its notes).
Nothing here imports torch, DeepSpeed or the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.engine_execution import Execution
from amsp_planner.strategy import factor_options


@dataclass(frozen=True)
class EngineProfile:
    name: str
    title: str
    """The engine and the version the profile was read from."""
    shapes: str
    """Which (s_P, s_G, s_OS) it expresses: 'any', 'stages', 'tied' or 'zero1' (module table)."""
    hpz: bool
    """hpZ (a secondary parameter shard inside the node for the backward all-gather)."""
    qwz: bool
    """Quantized (INT8) parameter all-gathers."""
    qgz: bool
    """Quantized (INT4 all-to-all) gradient reduction."""
    qgz_needs_p: bool
    """qgZ exists only where parameters are sharded too (DeepSpeed: stage 3 only)."""
    reduce_dtype: str | None
    """Gradient-reduction dtype the engine forces: 'fp32', 'param' (the parameters' dtype), or
    None when it follows ``--grad-accum-dtype``."""
    gathers: str
    """Gather granularity and buffers, as the cost model prices them."""
    checkpointing: str
    """The activation-checkpointing options it has, and how the export sets them."""
    sources: tuple[str, ...]
    """Where each behaviour above is written down (docs URL or the engine's code path)."""
    ckpt_kinds: frozenset = frozenset({"none", "full", "blocks", "op"})
    """The checkpointing settings it runs: 'none', 'full', 'blocks' (the first K of L), 'op'
    (op-level selective, matmul outputs kept) and 'moe' (the MoE layers' MLP parts)."""
    tp: bool = False
    """Tensor (+ sequence) parallelism inside the node (t > 1)."""
    tp_note: str = ""
    """Why it does not run t > 1 (when ``tp`` is off), or how it does."""
    execution: Execution = Execution(sources=(
        ("gather_grouping", "amsp_planner/runtime/engine.py: one flat buffer per unit"),))
    """How it groups and overlaps its collectives (``Execution``)."""
    activation_profile: str = "eager"
    """What autograd saves in the model code this engine runs by default (cost/activations.py,
    docs/memory.md); a training spec's own ``activation_profile`` overrides it."""
    master_params: bool = False
    """Its sharded parameters are the fp32 master weights, cast to the compute dtype only in
    the all-gather (FSDP's mixed precision): 4 + 8 bytes per parameter for them and Adam's
    moments, no second copy (cost/memory.py)."""
    optimizer_offload: bool = False
    """It runs the optimizer on the host with its states in host memory (``TrainingSpec.
    optimizer_offload`` 'cpu', cost/offload.py): DeepSpeed's offload_optimizer."""
    op_policy: str = "matmuls"
    """Its op-level selective checkpointing: 'matmuls' keeps every matmul's output,
    'alternate' every second one (torchtitan's policy; cost/activations.py)."""
    fused_elementwise: bool = False
    """Its model code runs the blocks' elementwise kernels fused (norm with residual add, RoPE,
    the activation, each one kernel), priced as cost/compute.py prices a compiled block
    (``training.compile``) without torch.compile: NeMo 24.07's Transformer Engine modules with
    its fusion switches (engine_versions.py)."""
    ckpt_early_stop: bool = False
    """Its full (or first-K-blocks) checkpointing runs torch's non-reentrant checkpoint, which
    since torch 2.1 stops the recomputation as soon as every tensor the block saved is back
    (``torch.utils.checkpoint`` early stop, on by default: pytorch/pytorch PR 96866): the
    block's last linear (the MLP's down projection, whose input is the last tensor saved) and
    what follows it are not rerun (cost/compute.py ``block_compute``). Reentrant checkpointing
    (Megatron's, DeepSpeed's, Hugging Face's default) reruns the whole block."""
    te_weight_cache: bool = False
    """With Transformer Engine's FP8 layers, each weight is cast once per step and the copy
    reused by the step's other micro-batches: the engine marks the first micro-batch
    (``is_first_microbatch``; cost/fp8.py ``weight_casts_shared``)."""
    te_param_gather: bool = False
    """With Transformer Engine's FP8 layers, the data-parallel parameter gathers can move FP8
    under every recipe (Megatron's ``--fp8-param-gather``; cost/fp8.py
    ``fp8_all_gather_supported``)."""
    fused_cross_entropy: str = ""
    """Its loss kernel, where it runs a fused one on the full logits: '' none (the eager fp32
    cross-entropy, cost/compute.py), 'te' Transformer Engine's Triton parallel cross-entropy
    (Megatron-Core's ``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl 'te'``):
    the forward reads the bf16 logits twice (online softmax, then the gradient) and writes the
    gradient in their place, the backward scales it (a read and a write): 6 + 4 bytes per
    logit against the eager 12 + 18."""
    expert_rule: str = "any"
    """Mixture of experts: the expert settings (e, placement, expert triple) it runs with a
    dense triple, a rule of engine_experts.py ('any', 'tied', 'stages', 'titan', 'os',
    'none'; the sources are there); the search keeps to it (``SearchSpace.expert_pairs``)."""

    @property
    def engine(self) -> str:
        """The engine, without the release a versioned profile names (``deepspeed@0.3.14``)."""
        return self.name.split("@")[0]

    # ----- the search space ------------------------------------------------------------------
    def runs_ckpt(self, value, num_layers: int) -> bool:
        """Whether it runs checkpointing setting `value` (True, False, K blocks or 'op')."""
        from amsp_planner.strategy import checkpointed_blocks

        k, op = checkpointed_blocks(value, num_layers)
        kind = "op" if op else "none" if k == 0 else "full" if k >= num_layers else "blocks"
        kind = "moe" if value == "moe" else kind
        return kind in self.ckpt_kinds

    @property
    def ckpt_text(self) -> str:
        """The checkpointing settings it runs, as ``--activation-checkpointing`` values."""
        words = {"none": "off", "full": "on", "blocks": "a block count K", "op": "op",
                 "moe": "moe"}
        return ", ".join(w for k, w in words.items() if k in self.ckpt_kinds)

    def check_ckpt(self, value, shown: str, num_layers: int = 1 << 30) -> None:
        """Refuse ``--activation-checkpointing`` `shown` (parsed: `value`) where this engine
        does not run it: the search would choose a setting the engine cannot run."""
        if value is not None and not self.runs_ckpt(value, num_layers):
            from amsp_planner.errors import AmspUserError

            raise AmspUserError(f"--activation-checkpointing {shown}: {self.title} does not run "
                                f"it (it runs {self.ckpt_text}): give one of those, or plan for "
                                "--engine amsp")

    def stage0_allowed(self, training) -> bool:
        """DeepSpeed rejects stage 0 with bf16 parameters and fp32 gradient accumulation, and
        offloads the optimizer only through a ZeRO optimizer (engine.py
        _configure_zero_optimizer: stage 0 would hand DeepSpeedCPUAdam the GPU parameters)."""
        return not (self.engine == "deepspeed" and (
            training.optimizer_offload == "cpu"
            or training.precision == "bf16" and training.grad_accum_dtype == "fp32"))

    @property
    def shapes_text(self) -> str:
        """The (s_P, s_G, s_OS) shapes ``triples`` lists, in words."""
        return {"any": "any nested (P, G, OS)", "stages": "ZeRO's stages (P, G, OS each 1 or N)",
                "tied": "P = G = OS", "os": "OS only (P = G = 1)", "zero3": "P = G = OS = N",
                "zero1": "OS only, or P = G = OS"}[self.shapes]

    def triples(self, num_gpus: int, gpus_per_node: int, training
                ) -> tuple[tuple[int, int, int], ...] | None:
        """The (s_P, s_G, s_OS) this engine runs for N GPUs; None: every nested triple."""
        n, fs = num_gpus, factor_options(num_gpus, gpus_per_node)
        if self.shapes == "any":
            return None
        if self.shapes == "stages":
            stages = [(1, 1, 1), (1, 1, n), (1, n, n), (n, n, n)]
            if n > 1 and not self.stage0_allowed(training):
                stages = stages[1:]
            return tuple(dict.fromkeys(stages))
        if self.shapes == "tied":
            return tuple((s, s, s) for s in fs)
        if self.shapes == "os":
            return tuple((1, 1, s) for s in fs)
        if self.shapes == "zero3":
            return ((n, n, n),)
        assert self.shapes == "zero1", self.shapes
        return tuple(dict.fromkeys(t for s in fs for t in ((1, 1, s), (s, s, s))))

    # ----- behaviour -------------------------------------------------------------------------
    def training_for(self, training):
        """The TrainingSpec as this engine runs it (its gradient-reduction dtype, and its
        activation profile where the spec leaves it open)."""
        if training.activation_profile is None:
            training = training.model_copy(
                update={"activation_profile": self.activation_profile})
        want = self.grad_dtype(training)
        if want is None or want == training.grad_accum_dtype:
            return training
        return training.model_copy(update={"grad_accum_dtype": want})

    def grad_dtype(self, training) -> str | None:
        """The grad_accum_dtype this engine forces on `training`, None when it follows it."""
        if self.reduce_dtype == "fp32":
            return "fp32"
        if self.reduce_dtype == "param":
            return training.dtype_name
        return None

    def training_note(self, training) -> str | None:
        """One line when the engine changes the job's gradient dtype, else None."""
        want = self.grad_dtype(training)
        if want is None or want == training.grad_accum_dtype:
            return None
        return (f"{self.title} reduces gradients {self.reduce_source}: priced with "
                f"--grad-accum-dtype {want}, not {training.grad_accum_dtype}")

    @property
    def reduce_source(self) -> str:
        """How it picks the gradient-reduction dtype, in words."""
        return {"fp32": "in float32 only", "param": "in the parameters' dtype"}.get(
            self.reduce_dtype or "", "in the dtype configured")
