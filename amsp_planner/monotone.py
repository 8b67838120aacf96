"""Monotone what-if sweeps: more of a resource is never slower (docs/whatif.md).

Along an axis where physics says more is never slower (NIC and NVLink bandwidth, memory; less
latency and oversubscription), every strategy's predicted step time is non-increasing and
every strategy that fits keeps fitting, so the fastest candidate's step time is non-increasing
too. The planner's rule does not pick the fastest: inside the tie band it trades speed for
lossless numerics, less recompute and fewer process groups. And no rule that
decides each point on its own can keep a sweep monotone while it ever takes a slower candidate
inside the band: with two candidates, a preferred one A and a faster one B, a point where A is
beyond the band takes B, a point with more bandwidth where A has come inside the band takes A,
and A there may still be slower than B was before.

So the sweep applies the rule with what it knows: the choice at a point with less of the
resource is a plan that runs at the next point too (it fits, and it is no slower there), and
it becomes that point's ``Preference.ceiling``. Each point is first solved on its own, as
``amsp plan`` would; where its choice is slower than the previous point's choice evaluated at
it, the point is solved again under that ceiling, and its row says so (``Row.reason``). The
rows are then non-decreasing in tokens/s along the axis, and a point differs from ``amsp plan``
only where ``amsp plan`` would choose a plan slower than one the sweep has shown to run there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MORE_IS_FASTER = {
    "set:nic_gbit_per_s": 1, "set:node_gbit_per_s": 1, "set:nics_per_node": 1,
    "set:intra_gbyte_per_s": 1, "set:gpu.hbm_gbyte_per_s": 1,
    "memory_limit_gib": 1, "set:gpu.memory_gib": 1,
    "set:oversubscription": -1, "set:inter_latency_us": -1, "set:intra_latency_us": -1,
}
"""Axes along which more (1) or less (-1) is never slower, physically and in the cost model."""

ROUNDS = 3
"""Passes over the axes (a point solved again along one axis can slow another's line)."""


def monotone_axes(sweep) -> list[tuple[str, int]]:
    """The sweep's varying axes along which more (1) or less (-1) is never slower."""
    if sweep.options.objective not in ("time", "comm"):
        return []
    return [(a, MORE_IS_FASTER[a]) for a in sweep.varying() if a in MORE_IS_FASTER]


def groups(points: list, axes: list[tuple[str, int]]) -> list[list]:
    """`points` in groups that share every value but the monotone axes' (each group is what
    ``enforce`` needs at once), in the order of their first point."""
    names = {a for a, _ in axes}
    out: dict[tuple, list] = {}
    for p in points:
        out.setdefault(tuple(kv for kv in p.values if kv[0] not in names), []).append(p)
    return list(out.values())


def _objective(e, objective: str) -> float:
    return e.step_s if objective == "time" else e.time.comm_total_s


def _lines(rows: list, axis: str, sign: int) -> list[list]:
    """The rows along `axis` (every other axis fixed), from the least of the resource up."""
    out: dict[tuple, list] = {}
    for r in rows:
        key = tuple((k, v) for k, v in r.point.values if k != axis)
        out.setdefault(key, []).append(r)
    return [sorted(line, key=lambda r: sign * r.point.get(axis)) for line in out.values()]


def _value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def enforce(opt, axes: list[tuple[str, int]], rows: list, solve_again: Callable,
            build_job: Callable) -> list:
    """`rows` (whole ``groups``) with every point along a monotone axis no slower than the
    choice at the point before it (module docstring). `solve_again(point, ceiling)`: the
    point's row under ``Preference.ceiling`` = `ceiling` seconds of the objective;
    `build_job(point, opt)`: the point's (Job, memory limit) (``whatif.build_point_job``,
    passed in so that this module does not import the sweep that imports it). Run where
    the rows were solved, so that the enumeration's tables of their jobs are still cached."""
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.errors import AmspUserError
    from amsp_planner.strategy import parse_strategy_or_baseline
    if not axes:
        return rows
    rows = list(rows)
    index = {r.point.index: i for i, r in enumerate(rows)}
    for _ in range(ROUNDS):
        changed = False
        for axis, sign in axes:
            for line in _lines(rows, axis, sign):
                prev = None
                for r in line:
                    r = rows[index[r.point.index]]
                    if not r.ok:
                        prev = None
                        continue
                    if prev is not None:
                        job, limit = build_job(r.point, opt)
                        try:
                            ref = evaluate(job, parse_strategy_or_baseline(
                                prev.strategy, job.num_gpus, job.gpus_per_node),
                                opt.preference(job).usable(limit))
                        except AmspUserError:
                            ref = None
                        own = r.step_s if opt.objective == "time" else (
                            None if ref is None else _objective(evaluate(
                                job, parse_strategy_or_baseline(r.strategy, job.num_gpus,
                                                                job.gpus_per_node), limit),
                                opt.objective))
                        if ref is not None and ref.fits and _objective(ref, opt.objective) < \
                                own * (1 - 1e-9):
                            again = solve_again(r.point, _objective(ref, opt.objective))
                            if again.ok:
                                again.reason = (
                                    f"kept no slower than the choice at {axis.removeprefix('set:')}"
                                    f"={_value(prev.point.get(axis))} ({prev.strategy}), which "
                                    f"runs here: alone this point would take {r.strategy}, "
                                    f"{1 - r.tokens_per_s / ref.tokens_per_s:.1%} slower "
                                    "(inside the band)")
                                rows[index[r.point.index]] = again
                                r, changed = again, True
                    prev = r
        if not changed:
            break
    return rows
