"""One job's ILP at one tensor-parallel degree (``StrategyIlp``): the formulation
(solver/formulation.py, its step rows in solver/step_rows.py) over the coefficient tables
(solver/tables.py), solved through a session (solver/session.py: HiGHS kept across re-solves,
or CBC), and the solve steps the choice rule takes on it (``_fastest``, ``_tie_break``,
``_next_runner_up``, ...). The rule itself, across the models of every degree, is
solver/choice.py's; its rounds of solves, in threads, solver/rounds.py's (``solve_models``).

The choice, for one model (``Preference``, docs/planner.md): minimise step (or comm); when
that optimum is quantized and the rule is "auto", again with xPq = xGq = 0, and keep the
quantized optimum only if it is faster beyond the band; then with the objective capped at the
band's edge (cap = best (1 + band)) minimise each tie-break in turn (groups = sum_k u_k +
[N > 1], then the step, then memory), each capped at its optimum for the next; last, with the decision
binaries fixed, minimise step again (an LP: the stage variables are only bounded below, so
under another objective they float). The memory constraint uses the limit less the headroom.
Runners-up come from no-good cuts on the decision binaries. Every solution is decoded,
re-evaluated with the cost model, and both must agree (``solve.check_agreement``).
"""

from __future__ import annotations

import threading
import time as _time

from amsp_planner.cost.communicators import process_groups
from amsp_planner.cost.job import Job
from amsp_planner.solver.choice import PHASE2_RTOLS
from amsp_planner.solver.formulation import Formulation
from amsp_planner.solver.rounds import solve_models
from amsp_planner.solver.session import open_session, pulp_solver, quiet_stdout
from amsp_planner.solver.solution import IlpSolution, IlpStats, SolverError
from amsp_planner.solver.space import (
    FASTEST,
    GROUPS,
    MEMORY,
    RECOMPUTE,
    STEP,
    Preference,
    SearchSpace,
)
from amsp_planner.solver.tables import GIB, compute_bound, tables_for

__all__ = ["GIB", "PHASE2_RTOLS", "IlpSolution", "IlpStats", "SolverError", "StrategyIlp",
           "solve_models"]

_BUILDING = threading.Lock()  # StrategyIlp.build: one model built at a time


class StrategyIlp(Formulation):
    """The PuLP model of one job; `solve()` returns the best strategy and runners-up."""

    def __init__(self, job: Job, space: SearchSpace, memory_limit: float,
                 objective: str = "time", solver: str = "highs", time_limit_s: float = 30.0,
                 *, defer: bool = False):
        """`defer`: the tables and the model are made by ``build()``, at the latest by the first
        solve (``solve_models`` then builds each model in its solver thread, while the models
        built before it solve)."""
        import pulp

        self.pulp = pulp
        self.job, self.space, self.objective = job, space, objective
        self.memory_limit = memory_limit
        self.solver_name = solver
        self.time_limit_s = time_limit_s
        self.built = False
        if not defer:
            self.build()

    def build(self) -> None:
        """The tables and the model, one model at a time (``_BUILDING``): building is Python
        work under the GIL, so two built at once both finish late; one after the other, the
        first starts solving (without the GIL) while the next is built."""
        with _BUILDING:
            if not self.built:
                self._build_now()

    def _build_now(self) -> None:
        pulp = self.pulp
        t0 = _time.perf_counter()
        self.T = tables_for(self.job, self.space)
        self._session = open_session(pulp, self.solver_name)
        self.prob = pulp.LpProblem("amsp_strategy", pulp.LpMinimize)
        self._build()
        self.stats = IlpStats(solver=self.solver_name, build_time_s=_time.perf_counter() - t0,
                              num_variables=self.prob.numVariables(),
                              num_constraints=self.prob.numConstraints())
        self.built = True

    # ----- solving ----------------------------------------------------------------------------
    def _solver(self):
        """A fresh PuLP solver object for this model's solver (``session.pulp_solver``)."""
        return pulp_solver(self.pulp, self.solver_name, self.time_limit_s)

    @property
    def _api(self):
        """The kept HiGHS instance (None before the first solve, and with CBC)."""
        return self._session.api

    def _run(self) -> int:
        """Solve the problem as it is now (stdout silenced, timed, counted); the PuLP status,
        infeasible or optimal (anything else: ``SolverError``)."""
        pulp = self.pulp
        t0 = _time.perf_counter()
        with quiet_stdout():
            if self.solver_name == "highs":
                status = self._run_highs()
            else:
                status = self._session.solve(self.prob, self._solver)
        self.stats.solve_time_s += _time.perf_counter() - t0
        self.stats.solves += 1
        self.stats.status = pulp.LpStatus[status]
        if status == pulp.LpStatusInfeasible:
            return status
        if status != pulp.LpStatusOptimal or self.prob.sol_status != pulp.LpSolutionOptimal:
            found = self.prob.sol_status in (pulp.LpSolutionIntegerFeasible,
                                             pulp.LpSolutionOptimal)
            raise SolverError(
                f"{self.solver_name} stopped at its time limit "
                f"({'a plan found but not proved the best' if found else 'no plan found'}, "
                f"after {self.stats.solve_time_s:.2f} s of solving): raise --time-limit, or try "
                f"--solver {'highs' if self.solver_name == 'cbc' else 'cbc'} or --solver "
                "exhaustive"
                if found or status == pulp.LpStatusNotSolved else
                f"{self.solver_name} stopped without proving optimality (solver status "
                f"{pulp.LpStatus[status]}): raise --time-limit, or try --solver "
                f"{'highs' if self.solver_name == 'cbc' else 'cbc'}"
            )
        return status

    def _run_highs(self) -> int:
        """One solve in the kept HiGHS instance (``session.HighsSession``)."""
        return self._session.solve(self.prob, self._solver)

    def _solution(self) -> IlpSolution:
        ones = tuple(v for v in self._decision_vars() if (self.pulp.value(v) or 0) > 0.5)
        s = self._decode()
        return IlpSolution(s, self._objective(), self._memory(), self.stats.status, ones,
                           process_groups(s, self.job.num_gpus, self.job.gpus_per_node))

    def _exact_solution(self, decision: dict) -> IlpSolution:
        """`decision` (binary -> 0/1) with its exact objective: the stage variables are only
        bounded below, so under another objective they may float up; with the decision binaries
        fixed, minimising the objective brings them down to the model's values (an LP)."""
        fixed = [(v, v.lowBound, v.upBound) for v in decision]
        for v, x in decision.items():
            v.lowBound = v.upBound = x
        self.prob.setObjective(self.step_expr)
        saved = {c: c.upBound for c in (self.cap, *self.caps.values())}
        for c in saved:
            c.upBound = None
        try:
            self._run()
            return self._solution()
        finally:
            for c, ub in saved.items():
                c.upBound = ub
            for v, lo, up in fixed:
                v.lowBound, v.upBound = lo, up

    def _run_capped(self, cap, value: float, rtols: tuple[float, ...]) -> bool:
        """Solve the current objective with `cap` at `value`, the relative slack `rtols` tried
        in turn (HiGHS does not always re-attain a previous optimum to 1e-9: its feasibility
        tolerance is 1e-7). False when none holds."""
        for rtol in rtols:
            cap.upBound = value + abs(value) * rtol + 1e-12
            if self._run() != self.pulp.LpStatusInfeasible:
                return True
        return False

    def solve(self, runners_up: int = 0, preference: Preference = FASTEST
              ) -> tuple[list[IlpSolution], IlpStats, dict]:
        """The preferred solution of this model alone (``solve_models``)."""
        return solve_models([self], runners_up, preference)

    # ----- steps of the choice, for one model or several (``solve_models``) ------------------
    def _fastest(self) -> IlpSolution | None:
        self.build()
        self.prob.setObjective(self.step_expr)
        if self._run() == self.pulp.LpStatusInfeasible:
            return None
        return self._solution()

    def compute_bound(self) -> float:
        """A lower bound (seconds) of this model's objective without building it: with the
        time objective the least compute per step of its activation options
        (``tables.compute_bound``), else -inf (none)."""
        if self.objective != "time":
            return float("-inf")
        return compute_bound(self.job, self.space)

    def lower_bound(self) -> float | None:
        """A lower bound (seconds) of this model's objective, fastest, from its LP relaxation
        (``Session.relaxation``; -inf where the solver gives none); None when the relaxation
        is infeasible, and so the model. Timed with the solves, not counted as one."""
        self.build()
        self.prob.setObjective(self.step_expr)
        t0 = _time.perf_counter()
        with quiet_stdout():
            value = self._session.relaxation(self.prob, self._solver)
        self.stats.solve_time_s += _time.perf_counter() - t0
        return None if value is None else value * self.T.time_unit

    def fastest_below(self, limit_s: float) -> IlpSolution | None:
        """The fastest (``_fastest``) if its objective is at most `limit_s` seconds, else
        None (as when there is none): HiGHS cuts the branches whose bound is above the limit,
        much faster than proving an optimum beyond it. What it returns above the limit (an
        incumbent found before the cut) need not be the optimum, only proof that none is at
        or below the limit: it is dropped. Without a kept HiGHS instance (CBC), the fastest
        solved in full, the same test."""
        self.build()
        session = self._session
        if hasattr(session, "cutoff"):
            session.cutoff = limit_s / self.T.time_unit
        try:
            sol = self._fastest()
        finally:
            if hasattr(session, "cutoff"):
                session.cutoff = None
        return sol if sol is not None and sol.objective <= limit_s else None

    def _fix_lossless(self, on: bool) -> None:
        for v in self._quant_vars():
            v.upBound = 0 if on else None

    def _tie_break(self, name: str, pending) -> float | None:
        """Minimise tie-break `name` under the caps in `pending` (cap, value, rtols); its
        optimum, or None when no slack holds. Keeps the decision in ``snapshot``."""
        expr = {RECOMPUTE: self.recompute_expr, GROUPS: self.groups_expr,
                STEP: self.step_expr, MEMORY: self.mem_expr}[name]
        self.prob.setObjective(expr)
        if not self._run_capped(*pending):
            return None
        value = self.pulp.value
        self.snapshot = {v: round(value(v) or 0) for v in (*self._decision_vars(),
                                                            *self.k.values())}
        return value(expr)

    def _next_runner_up(self, excluded: IlpSolution) -> IlpSolution | None:
        """The best solution by objective once `excluded` is cut off (a no-good cut)."""
        pulp = self.pulp
        ones = {v.name for v in excluded.decision}
        self.prob += pulp.lpSum(1 - v if v.name in ones else v
                                for v in self._decision_vars()) >= 1, f"exclude_{self.cuts}"
        self.cuts += 1
        if self._run() == pulp.LpStatusInfeasible:
            return None
        return self._solution()

    def _release(self) -> None:
        """Back to the objective alone: no caps, quantization allowed."""
        for cap in (self.cap, *self.caps.values()):
            cap.upBound = None
        self._fix_lossless(False)
        self.prob.setObjective(self.step_expr)

