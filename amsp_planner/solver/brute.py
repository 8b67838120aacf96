"""Brute force: evaluate every complete candidate with the cost model (the ILP's test oracle).

Order: fits in memory first, then lowest objective, then least memory per GPU, then the
strategy string (so ties resolve the same way every time).
"""

from __future__ import annotations

from amsp_planner.cost.evaluate import Evaluation, evaluate
from amsp_planner.cost.job import Job
from amsp_planner.solver.space import TIME_RTOL, SearchSpace, objective_value


def rank_key(e: Evaluation, objective: str, best: float | None = None):
    v = objective_value(e, objective)
    if best is not None and v <= best * (1 + TIME_RTOL) + 1e-15:
        v = best
    return (v, e.memory.total, str(e.strategy))


def brute_force(job: Job, space: SearchSpace, memory_limit: float, objective: str = "time",
                top: int = 1) -> list[Evaluation]:
    """The `top` best fitting candidates (empty when none fits)."""
    schedules: dict = {}  # one schedule per sharding and micro-batch: checkpointing moves no bytes
    fits = [e for e in (evaluate(job, s, memory_limit, schedules) for s in space.candidates(job))
            if e.fits]
    if not fits:
        return []
    best = min(objective_value(e, objective) for e in fits)
    fits.sort(key=lambda e: rank_key(e, objective, best))
    return fits[:top]

