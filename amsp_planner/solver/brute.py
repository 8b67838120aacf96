"""Brute force: evaluate every complete candidate with the cost model (the ILP's test oracle).

The order is the planner's (``Preference``, docs/planner.md): candidates that fit with the
rule's headroom (and under its ceiling, if any); lossless ones unless a quantized one is
faster beyond the band; those within the band of the fastest admissible one, quantized or
not; then each tie-break in turn (least recompute, fewest process groups, lowest objective,
least memory); then the lowest objective and the strategy string, so ties resolve the same way
every time.
"""

from __future__ import annotations

from amsp_planner.cost.communicators import process_groups
from amsp_planner.cost.compute import recompute_s
from amsp_planner.cost.evaluate import Evaluation, evaluate
from amsp_planner.cost.job import Job
from amsp_planner.solver.space import (
    FASTEST,
    GROUPS,
    RECOMPUTE,
    STEP,
    TIME_RTOL,
    Preference,
    SearchSpace,
    objective_value,
    tie_rtol,
)


def criterion(job: Job, e: Evaluation, name: str) -> float:
    """A tie-break's value for one candidate (lower is preferred)."""
    if name == GROUPS:
        return float(process_groups(e.strategy, job.num_gpus, job.gpus_per_node))
    if name == RECOMPUTE:
        s = e.strategy
        return recompute_s(job, s.micro_batch, s.ckpt_value, s.tp, s.ep)
    return e.memory.total


def within(v: float, best: float, rtol: float) -> bool:
    return v <= best * (1 + rtol) + 1e-15


def preferred_order(job: Job, fits: list[Evaluation], objective: str,
                    pref: Preference = FASTEST) -> list[Evaluation]:
    """`fits` (candidates that fit under the rule's usable memory) in the rule's order: the
    chosen one first, then the rest of its tie class, then everything else by objective."""
    if not fits:
        return []
    fits = [e for e in fits if pref.under_ceiling(objective_value(e, objective))]
    if not fits:
        return []
    admissible = fits
    t_all = min(objective_value(e, objective) for e in fits)
    if pref.quantization == "auto":
        lossless = [e for e in fits if not e.strategy.quantized]
        if lossless:
            t_lossless = min(objective_value(e, objective) for e in lossless)
            if not t_lossless > t_all * (1 + pref.band) * (1 + TIME_RTOL):
                admissible = lossless
    # the band above the fastest admissible candidate, quantized or not
    tie = [e for e in admissible
           if within(objective_value(e, objective), t_all, pref.band + TIME_RTOL)]
    for name in pref.tie_breaks:
        def value(e, name=name):
            return objective_value(e, objective) if name == STEP else criterion(job, e, name)

        least = min(value(e) for e in tie)
        tie = [e for e in tie if value(e) <= least * (1 + tie_rtol(name)) + 1e-12]
    tie.sort(key=lambda e: (objective_value(e, objective), e.memory.total, str(e.strategy)))
    chosen = set(id(e) for e in tie)
    rest = sorted((e for e in fits if id(e) not in chosen),
                  key=lambda e: (objective_value(e, objective), e.memory.total, str(e.strategy)))
    return tie + rest


def brute_force(job: Job, space: SearchSpace, memory_limit: float, objective: str = "time",
                top: int = 1, preference: Preference = FASTEST) -> list[Evaluation]:
    """The `top` best fitting candidates under `preference` (empty when none fits)."""
    usable = preference.usable(memory_limit)
    schedules: dict = {}  # one schedule per sharding and micro-batch (evaluate's cache)
    fits = [e for e in (evaluate(job, s, usable, schedules) for s in space.candidates(job))
            if e.fits]
    return preferred_order(job, fits, objective, preference)[:top]
