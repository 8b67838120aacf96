"""Where FP8 stops paying: the per-GPU batch and the model size below which a job's blocks run
no faster in FP8 than in bf16 on its cluster (``amsp explain``).

FP8 changes the blocks' linears (docs/fp8.md): attention, the elementwise kernels and the LM
head are the same in both precisions, and the FSDP/ZeRO collectives and memory are priced as
bf16; the FP8 tensor-parallel all-gathers only shorten the step and are left out here. So the
crossovers are where the blocks' matmuls stop getting faster:

    sum_i bf16_s(M, K_i, N_i) / speedup_i(M, K_i, N_i)  <  sum_i bf16_s(M, K_i, N_i)

over the engine's linears (``cost/fp8.py: block_linears``; a linear that stays bf16 has
speed-up 1), bf16_s the roofline of ``cost/compute.py``, speedup_i ``cost/fp8.py:
block_linear_speedup`` (the published grid or the roofline; under torchao's tensorwise TP
with the shared casts). Two scans find where the sign changes:

  per-GPU batch: M, the tokens of one micro-batch on one GPU (micro-batch x sequence), over
    ``M_RANGE`` with the model as it is;
  model size: every linear's K and N scaled by x (hidden, FFN and head widths; the layers and
    the vocabulary kept) over ``X_RANGE`` at the plan's M; the size reported is the parameter
    count of that width: x^2 of the blocks' linear weights plus x of the rest (embedding, head,
    norms).

Each scan is a log grid (``STEPS_PER_OCTAVE``); the crossing is the lowest scanned point above
which every scanned point pays, bisected in log space to ``TOLERANCE``. Outside the published
grid the speed-up is its edge value (no extrapolation), so a crossing there is flagged.
"""

from __future__ import annotations

import math

M_RANGE = (256, 1 << 20)
"""Tokens per micro-batch per GPU scanned: 256 (short sequences, one per GPU) to 1M."""
X_RANGE = (1 / 64, 16.0)
"""Width multiples scanned (Llama-3-8B's 4096 hidden: 64 to 65,536)."""
STEPS_PER_OCTAVE = 4
TOLERANCE = 0.01


def _gain_fn(job, tp: int):
    """f(M, x) -> FP8's matmul seconds / bf16's for one block at M tokens and width x."""
    from dataclasses import replace

    from amsp_planner.cost.compute import _matmul, _rates
    from amsp_planner.cost.fp8 import block_linear_speedup, fp8_matmuls

    engine = job.engine
    recipe = recipe_of(job)
    r = _rates(job)
    lin = fp8_matmuls(job.model, recipe, engine, tp).block

    def ratio(m: float, x: float = 1.0) -> float:
        bf16 = fp8 = 0.0
        for li in lin:
            k, n = li.k * x, li.n * x
            t = _matmul(r, m, k, n)
            bf16 += t
            fp8 += t / block_linear_speedup(job, recipe, m, replace(li, k=k, n=n), tp) \
                if li.fp8 else t
        return fp8 / bf16

    return ratio


def recipe_of(job) -> str:
    """The job's FP8 recipe: its own for an FP8 job, the engine's default otherwise."""
    from amsp_planner.cost.fp8 import default_recipe

    return job.training.fp8_recipe or default_recipe(job.engine)


def applicable(job) -> str | None:
    """Why FP8 cannot be priced for this job (None when it can)."""
    from amsp_planner.cost.fp8 import FAMILY, GATHER_ONLY, recipe_for
    from amsp_planner.errors import AmspUserError

    if job.engine in GATHER_ONLY:
        return f"engine {job.engine} runs FP8 in its all-gathers only, no FP8 matmuls"
    from amsp_planner.engines import runs_as

    if runs_as(job.engine) not in FAMILY:
        return f"engine {job.engine} has no FP8 path here"
    if getattr(job.model, "num_experts", 0):
        if runs_as(job.engine) == "megatron":
            return ("a mixture of experts: its experts' matmuls run FP8 too, on T k e / E rows "
                    "each, which the scan of a block's linears at the micro-batch does not vary")
        return ("a mixture of experts: FP8 prices its attention's linears only, its experts' "
                "grouped GEMMs stay bf16 (torchao converts nn.Linear only)")
    try:
        recipe_for(recipe_of(job), job.engine, job.cluster.gpu.arch)
    except AmspUserError:
        return f"{job.cluster.gpu.name} ({job.cluster.gpu.arch}) has no FP8 {recipe_of(job)}"
    return None


def _scan(pays, lo: float, hi: float) -> dict:
    """The crossing of `pays` over [lo, hi] on the log grid, bisected: {'below': the value
    below which it stops paying, or None; 'pays': 'all', 'none' or 'above'}."""
    n = int(round(math.log2(hi / lo) * STEPS_PER_OCTAVE))
    pts = [lo * 2 ** (i / STEPS_PER_OCTAVE) for i in range(n + 1)]
    ok = [pays(v) for v in pts]
    if all(ok):
        return {"pays": "all", "below": None}
    if not ok[-1]:
        return {"pays": "none", "below": None}
    i = max(j for j, v in enumerate(ok) if not v)  # the last point that does not pay
    a, b = pts[i], pts[i + 1]
    while b / a > 1 + TOLERANCE:
        mid = math.sqrt(a * b)
        a, b = (mid, b) if not pays(mid) else (a, mid)
    return {"pays": "above", "below": math.sqrt(a * b),
            "also_pays_lower": any(ok[:i])}


def _size_at(model, x: float) -> float:
    """Parameters of the model with its widths scaled by x (module docstring)."""
    from amsp_planner.cost.fp8 import block_linears

    lin = sum(k * n for _, k, n in block_linears(model, "torchtitan")) * model.num_layers
    return lin * x * x + (model.num_params - lin) * x


def fp8_crossover(job, strategy) -> dict:
    """FP8 against bf16 for `strategy`'s job: the step of both, the per-GPU batch (tokens per
    micro-batch) and the model size below which FP8 stops paying (module docstring)."""
    why = applicable(job)
    if why:
        return {"applicable": False, "why": why}
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.cost.job import Job

    t = job.training
    both = {}
    for p in ("bf16", "fp8"):
        upd = {"precision": p, "fp8_recipe": recipe_of(job) if p == "fp8" else None,
               "fp8_all_gather": t.fp8_all_gather if p == "fp8" else "auto"}
        if t.precision == p:
            both[p] = job
        else:
            both[p] = Job.create(job.model, job.cluster, t.model_copy(update=upd), job.num_gpus,
                                 job.engine, *job.split)
    # bf16 gathers in bf16 (a plan's FP8 all-gather, fp8ag, is an FP8 option)
    steps = {p: evaluate(j, strategy.with_(fp8ag=strategy.fp8ag and p == "fp8")).step_s
             for p, j in both.items()}
    ratio = _gain_fn(both["fp8"], strategy.tp)
    m = strategy.micro_batch * t.seq_len
    batch = _scan(lambda v: ratio(v) < 1.0, *M_RANGE)
    width = _scan(lambda x: ratio(m, x) < 1.0, *X_RANGE)
    if width["below"] is not None:
        x = width["below"]
        width.update(params=_size_at(job.model, x), hidden=job.model.hidden_size * x)
    return {"applicable": True, "recipe": recipe_of(job), "engine": job.engine,
            "micro_batch_tokens": m, "tp": strategy.tp, "matmul_ratio": ratio(m), "step_s": steps,
            "step_gain": steps["bf16"] / steps["fp8"] - 1, "batch": batch, "model": width}


def _tokens(v: float) -> str:
    return f"{v:,.0f}"


def fp8_lines(c: dict, job) -> list[str]:
    """`amsp explain`'s FP8 lines."""
    if not c["applicable"]:
        return [f"FP8 against bf16 (where FP8 stops paying): not computed ({c['why']})"]
    own = job.training.precision == "fp8"
    head = (f"FP8 ({c['recipe']}, {c['engine']}; " + ("this plan's precision" if own else
            "not switched on: --precision fp8") + f"): step {c['step_s']['bf16']:.3f} s in bf16, "
            f"{c['step_s']['fp8']:.3f} s in FP8 ({c['step_gain'] * 100:+.1f}% tokens/s), the "
            f"blocks' matmul time x{c['matmul_ratio']:.2f}"
            + (f" (tp={c['tp']} shards)" if c["tp"] > 1 else ""))
    m = c["micro_batch_tokens"]
    b, w = c["batch"], c["model"]
    seq = job.training.seq_len
    if b["pays"] == "above":
        bl = (f"  per-GPU batch: FP8 stops paying (the blocks' matmuls) below "
              f"{_tokens(b['below'])} tokens per "
              f"micro-batch ({b['below'] / seq:.2g} sequences of {seq}; this plan: {_tokens(m)})")
    else:
        bl = ("  per-GPU batch: FP8 pays at every micro-batch scanned" if b["pays"] == "all"
              else "  per-GPU batch: FP8 does not pay at any micro-batch scanned") + \
            f" ({_tokens(M_RANGE[0])} to {_tokens(M_RANGE[1])} tokens)"
    if w["pays"] == "above":
        ml = (f"  model size: at {_tokens(m)} tokens per micro-batch FP8 stops paying (the "
              "blocks' matmuls) below "
              f"{w['params'] / 1e9:.3g}B parameters (hidden {w['hidden']:,.0f}, "
              f"{job.model.num_layers} layers; this model: {job.model.num_params / 1e9:.3g}B)")
    else:
        ml = ("  model size: FP8 " + ("pays at every width scanned" if w["pays"] == "all" else
              "does not pay at any width scanned") +
              f" (hidden {job.model.hidden_size * X_RANGE[0]:,.0f} to "
              f"{job.model.hidden_size * X_RANGE[1]:,.0f})")
    return [head, bl, ml]
