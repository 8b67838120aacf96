"""FP8 training: which matmuls run in FP8, how much faster, what the casts cost, the FP8 weight
all-gather and the FP8 copies kept for backward (docs/fp8.md). No torch.

Data and rules: ``presets/fp8_matmul.yaml``, every row with its source (torchao, Transformer
Engine, torchtitan, Megatron-LM at pinned commits). Two engine families run FP8:

  torchao (engines torchtitan, fsdp2): ``Float8Linear`` / ``MXLinear`` replace the blocks'
    ``nn.Linear`` layers; the LM head and the embedding stay bf16.
  te (engine megatron): Transformer Engine's linears (``linear_qkv``, ``linear_proj``,
    ``linear_fc1``, ``linear_fc2``); the LM head and embedding stay bf16; optionally the first
    and last layers (``--first-last-layers-bf16``).

The bundled runtime (amsp) runs FP8 in its parameter all-gathers only (tensorwise, ``GATHER_ONLY``;
its matmuls stay in its own precision); DeepSpeed and InternEvo have no FP8 path here: asking
them for FP8 is a user error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from amsp_planner.cost.fp8_casts import (
    TE_FP8_GATHERS,
    linear_cast_bytes,
    te_linear_cast_bytes,
    tp_cast_bytes,
)
from amsp_planner.cost.fp8_grid import fp8_data, grid_speedup
from amsp_planner.errors import AmspUserError

RecipeName = Literal["tensorwise", "rowwise", "blockwise", "mxfp8", "delayed"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "blockwise", "mxfp8", "delayed")
FAMILY = {"torchtitan": "torchao", "fsdp2": "torchao", "megatron": "te", "fsdp": "te"}
"""Engine -> the FP8 implementation it runs (engines not listed have none). ``fsdp`` (FSDP1,
a profile of published rows only): Composer's ``amp_fp8`` precision, Transformer Engine's
``fp8_autocast`` around llm-foundry's ``te.Linear`` layers (``fc_type: te``); its FSDP gathers
stay in the parameters' dtype and no micro-batch reuses another's FP8 weight cast."""
GATHER_ONLY = {"amsp": "torchao"}
"""Engines whose FP8 is the tensorwise weight all-gather only (runtime/fp8.py), torchao's
scheme; their matmuls stay in the engine's precision, on any GPU or CPU."""

FP8_PEAK_RATIO = {"hopper": 2.0, "blackwell": 2.0}
"""Dense FP8 / dense bf16 tensor-core peak. Data sheets: H100 SXM 1,979 / 989 TFLOP/s, H200
SXM the same, B200 4.5 / 2.25 PFLOP/s. Other architectures have no FP8 tensor cores."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How a tensor is scaled before an FP8 matmul.

    ``block``: elements that share one scale along the scaled axis (0: the whole row, None:
    the whole tensor); ``weight_block``: the same for weights where the recipe scales them in
    2-D tiles (blockwise: 128 x 128); ``scale_bytes``: 4 (fp32) or 1 (E8M0); ``amax_pass``:
    the scale needs the tensor's global amax, a separate reduction read before the cast
    (tensorwise current scaling); local scales are computed inside the cast kernel, delayed
    scaling takes the amax of earlier steps. ``gemm_fraction``: the fraction of the
    FP8_PEAK_RATIO x bf16 GEMM rate the recipe's GEMMs reach, relative to bf16's own fraction
    (presets/fp8_matmul.yaml, TE's pre-quantized GEMM-only figures: H200 NVL FP8 current
    scaling 31.968 / 16.785 ms = 1.905x of 2 -> 0.95, B300 MXFP8 314.445 / 171.869 = 1.83x ->
    0.915; blockwise has no GEMM-only figure on Hopper: 0.76 is fitted to TE's autocast 1.40x
    on H200 NVL, so that point does not test it)."""

    name: str
    block: int | None
    scale_bytes: int
    amax_pass: bool
    archs: tuple[str, ...]
    families: tuple[str, ...]
    weight_block: int | None = None
    gemm_fraction: float = 0.95


RECIPE = {
    # torchao Float8LinearConfig() (tensorwise dynamic), TE Float8CurrentScaling
    "tensorwise": Fp8Recipe("tensorwise", None, 4, True, ("hopper", "blackwell"),
                            ("torchao", "te")),
    # torchao from_recipe_name("rowwise"): AXISWISE scales, fp32 rounded to powers of 2
    "rowwise": Fp8Recipe("rowwise", 0, 4, False, ("hopper", "blackwell"), ("torchao",)),
    # TE Float8BlockScaling (DeepSeek-V3): 1 x 128 activation tiles, 128 x 128 weight blocks;
    # native on Hopper only (TE emulates it through MXFP8 on Blackwell)
    "blockwise": Fp8Recipe("blockwise", 128, 4, False, ("hopper",), ("te",), weight_block=128,
                           gemm_fraction=0.76),
    # OCP MX: 32 elements share one E8M0 scale (torchao MXLinear, TE MXFP8BlockScaling)
    "mxfp8": Fp8Recipe("mxfp8", 32, 1, False, ("blackwell",), ("torchao", "te"),
                       gemm_fraction=0.915),
    # TE DelayedScaling (Megatron's default --fp8-recipe delayed): per-tensor scale from the
    # amax history, so no amax pass before the cast
    "delayed": Fp8Recipe("delayed", None, 4, False, ("hopper", "blackwell"), ("te",)),
}


def family_of(engine: str) -> str:
    """The engine's FP8 implementation ('torchao' or 'te'); a user error if it has none."""
    from amsp_planner.engines import runs_as

    if engine in GATHER_ONLY:
        return GATHER_ONLY[engine]
    engine = runs_as(engine)
    if engine not in FAMILY:
        from amsp_planner.engines import ENGINES

        ok = [e for e in ENGINES if e in FAMILY or e in GATHER_ONLY]
        raise AmspUserError(f"--precision fp8: engine {engine} has no FP8 path in the planner; "
                            f"use --engine {', '.join(ok)}, or --precision bf16")
    return FAMILY[engine]


def recipe_for(name: str, engine: str, arch: str | None = None) -> Fp8Recipe:
    """The recipe, checked against the engine (and the GPU's architecture when given)."""
    if name not in RECIPE:
        raise AmspUserError(f"--fp8-recipe {name}: use one of {', '.join(RECIPES)}")
    r, fam = RECIPE[name], family_of(engine)
    if engine in GATHER_ONLY and name != "tensorwise":
        raise AmspUserError(f"--fp8-recipe {name}: engine {engine} gathers FP8 weights with the "
                            "tensorwise recipe only; use --fp8-recipe tensorwise")
    if fam not in r.families:
        ok = [n for n in RECIPES if fam in RECIPE[n].families
              and (arch is None or arch in RECIPE[n].archs)]
        raise AmspUserError(f"--fp8-recipe {name}: engine {engine} does not run it; use "
                            f"{', '.join(ok) or '--precision bf16'}")
    if arch is not None and arch not in r.archs and engine not in GATHER_ONLY:
        ok = [n for n in RECIPES if fam in RECIPE[n].families and arch in RECIPE[n].archs]
        if not ok:
            raise AmspUserError(f"--precision fp8 needs a hopper or blackwell GPU for FP8 "
                                f"matmuls (this cluster's is {arch}): use --precision bf16, "
                                "or a cluster of such GPUs")
        raise AmspUserError(f"--precision fp8 with recipe {name} needs a "
                            f"{' or '.join(r.archs)} GPU (this cluster's is {arch}): use "
                            f"--fp8-recipe {' or '.join(ok)}, or --precision bf16")
    return r


DEFAULT_RECIPE = {"torchao": "rowwise", "te": "delayed"}
"""--fp8-recipe auto: torchtitan's Float8LinearConverter default (recipe_name = "rowwise" at
b5bcd76) and Megatron's (TransformerConfig.fp8_recipe = "delayed" at d98e8a6)."""


def default_recipe(engine: str) -> str:
    return "tensorwise" if engine in GATHER_ONLY else DEFAULT_RECIPE[family_of(engine)]


def check_training(training, engine: str, arch: str) -> str:
    """The job's recipe after checking it runs on this engine and GPU, and that an FP8
    all-gather asked for exists there (one line, exit 2, otherwise)."""
    name = training.fp8_recipe or default_recipe(engine)
    recipe_for(name, engine, arch)
    if training.fp8_all_gather == "on" and not fp8_all_gather_supported(name, engine):
        fix = ("--engine fsdp2 --fp8-recipe tensorwise (torchtitan 0.3 has no FP8 all-gather)"
               if engine == "torchtitan" else "--fp8-recipe tensorwise")
        raise AmspUserError(f"--fp8-all-gather on: {engine} gathers FP8 weights with the "
                            f"tensorwise recipe only (torchao); use {fix} or "
                            "--fp8-all-gather off")
    return name


# ----- which matmuls run in FP8 --------------------------------------------------------------
@dataclass(frozen=True)
class Linear:
    """One linear of a block: y = x W with W of shape (k, n) (in, out features)."""

    name: str
    k: int
    n: int
    fp8: bool


@dataclass(frozen=True)
class Fp8Matmuls:
    """The block's linears (FP8 or not) and what stays bf16 around them."""

    block: tuple[Linear, ...]
    bf16_layers: int = 0
    """Blocks run entirely in bf16 (Megatron's first/last layers)."""
    head_fp8: bool = False
    embedding_fp8: bool = False

    @property
    def fp8_params_per_block(self) -> int:
        return sum(x.k * x.n for x in self.block if x.fp8)

    @property
    def bf16_params_per_block(self) -> int:
        return sum(x.k * x.n for x in self.block if not x.fp8)


def _auto_filter_keeps(recipe: str, k: int, n: int) -> bool:
    """torchao's _auto_filter_for_rowwise / _auto_filter_for_tensorwise (H100 thresholds)."""
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return True  # no published filter for the MX recipes


def block_linears(model, engine: str, tp: int = 1) -> list[tuple[str, int, int]]:
    """(name, K, N) of the block's linears as the engine builds them, one TP rank's shard:
    torchtitan/HF separate wq, wk, wv and w1, w3; Megatron fused linear_qkv and linear_fc1."""
    h, f, q, kv = model.hidden_size, model.ffn_hidden_size // tp, model.q_dim // tp, \
        model.kv_dim // tp
    gated = model.ffn_matrices == 3
    if family_of(engine) == "te":
        return [("linear_qkv", h, q + 2 * kv), ("linear_proj", q, h),
                ("linear_fc1", h, 2 * f if gated else f), ("linear_fc2", f, h)]
    mlp = [("w1", h, f), ("w3", h, f), ("w2", f, h)] if gated else [("fc1", h, f), ("fc2", f, h)]
    return [("wq", h, q), ("wk", h, kv), ("wv", h, kv), ("wo", q, h)] + mlp


def mlp_linear_names(model, engine: str) -> list[str]:
    """The names of the block's dense-MLP linears (block_linears' last ones): what a
    mixture-of-experts layer replaces with its experts, whose grouped GEMMs stay bf16 here."""
    return [n for n, _, _ in block_linears(model, engine)[-(2 if family_of(engine) == "te"
                                                             else model.ffn_matrices):]]


def fp8_matmuls(model, recipe: str, engine: str, tp: int = 1, auto_filter: bool = False,
                first_last_bf16: tuple[int, int] = (0, 0)) -> Fp8Matmuls:
    """Which of a block's matmuls run in FP8 (the rule of presets/fp8_matmul.yaml `rules`).

    Both families: a linear whose K or N is not a multiple of 16 stays bf16 (the FP8 tensor
    cores' requirement); the LM head and the embedding stay bf16. torchao: `auto_filter`
    applies torchao's auto_filter_small_kn thresholds (opt-in in torchtitan). te:
    `first_last_bf16` = (num_layers_at_start_in_bf16, num_layers_at_end_in_bf16) when
    --first-last-layers-bf16 is given (Megatron's defaults are (1, 1))."""
    recipe_for(recipe, engine)
    fam = family_of(engine)
    out = []
    for name, k, n in block_linears(model, engine, tp):
        fp8 = k % 16 == 0 and n % 16 == 0
        if fp8 and fam == "torchao" and auto_filter:
            fp8 = _auto_filter_keeps(recipe, k, n)
        out.append(Linear(name, k, n, fp8))
    start, end = first_last_bf16 if fam == "te" else (0, 0)
    return Fp8Matmuls(tuple(out), bf16_layers=min(model.num_layers, start + end))


# ----- speed-up of one linear ----------------------------------------------------------------
@dataclass(frozen=True)
class Speedup:
    """bf16 time / FP8 time of one linear's forward + backward (3 GEMMs and the casts)."""

    value: float
    how: str
    """'calibrated' or 'table' (either ', clamped to its edge'), or 'roofline' (docs/fp8.md)."""
    source: str = ""


def _grid(gpu, recipe: str, family: str) -> dict | None:
    """The grid of this architecture, recipe and family: one naming the GPU, else a general one."""
    fits = [g for g in fp8_data()["grids"]
            if g["gpu_arch"] == gpu.arch and g["recipe"] == recipe and g["source"] == family]
    return (next((g for g in fits if gpu.name in g.get("gpu_names", ())), None)
            or next((g for g in fits if not g.get("gpu_names")), None))


def roofline_linear_s(gpu, m: int, k: int, n: int, fp8: Fp8Recipe | None,
                      family: str = "torchao", casts: float | None = None,
                      compiled: bool = False) -> float:
    """Seconds of one linear's forward + backward (3 GEMMs of 2mkn FLOPs each) on `gpu`:
    per GEMM max(FLOPs / (peak x achievable_fraction), bytes / hbm) + kernel overhead, the
    same roofline as cost/compute.py; FP8 at FP8_PEAK_RATIO x gemm_fraction x the bf16 rate,
    1-byte inputs and a bf16 output, plus the casts at the HBM rate (`casts`: their bytes,
    default linear_cast_bytes, eager or `compiled`)."""
    ratio = 1.0 if fp8 is None else FP8_PEAK_RATIO[gpu.arch] * fp8.gemm_fraction
    peak = gpu.peak_bf16_tflop_per_s * 1e12 * ratio * gpu.achievable_fraction
    hbm = (gpu.hbm_gbyte_per_s or math.inf) * 1e9
    ib = 2 if fp8 is None else 1
    t = 0.0
    for a, b, c in ((m, k, n), (m, n, k), (k, m, n)):  # forward, input grad, weight grad
        t += max(2.0 * a * b * c / peak, (ib * (a * b + b * c) + 2 * a * c) / hbm)
        t += gpu.kernel_overhead_us * 1e-6
    if fp8 is not None:
        t += (linear_cast_bytes(fp8, m, k, n, family, compiled) if casts is None
              else casts) / hbm
    return t


def linear_speedup(gpu, recipe: str, m: int, k: int, n: int,
                   engine: str = "torchtitan", compiled: bool = False) -> Speedup:
    """Speed-up of one FP8 linear over bf16, forward + backward, at forward shape (m, k, n).

    The GPU's own measured grid comes first (``gpu.fp8_linear``, written by ``amsp calibrate
    --fp8``: torchao's scheme, so torchao engines only), interpolated like a published one.
    Then a grid of the GPU's architecture, recipe and engine family (_grid: rowwise, the
    H200 SXM's measured grid, else torchao's published H100 one, whose values include the
    LayerNorm and Sigmoid around the linear), interpolated (grid_speedup). Otherwise the
    roofline (roofline_linear_s) prices both, the casts as the engine runs them (`compiled`:
    under torch.compile, ``cast_bytes``). docs/fp8.md."""
    found = pricing_grid(gpu, recipe, engine)
    if found is not None:
        v, clamped = grid_speedup(found.grid, m, k, n)
        return Speedup(v, found.how + (", clamped to its edge" if clamped else ""), found.source)
    fam = family_of(engine)
    r = recipe_for(recipe, engine, gpu.arch)
    bf16 = roofline_linear_s(gpu, m, k, n, None)
    return Speedup(bf16 / roofline_linear_s(gpu, m, k, n, r, fam, compiled=compiled),
                   "roofline")


def calibrated_grid(gpu, recipe: str, engine: str):
    """The GPU's own measured grid of `recipe` (``gpu.fp8_linear``, ``amsp calibrate --fp8``),
    where it applies: it measures torchao's scheme, so torchao engines whose linears run FP8
    (not the bundled runtime's gather-only FP8); else None."""
    if engine in GATHER_ONLY or family_of(engine) != "torchao":
        return None
    return next((c for c in gpu.fp8_linear if c.recipe == recipe), None)


@dataclass(frozen=True)
class PricingGrid:
    grid: dict
    how: str      # Speedup.how: 'calibrated' or 'table'
    source: str   # Speedup.source
    label: str    # what grid_note names


def pricing_grid(gpu, recipe: str, engine: str) -> PricingGrid | None:
    """The grid that prices `recipe`'s linears on `gpu` under `engine`, in linear_speedup's
    order: this cluster's measured one, else a preset's (_grid); None: the roofline does."""
    if cal := calibrated_grid(gpu, recipe, engine):
        return PricingGrid({"M": cal.M, "K": cal.K, "N": cal.N, "speedup": cal.speedup},
                           "calibrated", cal.measured,
                           f"this cluster's measured grid: {cal.measured}")
    g = None if engine in GATHER_ONLY else _grid(gpu, recipe, family_of(engine))
    return g and PricingGrid(g, "table", g["id"],
                             f"the grid {g['id']} ({g['gpu']}, {g['measures']})")


def grid_note(job) -> str | None:
    """The FP8 line naming the grid that prices the job's linears (None: the roofline)."""
    r = check_training(job.training, job.engine, job.cluster.gpu.arch)
    found = pricing_grid(job.cluster.gpu, r, job.engine)
    return found and f"FP8 {r} linears priced from {found.label}"


def block_matmul_s(job, tokens: int, tp: int, bf16_s) -> float:
    """Forward matmul seconds of one block of an FP8 job, as cost/compute.py counts them
    (backward = 2 x forward): each of the engine's linears at its bf16 seconds
    ``bf16_s(k, n)`` (compute.py's roofline), divided by its linear_speedup when it runs FP8;
    Megatron's bf16 first/last layers averaged over the L blocks like partial checkpointing.
    The speed-up covers forward + backward with the casts, so scaling the forward by it scales
    the backward alike."""
    engine, gpu = job.engine, job.cluster.gpu
    recipe = check_training(job.training, engine, gpu.arch)
    f = fp8_matmuls(job.model, recipe, engine, tp)
    bf16 = sum(bf16_s(x.k, x.n) for x in f.block)
    low = sum(bf16_s(x.k, x.n) / block_linear_speedup(job, recipe, tokens, x, tp) if x.fp8
              else bf16_s(x.k, x.n) for x in f.block)
    share = f.bf16_layers / job.model.num_layers
    return share * bf16 + (1 - share) * low


def block_linear_speedup(job, recipe: str, tokens: int, x: Linear, tp: int) -> float:
    """linear_speedup, or the roofline with the casts the engine's own code runs: torchao's
    tensorwise tensor parallelism (tp_cast_bytes: the gathered input cast once, on the rank's
    1/tp of the rows), and every Transformer Engine linear (te_linear_cast_bytes: the weight's
    cast shared by the step's micro-batches, current scaling's amax read only where no TE
    kernel took it, and under sequence parallelism with FP8 gathers, ``TE_FP8_GATHERS``,
    the gathered operand cast on the shard)."""
    gpu, compiled, r = job.cluster.gpu, job.training.compile, RECIPE[recipe]
    fam = family_of(job.engine)
    casts = None
    if tp > 1 and recipe == "tensorwise" and fam == "torchao":
        casts = tp_cast_bytes(r, tokens, x.k, x.n, x.name, tp, compiled)
    elif fam == "te":
        gathered = job.training.sequence_parallel and recipe in TE_FP8_GATHERS
        casts = te_linear_cast_bytes(r, tokens, x.k, x.n, x.name, tp,
                                     1 / weight_casts_shared(job, tokens, tp), gathered)
    if casts is not None:
        return (roofline_linear_s(gpu, tokens, x.k, x.n, None)
                / roofline_linear_s(gpu, tokens, x.k, x.n, r, casts=casts))
    return linear_speedup(gpu, recipe, tokens, x.k, x.n, job.engine, compiled).value


def weight_casts_shared(job, tokens: int, tp: int) -> float:
    """Micro-batches of a step that share one FP8 cast of each weight, for Transformer Engine
    under Megatron-Core: the step's first micro-batch sets ``is_first_microbatch`` on every TE
    module (megatron/core/transformer/module.py ``set_is_first_microbatch``, called by
    pipeline_parallel/schedules.py ``forward_step``), TE casts and transposes the weight then
    and reuses that copy for the rest (extensions/transformer_engine.py ``TELinear.forward``:
    ``is_first_microbatch`` False after the first call, unless
    ``disable_parameter_transpose_cache``); NVIDIA/Megatron-LM at d98e8a6. The count is the
    step's micro-batches on one rank, global tokens x tp / (GPUs x micro-batch tokens) (under
    context parallelism and pipeline stages the job here is already one rank's view)."""
    if not job.profile.te_weight_cache:  # Composer's TE layers: no is_first_microbatch
        return 1.0
    t = job.training
    return max(1.0, t.batch_seqs * t.seq_len * tp / (job.num_gpus * tokens))


def named_matmuls_s(job, tokens: int, tp: int, names, bf16_s) -> float:
    """Forward seconds of the block's linears named `names` (those op-level checkpointing
    recomputes: torchtitan's wk, wo and w3), each at its FP8 speed-up where it runs FP8, as
    block_matmul_s prices the block's."""
    engine, gpu = job.engine, job.cluster.gpu
    recipe = check_training(job.training, engine, gpu.arch)
    lin = {x.name: x for x in fp8_matmuls(job.model, recipe, engine, tp).block}
    return sum(bf16_s(lin[n].k, lin[n].n) / (block_linear_speedup(job, recipe, tokens, lin[n], tp)
                                             if lin[n].fp8 else 1.0) for n in names)


def fp8_all_gather_supported(recipe: str, engine: str) -> bool:
    """torchao: tensorwise only (Float8LinearConfig asserts it; rowwise and MX gather in the
    param dtype: MXFP8TrainingWeightWrapper's fsdp_pre_all_gather casts to bf16). Megatron:
    --fp8-param-gather for every FP8 recipe (``EngineProfile.te_param_gather``). FSDP1 with
    Transformer Engine layers: none."""
    from amsp_planner.engines import profile

    if family_of(engine) == "te":
        return profile(engine).te_param_gather
    return recipe == "tensorwise"
