"""The solver session: one PuLP problem solved again and again as the choice rule changes its
objective, bounds and rows, and the silencing of what solver libraries print.

A session has two methods, ``solve(prob, make_solver) -> PuLP status``, which solves the
problem as it is now (with a solver object from `make_solver` where it needs a new one) and
leaves the solution in the PuLP variables (``pulp.value`` works as after ``prob.solve``), and
``relaxation(prob, make_solver)``, a lower bound of the optimum from the LP relaxation (HiGHS;
-inf elsewhere: no bound), and one attribute, ``api`` (the kept solver instance, None until the first solve or where none is
kept). It holds nothing of the model that owns it (no reference cycle):

- ``HighsSession``: one HiGHS instance kept across the problem's re-solves (built once from
  PuLP's own HiGHS interface, then only what changed is passed on: the objective, changed
  bounds, rows added since);
- ``PulpSession``: PuLP's own ``prob.solve`` with a fresh solver each time (CBC, which runs as
  a subprocess, or any other PuLP solver).

``open_session`` picks one by the solver's name; ``pulp_solver`` makes the PuLP solver object
with the options both use (optimality proven: gap 0; ``HIGHS_SPEED``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Protocol

_quieted = False  # whether a quiet_stdout is active (one redirection for a threaded batch)


@contextlib.contextmanager
def quiet_stdout():
    """Silence what the solver library prints on file descriptor 1 (HiGHS's banner). Inside
    an active one (a solve in a batch already silenced, possibly in another thread) it does
    nothing: file descriptor 1 is process-wide, so the threads of a batch must not swap it
    under each other. Only the outermost use sets and clears the flag, after its threads are
    joined (``rounds.solve_models``)."""
    global _quieted
    if _quieted:
        yield
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real stdout (embedded use)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    _quieted = True
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        _quieted = False
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


HIGHS_SPEED = {"mip_heuristic_effort": 0.0, "mip_allow_restart": False,
               "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
               "mip_heuristic_run_root_reduced_cost": False,
               "mip_heuristic_run_feasibility_jump": False, "presolve": "off"}
"""HiGHS options for these small models (about 60 binaries): its sub-MIP heuristics and root
restarts took most of the time without improving the incumbent; off, a solve is about 5x
faster (bench/planner.py), and optimality is still proven (gap 0). The feasibility-jump
heuristic, which runs before the root LP, off: the root LP's rounding finds the incumbent
(the root bound is within about 1 %, ``step_rows``' micro-batch cuts); about 20 % less per solve.
Presolve off: on these models, whose relaxation is tight (the micro-batch cuts, hpZ without
big-M), HiGHS's MIP presolve took most of a solve (50 of 56 ms on llama-7b/1024's first) and
removed only a tenth of the rows; without it the degrees' first solves take half as long."""



def pulp_solver(pulp, name: str, time_limit_s: float):
    """The PuLP solver object for `name` ('highs' or 'cbc'), proving optimality (gap 0)."""
    if name == "highs":
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=0.0,
                          threads=1, mip_feasibility_tolerance=1e-9,
                          primal_feasibility_tolerance=1e-9, **HIGHS_SPEED)
    if name == "cbc":
        with warnings.catch_warnings():  # PuLP 3.3 announces the bundled CBC's removal in 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=0.0)
    raise ValueError(f"unknown solver {name}")


class Session(Protocol):
    """A solver kept for one PuLP problem across its re-solves (module docstring)."""

    api: object | None

    def solve(self, prob, make_solver: Callable[[], object]) -> int:
        """Solve `prob` as it is now; the PuLP status, the solution in its variables."""

    def relaxation(self, prob, make_solver: Callable[[], object]) -> float | None:
        """A lower bound of `prob`'s optimum (its LP relaxation's; -inf: none), None when
        `prob` is infeasible."""


class PulpSession:
    """PuLP's own path: a fresh solver from `make_solver` at every solve (CBC)."""

    def __init__(self, pulp):
        self.api = None

    def solve(self, prob, make_solver: Callable[[], object]) -> int:
        return prob.solve(make_solver())

    def relaxation(self, prob, make_solver: Callable[[], object]) -> float | None:
        """No bound from this path (-inf): every part is solved."""
        return float("-inf")


class HighsSession:
    """One HiGHS instance kept across the problem's re-solves: built once (PuLP's own HiGHS
    interface: columns, rows, integrality), then only what a re-solve changes is passed on (the
    objective, changed bounds, rows added since: the choice rule's caps are variables' bounds,
    a no-good cut is a new row). PuLP's `prob.solve` would rebuild the whole HiGHS model from
    Python each time. The solution is read back into the PuLP variables by column index."""

    def __init__(self, pulp):
        self.pulp = pulp
        self.api = None
        self.cutoff: float | None = None
        """An upper bound on the objective for the next solves (HiGHS's ``objective_bound``:
        branches whose bound is above it are cut); None: none. A problem whose optimum is
        above it is answered infeasible."""

    def _ready(self, prob, make_solver: Callable[[], object]):
        """The HiGHS instance with `prob` as it is now (built at the first call, else the
        changes passed on) and its objective set; the instance's PuLP solver object."""
        api = self.api
        if api is None:
            api = self.api = make_solver()
            api.createAndConfigureSolver(prob)
            api.buildSolverModel(prob)
            self._cols = prob.variables()
            assert [v.index for v in self._cols] == list(range(len(self._cols)))
            import highspy

            self._optimal = highspy.HighsModelStatus.kOptimal
            self._bounds = [(v.lowBound, v.upBound) for v in self._cols]
            self._rows = prob.numConstraints()
        else:
            self._sync(prob)
        h = prob.solverModel
        sign = -1 if prob.sense == self.pulp.LpMaximize else 1  # as PuLP's own build: the
        h.changeColsCost(len(self._cols), list(range(len(self._cols))),  # constant left out
                         [sign * prob.objective.get(v, 0.0) for v in self._cols])
        return api

    def relaxation(self, prob, make_solver: Callable[[], object]) -> float | None:
        """The optimum of `prob`'s LP relaxation (every integer column continuous; the
        objective's constant included), a lower bound of the problem's optimum when it
        minimises; None when the relaxation is infeasible (so is the problem), -inf when HiGHS
        ends otherwise. The columns' integrality is restored and the solver's solution and
        basis cleared after, so the next solve starts as it would have without this one."""
        import highspy

        self._ready(prob, make_solver)
        h = prob.solverModel
        n = len(self._cols)
        kinds = list(h.getLp().integrality_)
        if kinds:
            h.changeColsIntegrality(n, list(range(n)), [highspy.HighsVarType.kContinuous] * n)
        try:
            h.run()
            status = h.getModelStatus()
            value = h.getInfo().objective_function_value
        finally:
            if kinds:
                h.changeColsIntegrality(n, list(range(n)), kinds)
            h.clearSolver()
        if status == highspy.HighsModelStatus.kInfeasible:
            return None
        if status != self._optimal:
            return float("-inf")
        return value + (prob.objective.constant or 0.0)

    def solve(self, prob, make_solver: Callable[[], object]) -> int:
        api = self._ready(prob, make_solver)
        h = prob.solverModel
        inf = float("inf")
        if self.cutoff is not None:  # in HiGHS's terms: the objective's constant left out
            h.setOptionValue("objective_bound", self.cutoff - (prob.objective.constant or 0.0))
        try:
            api.callSolver(prob)
        finally:
            if self.cutoff is not None:
                h.setOptionValue("objective_bound", inf)
        if h.getModelStatus() == self._optimal:  # the values by column index, as PuLP reads
            for v, x in zip(self._cols, h.getSolution().col_value, strict=True):  # them back
                v.varValue = x  # (without listing the problem's variables at every solve)
            status, sol_status = self.pulp.LpStatusOptimal, self.pulp.LpSolutionOptimal
        else:  # PuLP's own mapping of every other status
            status, sol_status = api.findSolutionValues(prob)
        prob.assignStatus(status, sol_status)
        return status

    def _sync(self, prob) -> None:
        """Pass the bounds changed and the rows added since the last solve to HiGHS."""
        h, inf = prob.solverModel, float("inf")
        changed = [(i, v.lowBound, v.upBound) for i, v in enumerate(self._cols)
                   if (v.lowBound, v.upBound) != self._bounds[i]]
        for i, lo, up in changed:
            h.changeColBounds(i, -inf if lo is None else lo, inf if up is None else up)
            self._bounds[i] = (lo, up)
        if prob.numVariables() != len(self._cols):
            raise AssertionError("a variable was added after the HiGHS model was built")
        if prob.numConstraints() == self._rows:
            return
        for c in prob.constraints()[self._rows:]:  # in the order added (PuLP 3.3 and 4)
            items = [(v.index, a) for v, a in c.items() if a != 0]
            lo, up = c.getLb(), c.getUb()
            h.addRow(-inf if lo is None else lo, inf if up is None else up, len(items),
                     [i for i, _ in items], [a for _, a in items])
            c.index = self._rows
            self._rows += 1


def open_session(pulp, name: str) -> Session:
    """The session for solver `name`: HiGHS kept across re-solves, any other through PuLP."""
    return (HighsSession if name == "highs" else PulpSession)(pulp)
