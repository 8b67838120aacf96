"""Exports: a plan's strategy in the formats other trainers read (docs/exports.md).

One module per target, each with ``export(job, strategy, memory_limit) -> ExportResult``; a
target that cannot express the plan exports the strategy the cost model rates best among those
it can, and says what differs and what it costs. Nothing here imports torch or deepspeed at
module level (their checks import them inside functions).
"""

from __future__ import annotations

import importlib

from amsp_planner.exports.common import ExportResult

TARGETS = ("deepspeed", "fsdp2", "torchtitan", "internevo", "megatron")


def target_module(name: str):
    """The exporter module of a target name (one of TARGETS)."""
    if name not in TARGETS:
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(f"--to {name}: unknown target: use one of {', '.join(TARGETS)}")
    return importlib.import_module(f"amsp_planner.exports.{name}")


def export(target: str, job, strategy, memory_limit: float | None = None) -> ExportResult:
    """Export `strategy` for `job` to `target`."""
    from amsp_planner.exports.fp8 import pin_recipe, refuse

    if strategy.cp > 1:
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(f"--to {target}: the plan has cp={strategy.cp}: the exports do not "
                            "write context parallelism yet: re-plan without cp=")
    refuse(target_module(target).TARGET, job)  # FP8 plans: one line where the target has none
    if strategy.pp > 1 and target != "megatron":
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(
            f"--to {target}: the plan has pipeline parallelism (pp={strategy.pp}), which this "
            "export does not express: use --to megatron, or re-plan with --pp 1")
    job = pin_recipe(job)
    return target_module(target).export(job, strategy, memory_limit)


__all__ = ["TARGETS", "ExportResult", "export", "target_module"]
