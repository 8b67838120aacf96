"""FP8 casting and scaling overhead: the HBM bytes that bring an FP8 linear's operands into
FP8, eager or under torch.compile, and under torchao's tensorwise tensor parallelism
(docs/fp8.md, "Casting and scaling overhead"). Used by cost/fp8.py's roofline. No torch."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amsp_planner.cost.fp8 import Fp8Recipe


def scale_count(recipe: Fp8Recipe, rows: int, cols: int, weight: bool) -> int:
    """Scales of a (rows x cols) tensor scaled along its rows (contiguous cols share one)."""
    if recipe.block is None:
        return 1
    if recipe.block == 0:
        return rows
    if weight and recipe.weight_block:
        return math.ceil(rows / recipe.weight_block) * math.ceil(cols / recipe.weight_block)
    return rows * math.ceil(cols / recipe.block)


def cast_bytes(recipe: Fp8Recipe, rows: int, cols: int, family: str, weight: bool = False,
               compiled: bool = False) -> int:
    """HBM bytes to bring one bf16 (rows x cols) operand into FP8 in both layouts an FP8
    linear needs (scaled along its rows for one GEMM, along its columns for the other).

    Eager (``compiled`` False): amax pass (tensorwise): read 2 B/element. torchao: each layout
    is its own cast kernel (read 2 B, write 1 B per element), plus its scales. te: one fused
    cast-transpose kernel reads once and writes both layouts (read 2, write 2 x 1 B), plus the
    scales (TE's kernels are the same with or without torch.compile). Scales along the columns
    of a 2-D weight tile are the same tiles: counted once more anyway.

    torchao under torch.compile (``compiled``: ``training.compile``), the kernels Inductor generates as torchao's own roofline counts them
    (torchao/testing/training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s, at
    0598012907d6f6e88734088a65f788c38d294a65, with its fusion modelling on): tensorwise
    activation or gradient: the amax reduction fused into the kernel that produced the tensor
    (0 B), one cast writing both layouts (read 2, write 2 x 1); tensorwise weight: amax (read 2)
    and one cast per layout (2 x (2 + 1)); rowwise activation or gradient: one kernel writes the
    row-scaled FP8 and a transposed bf16 copy (its read fused: 1 + 2), a second casts the copy
    (2 + 1); rowwise weight: cast (2 + 1), transpose (2 + 2), cast (2 + 1). Other recipes as
    eager."""
    e = rows * cols
    scales = (scale_count(recipe, rows, cols, weight) + scale_count(recipe, cols, rows, weight)) \
        * recipe.scale_bytes
    if compiled and family == "torchao" and recipe.name in ("tensorwise", "rowwise"):
        if recipe.name == "tensorwise":
            data = (2 + 2 * 3) * e if weight else (2 + 2 * 1) * e
        else:
            data = (3 + 4 + 3) * e if weight else (1 + 2 + 3) * e
        return data + scales
    amax = 2 * e if recipe.amax_pass else 0
    data = 2 * (2 * e + e) if family == "torchao" else 2 * e + 2 * e
    return amax + data + scales


def linear_cast_bytes(recipe: Fp8Recipe, m: int, k: int, n: int, family: str,
                      compiled: bool = False, weight_share: float = 1.0) -> float:
    """Cast bytes of one FP8 linear's forward + backward, (m x k) @ (k x n): the input x,
    the weight W and the output gradient dy, each in both layouts (x: forward and weight
    gradient; W: forward and input gradient; dy: input and weight gradients). `weight_share`:
    the part of W's cast this call pays (1/m where m micro-batches share one cached copy)."""
    return (cast_bytes(recipe, m, k, family, compiled=compiled)
            + weight_share * cast_bytes(recipe, k, n, family, weight=True, compiled=compiled)
            + cast_bytes(recipe, m, n, family, compiled=compiled))


ROW_PARALLEL = ("wo", "w2", "fc2")
"""Row-parallel linears under TP: their output is reduce-scattered (sequence parallel)."""
SHARES_INPUT = {"wk": "wq", "wv": "wq", "w3": "w1"}
"""Linears that take the same gathered input as an earlier one of the block."""


def tp_cast_bytes(recipe: Fp8Recipe, m: int, k: int, n: int, name: str, tp: int,
                  compiled: bool = False) -> float:
    """Cast bytes of one linear under torchao's tensorwise tensor parallelism
    (torchao/float8/float8_tensor_parallel.py at 36027d8, applied by torchtitan for
    tensorwise): PrepareFloat8ModuleInput / Float8ColwiseParallel cast the sequence-sharded
    input once per module, before the all-gather ("if there are multiple float8 users of the
    input activation, we perform fp8 allgather only once"), so wq/wk/wv and w1/w3 share one
    amax + cast of m/tp rows; Float8RowwiseParallel's NoopFwToFloat8BwDynamic casts the output
    gradient of wo/w2 on its sequence shard before the backward all-gather. Each user still
    lays the gathered FP8 tensor out for its weight-gradient GEMM (a transposed copy: read 1,
    write 1 byte per element). The other operands as ``cast_bytes`` (`compiled`: as
    torch.compile runs them; the shard's amax then fused into the kernel that produced it)."""
    amax = 0 if compiled else 2

    def sharded(rows: int, cols: int) -> float:
        return (amax + 2 + 1) * rows * cols / tp + 2 * rows * cols

    w = cast_bytes(recipe, k, n, "torchao", weight=True, compiled=compiled)
    if name in ROW_PARALLEL:
        return cast_bytes(recipe, m, k, "torchao", compiled=compiled) + sharded(m, n) + w
    x = 2 * m * k if name in SHARES_INPUT else sharded(m, k)
    return x + cast_bytes(recipe, m, n, "torchao", compiled=compiled) + w


TE_COLUMN_GATHERED = ("linear_qkv", "linear_fc1")
"""Megatron's TE linears whose input is the all-gathered (sequence-parallel) norm output; the
row-parallel linear_proj and linear_fc2 gather their output gradient in the backward."""


TE_FP8_GATHERS = ("delayed", "tensorwise")
"""Recipes whose sequence-parallel all-gathers Transformer Engine runs in FP8, the operand cast
on the shard first (``te_linear_cast_bytes``; cost/fp8_bytes.py ``fp8_tp_wire`` prices their
bytes on the wire); blockwise and MXFP8 gathers are priced in bf16 (not modelled)."""

TE_AMAX_FUSED_INPUT = ("linear_qkv", "linear_fc1", "linear_fc2")
"""Transformer Engine linears whose input comes out of a TE kernel that takes the amax of its
own output under current scaling (tensorwise), so the cast needs no separate amax read: the
norm of LayerNormLinear / LayerNormMLP (csrc/extensions/normalization.cpp,
``FUSED_NORM_AMAX_FP8``; ``create_hp_tensor_with_amax`` at v2.7) and the activation before
linear_fc2 (activation.cpp ``FUSED_ACTIVATION_AMAX_FP8``). linear_proj's input, the attention
output, is quantized by its own amax pass."""
TE_AMAX_FUSED_GRAD = ("linear_fc1",)
"""TE linears whose output gradient comes out of the activation's backward (activation.cpp,
the dact functions with the same fused amax under current scaling); the other output gradients
(the residual stream's, attention's input gradients) take their own amax pass."""


def te_linear_cast_bytes(recipe: Fp8Recipe, m: int, k: int, n: int, name: str, tp: int,
                         weight_share: float = 1.0, gathered: bool = True) -> float:
    """Cast bytes of one Transformer Engine linear (every recipe; without gathers and without
    current scaling's amax, ``linear_cast_bytes`` with the 'te' family). With sequence
    parallelism and FP8 gathers (`gathered`, tp > 1; NVIDIA/TransformerEngine v1.7,
    v1.8 3ec998e, v1.9 e79d915 for delayed scaling: module/layernorm_linear.py and
    layernorm_mlp.py, ``ln_out_dtype = torch.uint8`` so the norm kernel writes FP8 on the rank's
    m/tp rows, then ``gather_along_first_dim(ln_out, tp_group)`` and in the backward
    ``ln_out_total_t = tex.fp8_transpose(ln_out_total, ...)``; module/base.py
    ``grad_output_preprocess``, "FP8 case with gather": ``cast_to_fp8`` of the local output
    gradient, ``gather_along_first_dim``, ``tex.fp8_transpose(grad_output_c)``; v2.9 the same
    for every recipe through ``gather_along_first_dim(ln_out, tp_group,
    quantizer=input_quantizer)``, current scaling's quantizers then reducing their amax over
    the TP group, ``_customize_quantizers_float8_current_scaling``): the gathered operand
    (linear_qkv/linear_fc1's input, linear_proj/linear_fc2's output gradient) is cast on the
    shard (read 2, write 1 byte per element of m/tp rows) and transposed after the gather
    (read 1, write 1 on all m rows). The other operands and the weight as ``cast_bytes`` (te,
    fused cast-transpose on all rows). Current scaling's amax read (``Fp8Recipe.amax_pass``,
    2 bytes per element) is left out where TE's kernel that produced the operand took it
    (``TE_AMAX_FUSED_INPUT``, ``TE_AMAX_FUSED_GRAD``). The norm output's shard cast is priced
    as its own kernel (under delayed scaling TE fuses it into the norm kernel: not credited
    here). `weight_share` as in ``linear_cast_bytes``."""
    amax = 2 if recipe.amax_pass else 0

    def own(rows: int, cols: int, fused: bool) -> float:
        return cast_bytes(recipe, rows, cols, "te") - (amax * rows * cols if fused else 0)

    def sharded(rows: int, cols: int, fused: bool) -> float:
        return (0 if fused else amax) * rows * cols / tp + (2 + 1) * rows * cols / tp \
            + 2 * rows * cols

    fused_x, fused_dy = name in TE_AMAX_FUSED_INPUT, name in TE_AMAX_FUSED_GRAD
    w = weight_share * cast_bytes(recipe, k, n, "te", weight=True)
    if not gathered or tp == 1:
        return own(m, k, fused_x) + own(m, n, fused_dy) + w
    if name in TE_COLUMN_GATHERED:
        return sharded(m, k, fused_x) + own(m, n, fused_dy) + w
    return own(m, k, fused_x) + sharded(m, n, fused_dy) + w
