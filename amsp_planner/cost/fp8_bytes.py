"""FP8 bytes beside the matmuls: the FP8 weight all-gather and the FP8 copies kept for backward
(docs/fp8.md; the recipes and rules are cost/fp8.py's). No torch."""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.cost.fp8 import (
    GATHER_ONLY,
    RECIPE,
    check_training,
    family_of,
    fp8_all_gather_supported,
    fp8_matmuls,
    mlp_linear_names,
    recipe_for,
)
from amsp_planner.cost.fp8_casts import TE_FP8_GATHERS, scale_count


# ----- FP8 weight all-gather -----------------------------------------------------------------
@dataclass(frozen=True)
class Fp8Gather:
    """What one FSDP/ZeRO-3 all-gather of a unit moves, per element of the unsharded unit."""

    fp8: bool
    gather_bytes: float
    """Bytes of the gathered (unsharded) unit: 1 per FP8 element (+ its gathered scales),
    2 per bf16 element."""
    amax_allreduce_bytes: int
    """fp32 amax bytes all-reduced (MAX) so every rank casts with the same scale."""
    amax_allreduces: int
    """How many all-reduces that takes per gather of the unit (0 when precomputed)."""


def fp8_all_gather(recipe: str, engine: str, fp8_params: int, other_params: int,
                   fp8_linears: int, precompute: bool = True) -> Fp8Gather:
    """Bytes of one all-gather of a unit holding `fp8_params` elements of FP8 linears'
    weights (`fp8_linears` tensors) and `other_params` elements of everything else.

    torchao tensorwise (torchao/float8/fsdp_utils.py, WeightWithDynamicFloat8CastTensor):
    fsdp_pre_all_gather returns the FP8 data as the all-gather input and the scale as
    metadata, so the gather moves 1 byte per element and no scale; the scale comes from the
    amax all-reduce: with precompute_float8_dynamic_scale_for_fsdp one all-reduce of all
    FP8 weights' amaxes per step (after the optimizer, not per gather: counted 0 here, its
    bytes 4 x fp8_linears), else one 4-byte all-reduce per weight per gather
    (hp_tensor_to_float8_dynamic(reduce_amax=True)). Megatron --fp8-param-gather: 1 byte per
    element plus the recipe's weight scales (blockwise: one fp32 per 128 x 128 block,
    approximated as 4/16384 B per element; mxfp8: one E8M0 byte per 32); the tensorwise
    scale by an amax all-reduce after the optimizer step. Not verified against Megatron's
    code at the pinned commit (docs/fp8.md)."""
    recipe_for(recipe, engine)
    if not fp8_all_gather_supported(recipe, engine):
        return Fp8Gather(False, 2.0 * (fp8_params + other_params), 0, 0)
    r = RECIPE[recipe]
    per = 1.0
    if r.block and family_of(engine) == "te":
        per += r.scale_bytes / ((r.weight_block or r.block) ** (2 if r.weight_block else 1))
    amax = 4 * fp8_linears if r.amax_pass else 0
    count = 0 if precompute or not r.amax_pass else fp8_linears
    return Fp8Gather(True, per * fp8_params + 2.0 * other_params, amax, count)


def unit_gathers(job, units: tuple[int, ...], tp: int = 1) -> tuple[Fp8Gather, ...]:
    """The FP8 all-gather of one unit of each class (``units``: the padded elements of the
    embedding, a block, the head, one TP rank's shards), with the job's recipe.

    torchao engines: a block's FP8 linears' weights in FP8 (one amax each), everything else
    (norms, biases, the padding; the embedding and head units whole) in bf16. The bundled
    runtime (``GATHER_ONLY``, runtime/fp8.py): every element of every unit in FP8 under one
    tensorwise scale per unit, its amax all-reduced once per step."""
    recipe = check_training(job.training, job.engine, job.cluster.gpu.arch)
    if job.engine in GATHER_ONLY:
        return tuple(fp8_all_gather(recipe, job.engine, u, 0, 1) for u in units)
    lin = [x for x in fp8_matmuls(job.model, recipe, job.engine, tp).block if x.fp8]
    w = min(sum(x.k * x.n for x in lin), units[1])
    return (fp8_all_gather(recipe, job.engine, 0, units[0], 0),
            fp8_all_gather(recipe, job.engine, w, units[1] - w, len(lin)),
            fp8_all_gather(recipe, job.engine, 0, units[-1], 0))


# ----- memory --------------------------------------------------------------------------------
def saved_input_bytes(recipe: str, engine: str, m: int, k: int) -> float:
    """Bytes one FP8 linear keeps of its (m x k) input for the weight gradient.

    torchao: the bf16 input (matmul_with_hp_or_float8_args.forward saves input_hp and
    weight_hp_t and re-casts in backward): 2 B per element, as in bf16. te: the quantized
    input in its column-wise layout (linear.py: inputmat.update_usage(rowwise_usage=False,
    columnwise_usage=True) before saving): 1 B per element plus its scales."""
    if family_of(engine) == "torchao":
        return 2.0 * m * k
    r = RECIPE[recipe]
    return float(m * k + scale_count(r, k, m, False) * r.scale_bytes)


def weight_copy_bytes(recipe: str, engine: str, fp8_params: int) -> float:
    """Bytes of FP8 weight copies a rank keeps beside its bf16 weights (unsharded layers).

    torchao: none (casts per use; with the FP8 all-gather the unsharded weight is the FP8
    one: 1 byte in place of 2, see Fp8Gather). te: the cached weight workspace, row-wise and
    column-wise FP8 (quantize_weight(cache=...) with is_first_microbatch): 2 bytes per element
    plus scales, for the layers currently unsharded."""
    if family_of(engine) == "torchao":
        return 0.0
    r = RECIPE[recipe]
    per = 2.0
    if r.block:
        per += 2 * r.scale_bytes / ((r.weight_block or r.block) ** (2 if r.weight_block else 1))
    return per * fp8_params


def te_recipe(job) -> str | None:
    """The job's FP8 recipe where Transformer Engine runs its linears (precision fp8 on a
    'te' engine), else None."""
    if job.training.precision != "fp8" or job.engine in GATHER_ONLY \
            or family_of(job.engine) != "te":
        return None
    return check_training(job.training, job.engine, job.cluster.gpu.arch)


def fp8_experts(job) -> str | None:
    """The recipe the experts' matmuls run in FP8 (cost/moe_compute.py): Megatron-Core's in an
    FP8 job (its TEGroupedMLP runs Transformer Engine's GroupedLinear and its shared experts
    TE linears, both FP8 under --fp8: megatron/core/transformer/moe/experts.py,
    shared_experts.py at d98e8a6); None otherwise (torchao's Float8 conversion swaps nn.Linear
    only: torchtitan's grouped experts need its separate Float8GroupedExpertsConverter; FSDP1
    with TE layers has no TE experts)."""
    if job.training.precision != "fp8":
        return None
    from amsp_planner.engines import runs_as

    return te_recipe(job) if runs_as(job.engine) == "megatron" else None


def te_weight_cache_bytes(job, s) -> float:
    """Bytes of Transformer Engine's cached FP8 weights on a rank (``weight_copy_bytes`` of
    the FP8 linears of the rank's blocks, its 1/tp shard of each); 0 for torchao engines and
    bf16 jobs. TE keeps the workspace on each module for the whole step (the step's first
    micro-batch writes it, the others reuse it: cost/fp8.py ``weight_casts_shared``). With FP8
    primary weights (``--fp8-all-gather on``: Megatron's --fp8-param-gather) the parameter is
    the FP8 row-wise copy and its transpose the column-wise one, 1 + 1 bytes per element in
    place of the 2 of the bf16 parameter the memory model counts: nothing is added; that needs
    the distributed optimizer (s_OS > 1: Megatron refuses --fp8-param-gather without it). A
    mixture of experts caches its attention's FP8 weights in every layer, the dense MLP's in
    its dense layers, and in each MoE layer its shared expert's and its E/ep routed experts'
    (their grouped linears run FP8 under Megatron: ``fp8_experts``), the
    matrices whose K and N are multiples of 16."""
    recipe = te_recipe(job)
    if recipe is None or job.training.fp8_all_gather == "on" and s.s_os > 1:
        return 0.0
    m = job.model
    lin = [x for x in fp8_matmuls(m, recipe, job.engine, s.tp).block if x.fp8]
    mlp = set(mlp_linear_names(m, job.engine))
    per = {k: sum(x.k * x.n for x in lin if (x.name in mlp) == k) for k in (False, True)}
    mlp_layers = m.num_layers - m.num_moe_layers if m.is_moe else m.num_layers
    experts = 0
    if m.is_moe and fp8_experts(job):
        def fp8_params(f: int) -> int:
            return sum(a * b for a, b in m.mlp_matrices(f) if a % 16 == 0 and b % 16 == 0)

        shared = m.shared_expert_ffn_hidden_size
        experts = m.num_moe_layers * (
            m.num_experts // s.ep * fp8_params(m.expert_ffn_hidden_size or m.ffn_hidden_size)
            + (fp8_params(shared) if shared else 0))
    return weight_copy_bytes(recipe, job.engine,
                             per[False] * m.num_layers + per[True] * mlp_layers + experts)


def te_saved_input_saving(job) -> float:
    """Bytes per token one block saves less under Transformer Engine's FP8 (fused and compiled
    activation profiles, one TP rank's whole before the 1/tp split): the inputs of its FP8
    linears kept in FP8 (``saved_input_bytes``) instead of the training dtype: linear_qkv's
    and linear_fc1's (the LayerNorm output, ``ln_out`` written in FP8), linear_proj's and
    linear_fc2's. A mixture of experts' MLP part keeps its saved tensors at the training dtype
    here: the FP8 inputs Megatron's grouped expert linears save are not counted (a small
    overestimate of the activations, docs/fp8.md)."""
    recipe = te_recipe(job)
    if recipe is None:
        return 0  # an int: the plans' activation bytes keep their type
    t = job.training
    names = {"linear_qkv", "linear_proj"}
    if not job.model.is_moe:
        names |= {"linear_fc1", "linear_fc2"}
    seq = t.seq_len
    return sum(t.param_bytes * x.k - saved_input_bytes(recipe, job.engine, seq, x.k) / seq
               for x in fp8_matmuls(job.model, recipe, job.engine).block
               if x.fp8 and x.name in names)


# ----- tensor-parallel collectives -----------------------------------------------------------
@dataclass(frozen=True)
class Fp8TpWire:
    """Bytes per element on the wire of the sequence-parallel collectives around the FP8
    linears, and the 4-byte amax all-reduces over the TP group that tensorwise casts of a
    sharded activation need (one per FP8 all-gather)."""

    all_gather: int
    reduce_scatter: int
    amax_allreduces_per_all_gather: int


def fp8_tp_wire(recipe: str, engine: str) -> Fp8TpWire:
    """torchao tensorwise (torchao/float8/float8_tensor_parallel.py at 36027d8; torchtitan
    applies it when the recipe is tensorwise, ``enable_float8_tensorwise_tp``):
    Float8ColwiseParallel / PrepareFloat8ModuleInput cast the sequence-sharded input to FP8
    before the redistribute, so the forward all-gathers before wq/wk/wv and w1/w3 move 1 byte
    per element; Float8RowwiseParallel's NoopFwToFloat8BwDynamic casts the output gradient to
    FP8 before the backward of the output redistribute, so the backward all-gathers before wo
    and w2 move 1 byte too; the reduce-scatters (forward outputs of wo/w2, backward input
    gradients of the column-parallel linears) carry bf16 GEMM outputs. The cast of a sharded
    tensor takes its global amax: one all-reduce of 4 bytes over the TP group per all-gather.

    Transformer Engine, delayed scaling (NVIDIA/TransformerEngine
    transformer_engine/pytorch/module/layernorm_linear.py and layernorm_mlp.py at v1.7, v1.8
    3ec998e and v1.9 e79d915: ``ln_out_dtype = torch.uint8 if (fp8 and not
    return_layernorm_output)``, the norm writes FP8 and ``gather_along_first_dim(ln_out,
    tp_group)`` gathers it; module/base.py ``grad_output_preprocess``, "FP8 case with gather":
    ``cast_to_fp8`` then ``gather_along_first_dim(grad_output_c, ...)``; at d0067d0 the same
    through ``gather_along_first_dim(ln_out, tp_group, quantizer=quantizer)``): the forward
    all-gathers before linear_qkv and linear_fc1 and the backward all-gathers of the output
    gradient before linear_proj and linear_fc2 move 1 byte per element; the scale comes from
    the amax history, so no all-reduce per gather; the reduce-scatters carry bf16 GEMM outputs.
    Transformer Engine, current scaling (tensorwise; v2.9 layernorm_linear.py: the norm output
    quantized on the shard and ``gather_along_first_dim(ln_out, tp_group,
    quantizer=quantizer)``; base.py ``grad_output_preprocess`` likewise for the output
    gradient; ``_customize_quantizers_float8_current_scaling`` gives the column-parallel input
    quantizer and the row-parallel output-gradient quantizer ``with_amax_reduction`` over the
    TP group): the same FP8 all-gathers, each with its amax all-reduced over the TP group.
    Every other recipe and engine here: bf16 both ways (TE's blockwise and MXFP8 gathers are
    not modelled: docs/fp8.md)."""
    recipe_for(recipe, engine)
    if family_of(engine) == "te" and recipe in TE_FP8_GATHERS:  # delayed: the amax history
        return Fp8TpWire(1, 2, 1 if recipe == "tensorwise" else 0)
    if family_of(engine) == "torchao" and recipe == "tensorwise" and engine not in GATHER_ONLY:
        return Fp8TpWire(1, 2, 1)
    return Fp8TpWire(2, 2, 0)
