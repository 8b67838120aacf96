"""The rounds of solves: ``solve_models``, the planner's solve over the ILP models of every
tensor-parallel degree, runs the choice rule (solver/choice.py, ``choose``) with each round of
independent solves (one per model) in a thread pool (``_mapper``: HiGHS runs without the GIL),
stdout silenced once for the whole batch (session.quiet_stdout).
"""

from __future__ import annotations

import contextlib
import os
import time as _time
from collections.abc import Callable
from typing import TYPE_CHECKING

from amsp_planner.solver.choice import choose
from amsp_planner.solver.session import quiet_stdout
from amsp_planner.solver.solution import IlpSolution, IlpStats
from amsp_planner.solver.space import FASTEST, Preference

if TYPE_CHECKING:
    from amsp_planner.solver.ilp import StrategyIlp


def solve_models(models: list[StrategyIlp], runners_up: int = 0,
                 preference: Preference = FASTEST, idle: Callable[[], object] | None = None,
                 bound: bool = True) -> tuple[list[IlpSolution], IlpStats, dict]:
    """The preferred solution over the models (one per tensor-parallel degree, each a part of
    the space), up to `runners_up` more by objective, and the points the choice was made
    against: {'fastest': ..., 'fastest_lossless': ...} where they differ, by the rule of
    ``choice.choose`` (``Preference``, applied across the models as the brute force applies
    it to their union).

    `idle`: work the caller does next that does not depend on the solves (imports for the
    output), run by this thread once while the second round's models solve in the solver
    threads (``_mapper``); not run where there is no such round. `bound`: the choice's
    bounded first round (``choice._first_round``) where it applies; False, every model
    solved (the same choice; for the tests that prove it)."""
    threads = _threads(models)
    t0 = _time.perf_counter()
    with quiet_stdout(), _mapper(threads, idle) as each:
        sols, stats, refs = choose(models, runners_up, preference, each, bound)
    if len(models) > 1:  # the wall time: in threads the models' solves overlap
        stats.solve_time_s = _time.perf_counter() - t0
    return sols, stats, refs


def _threads(models: list[StrategyIlp]) -> int:
    """Solver threads for `models`: one per model up to the CPUs this process may use, HiGHS
    only (each model is its own HiGHS instance, which runs without the GIL; CBC runs as a
    subprocess through PuLP's warnings-filter juggling, which is not thread-safe)."""
    if len(models) < 2 or any(m.solver_name != "highs" for m in models):
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(len(models), cpus))


@contextlib.contextmanager
def _mapper(threads: int, idle: Callable[[], object] | None = None):
    """`each(fn, models)`: {id(m): fn(m) for m in models}, the models solved in `threads`
    threads. The models share nothing (each its own PuLP problem and HiGHS instance), so the
    results are those of the serial loop. In the first round after the first (which builds the
    models: Python work, under the GIL), the calling thread runs `idle` while the round's
    models solve (HiGHS runs without the GIL), and then collects their results; an error in
    `idle` is left to come up again when the caller does that work itself."""
    if threads < 2:
        yield lambda fn, ms: {id(m): fn(m) for m in ms}
        return
    from concurrent.futures import ThreadPoolExecutor

    rounds = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="amsp-ilp") as ex:
        def each(fn, ms):
            nonlocal rounds, idle
            rounds += 1
            if idle is not None and ms and rounds > 1:
                futures = [ex.submit(fn, m) for m in ms]
                work, idle = idle, None
                with contextlib.suppress(Exception):
                    work()
                return {id(m): f.result() for m, f in zip(ms, futures, strict=True)}
            results = ex.map(fn, ms) if len(ms) > 1 else [fn(m) for m in ms]
            return {id(m): r for m, r in zip(ms, results, strict=True)}

        yield each

