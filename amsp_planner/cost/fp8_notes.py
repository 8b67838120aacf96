"""What an FP8 figure covers, in words: the labels and notes amsp plan and amsp compare print
beside FP8 numbers (docs/fp8.md). No torch."""

from __future__ import annotations

from amsp_planner.cost.fp8 import FAMILY, GATHER_ONLY, default_recipe, family_of
from amsp_planner.cost.fp8_casts import TE_FP8_GATHERS


def export_warning(engine: str, recipe: str, gather: str = "auto") -> str | None:
    """A warning where the engine's FP8 plan of `recipe` is priced but its export refuses it
    (exports/fp8.py ``refuse``): torchtitan 0.3 runs rowwise (and MX) only; the FSDP2 module
    converts with torchao's Float8LinearConfig, tensorwise or rowwise. Also where nothing of
    the job is FP8: the bundled runtime, whose FP8 is its gathers, with `gather` off."""
    if engine in GATHER_ONLY and gather == "off":
        return (f"--precision fp8 --fp8-all-gather off: nothing is FP8 on {engine} (its FP8 is "
                "its parameter all-gathers; its matmuls stay bf16), so this plan prices as "
                "bf16: drop --fp8-all-gather off, or give --engine fsdp2, torchtitan or "
                "megatron for FP8 matmuls")
    if engine == "torchtitan" and recipe == "tensorwise":
        return ("--fp8-recipe tensorwise: torchtitan 0.3 runs rowwise only; priced as torchtitan "
                "ran torchao's tensorwise before 6348d93, so amsp export --to torchtitan refuses "
                "this plan: give --fp8-recipe rowwise, or --engine fsdp2")
    if engine == "fsdp2" and recipe not in ("tensorwise", "rowwise"):
        return (f"--fp8-recipe {recipe}: priced, but amsp export --to fsdp2 converts with "
                "torchao's Float8LinearConfig (tensorwise or rowwise) only and refuses this plan")
    return None


def precision_label(job) -> str:
    """'fp8 (tensorwise)' for an FP8 job (the recipe --fp8-recipe auto resolves to), else its
    precision."""
    t = job.training
    if t.precision != "fp8":
        return t.precision
    return f"fp8 ({t.fp8_recipe or default_recipe(job.engine)})"


MOE_NOTE = ("; of a mixture of experts, the attention's linears and any dense layers' MLP "
            "(its experts' grouped GEMMs and gathers stay bf16: torchao converts nn.Linear only, "
            "FSDP1's TE layers have no grouped experts)")
TE_MOE_NOTE = ("; of a mixture of experts also its shared and routed experts' matmuls (TE's "
               "grouped linears), the router bf16; its gathers stay bf16")


def priced_note(engine: str, moe: bool = False, recipe: str | None = None) -> str:
    """What an FP8 figure of `engine` covers (amsp compare and plan print it beside FP8
    numbers), by the engine's FP8 family and `recipe` (default: the engine's), with a mixture
    of experts' limits; for the bundled runtime (GATHER_ONLY: FP8 in its parameter all-gathers
    only), where FP8 matmuls are priced. Keep it true as the pricing changes."""
    from amsp_planner.engines import ENGINES, runs_as

    if engine in GATHER_ONLY:
        ok = [e for e in ENGINES if runs_as(e) in FAMILY]
        return (f"FP8 on {engine} (the bundled runtime): the FSDP/ZeRO parameter all-gathers "
                "only, where a strategy has fp8ag or --fp8-all-gather is on; its matmuls stay "
                "bf16, so a named baseline prices as in bf16 unless --fp8-all-gather on. For FP8 "
                f"matmuls name the engine that will run the job: --engine {', '.join(ok)}")
    r = recipe or default_recipe(engine)
    lin = ("the blocks' linears at their FP8 speed-up with their casts (the LM head and the "
           "embedding bf16)")
    if family_of(engine) == "te":
        out = (f"FP8 here (Transformer Engine, {r}): {lin}, each weight cast once per step, "
               + ("the tensor-parallel all-gathers in FP8 under sequence parallelism, "
                  if r in TE_FP8_GATHERS else "")
               + ("" if moe else "the distributed optimizer's parameter all-gathers in FP8 "
                  "with --fp8-all-gather on (its FP8 weights then the parameters), ")
               + "and TE's FP8 saved inputs and cached FP8 weights in memory")
    elif r == "tensorwise":
        out = (f"FP8 here (torchao, tensorwise): {lin}, any tensor-parallel all-gathers in FP8"
               + ("" if moe else ", and the FSDP all-gathers in FP8 where a strategy has fp8ag "
                  "or --fp8-all-gather is on"))
    else:
        out = (f"FP8 here (torchao, {r}): {lin}; every collective in bf16 (torchao gathers "
               f"{r} weights and activations in bf16)")
    return out + ((TE_MOE_NOTE if runs_as(engine) == "megatron" else MOE_NOTE) if moe else "")
