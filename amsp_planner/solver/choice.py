"""The choice rule across tensor-parallel degrees (``choose``): which solution of the ILP
models (one per degree, solver/ilp.py) the planner takes, by ``Preference`` (docs/planner.md).

The rule is applied across the models as the brute force (solver/brute.py) applies it to the
union of their spaces:

1. the fastest over all (each model's fastest: one round of solves), under
   ``Preference.ceiling`` when one is set; with a mixture of experts' many parts, in the
   order of each model's LP-relaxation bound, a model whose bound is beyond the band above
   the fastest found left unsolved (``_first_round``: it cannot matter to steps 1-4);
2. with quantization "auto" and a quantized fastest: lossless unless the fastest quantized
   solution beats the fastest lossless of all by more than the band (then every model is
   restricted to lossless solutions); a model whose fastest is beyond the best lossless found
   is not re-solved lossless, its fastest standing as its lower bound;
3. the band's cap above the fastest admissible objective (the fastest of step 1, quantized or
   not, so that no choice is slower than any admissible candidate beyond the band; at most
   ``Preference.ceiling``), a model whose admissible optimum is beyond the band's edge
   dropped; each tie-break (``Preference.tie_breaks``) minimised in every model still in the
   race under the caps, the models above the least value dropped and the caps set to it (a
   criterion the admissible optimum already has at its least takes no solve; a model whose
   least number of process groups is above the least found, no groups solve);
4. the chosen: the exact solution of the models left, the lowest (objective, memory,
   strategy); runners-up by objective alone from no-good cuts on the owner and the other
   models' fastest.

With one model this is the sequence of lexicographic re-solves of solver/ilp.py's docstring.
Every round of independent solves (one per model) goes through `each` (solver/rounds.py), so
the rule does not depend on how the rounds run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from amsp_planner.solver.solution import IlpSolution, IlpStats, merged_stats
from amsp_planner.solver.space import (
    CEILING_RTOL,
    GROUPS,
    RECOMPUTE,
    STEP,
    TIME_RTOL,
    Preference,
    tie_rtol,
)

if TYPE_CHECKING:
    from amsp_planner.solver.ilp import StrategyIlp

PHASE2_RTOLS = (TIME_RTOL, 1e-6)
"""Relative slack on the step time while phase 2 minimises memory, tried in turn."""

LOSSLESS_BATCH = 2
"""Lossless re-solves started together (in parallel where there are threads). A fixed number,
not the thread count: which models are solved (and the solve count a plan file records) must
not depend on the machine."""

CUT = 3
"""A model's stage in a bounded first round once its fastest is known to be beyond the band's
edge (solved with that edge as HiGHS's objective bound: none at or below it)."""

BOUND_BATCH = 2
"""Models solved together in a bounded first round (``_first_round``), in the order of their
bounds; fixed, as LOSSLESS_BATCH, so that which models are solved does not depend on the
machine."""

PRUNE_RTOL = 1e-5
"""Relative margin of a bound over the band's edge before a model is left unsolved: above the
rule's own slacks (TIME_RTOL, PHASE2_RTOLS, CEILING_RTOL: at most 1e-6) and the LP's
tolerances (1e-9)."""

Each = Callable[[Callable, list], dict]
"""`each(fn, models)`: {id(m): fn(m) for m in models}, one round of solves (rounds._mapper)."""


def _stats(models: list[StrategyIlp], owner: StrategyIlp | None = None) -> IlpStats:
    """The statistics of the models built (a bounded first round may leave some unbuilt)."""
    return merged_stats([m.stats for m in models if m.built], owner.stats if owner else None)


def _fastest(m: StrategyIlp, ceiling: float | None = None, below: float | None = None
             ) -> IlpSolution | None:
    """The model's fastest, under `ceiling` (seconds) when one is set (``Preference.ceiling``:
    the objective capped through the tie-breaks' cap variable until the rule sets it); with
    `below` (seconds), None when it is above that (``StrategyIlp.fastest_below``)."""
    if ceiling is not None:
        m.build()
        m.cap.upBound = ceiling / m.T.time_unit * (1 + CEILING_RTOL)
    return m._fastest() if below is None else m.fastest_below(below)


def _bounded(models: list[StrategyIlp]) -> bool:
    """Whether the first round bounds the models (``_first_round``): a mixture of experts'
    parts (one per expert-parallel degree and placement, up to about 20). A dense job's parts
    (one per TP degree, at most a few) are all solved, as before, so its plan files (their
    solve counts) stand."""
    return len(models) > 1 and all(m.space.expert_factors for m in models)


def _first_round(models: list[StrategyIlp], preference: Preference, each: Each,
                 bound: bool = True) -> tuple[dict, dict]:
    """Each model's fastest ({id: solution or None}) where it may matter to the rule, and the
    models left unsolved ({id: (model, lower bound)}).

    Bounded (``_bounded``), best first: each model starts with a bound of its fastest that
    needs no model built (``StrategyIlp.compute_bound``: the least compute per step), then
    its LP relaxation's (``StrategyIlp.lower_bound``, which builds it; None: infeasible, no
    solution), then its fastest, once one is found only at or below the band's edge
    (``StrategyIlp.fastest_below``: none there, and the model is beyond it); each round takes
    the BOUND_BATCH models of the least current bound one step further. A model whose bound
    is beyond the band above the fastest found (times 1 + PRUNE_RTOL) is not taken further:
    its fastest is beyond the band's edge of every later step of the rule (the fastest of
    all is at most the fastest found), so it is neither the fastest, nor the best lossless
    admitted by the band, nor in the band's race; it only enters the runners-up
    (``_runners_up`` solves it there when its bound is below what is left). Unbounded (or `bound` False): one round, every model."""
    def fast(m):
        return _fastest(m, preference.ceiling)

    if not (bound and _bounded(models)):
        return each(fast, models), {}
    low = {id(m): m.compute_bound() for m in models}
    stage = {id(m): 0 for m in models}  # 0: compute bound, 1: LP bound, 2: solved, CUT
    fastest: dict = {}
    pos = {id(m): i for i, m in enumerate(models)}
    edge = None
    while True:
        todo = sorted((m for m in models if stage[id(m)] < 2),
                      key=lambda m: (low[id(m)], pos[id(m)]))
        found = [v.objective for v in fastest.values() if v is not None]
        if found:
            edge = min(found) * (1 + preference.band) * (1 + PRUNE_RTOL)
            todo = [m for m in todo if low[id(m)] <= edge]
        if not todo:
            break
        batch = todo[:BOUND_BATCH]
        lp = {id(m) for m in batch if stage[id(m)] == 0}

        def step(m, edge=edge):
            if stage[id(m)] == 0:
                return m.lower_bound()
            return _fastest(m, preference.ceiling, edge)

        got = each(step, batch)
        for m in batch:
            stage[id(m)] += 1
            if id(m) in lp:
                if got[id(m)] is None:  # the relaxation is infeasible: so is the model
                    stage[id(m)], fastest[id(m)] = 2, None
                else:
                    low[id(m)] = max(low[id(m)], got[id(m)])
            elif got[id(m)] is None and edge is not None:  # none at or below the edge
                stage[id(m)], low[id(m)] = CUT, max(low[id(m)], edge)
            else:
                fastest[id(m)] = got[id(m)]
    unsolved = {id(m): (m, low[id(m)]) for m in models if stage[id(m)] in (0, 1, CUT)}
    return fastest, unsolved


def _lossless_fastest(m: StrategyIlp) -> IlpSolution | None:
    m._fix_lossless(True)
    try:
        return m._fastest()
    finally:
        m._fix_lossless(False)


def _lossless(alive: list[StrategyIlp], fastest: dict, each: Each) -> tuple[dict, set]:
    """Each model's lossless optimum, in the order of their fastest (a lower bound of it),
    LOSSLESS_BATCH at a time: a model whose fastest is beyond the best lossless found cannot
    hold the best lossless, so it is not solved (its fastest stays its lower bound). The
    lossless optima found ({id: solution or None}) and the ids of the models not solved."""
    order = sorted(alive, key=lambda m: fastest[id(m)].objective)
    lossless = {id(m): fastest[id(m)] for m in order if not fastest[id(m)].strategy.quantized}
    todo = [m for m in order if fastest[id(m)].strategy.quantized]
    skipped = set()
    while todo:
        found = [v.objective for v in lossless.values() if v is not None]
        if found:
            skipped |= {id(m) for m in todo
                        if fastest[id(m)].objective > min(found) * (1 + 1e-9)}
            todo = [m for m in todo if id(m) not in skipped]
        batch, todo = todo[:LOSSLESS_BATCH], todo[LOSSLESS_BATCH:]
        lossless.update(each(_lossless_fastest, batch))
    return lossless, skipped


def _runners_up(models: list[StrategyIlp], owner: StrategyIlp, chosen: IlpSolution,
                fastest: dict, runners_up: int, unsolved: dict, ceiling: float | None
                ) -> list[IlpSolution]:
    """Up to `runners_up` solutions after `chosen` by objective alone: the owner's next from
    no-good cuts; another model's best by objective alone is its fastest (the same problem as
    the first solve: caps released, quantization allowed, no cut in it). A model the first
    round left unsolved (`unsolved`: {id: (model, lower bound)}) is solved when its bound is
    not beyond the best left, so the runners-up are those of every model solved."""
    out: list[IlpSolution] = []
    pool = {id(m): (m, m._next_runner_up(chosen) if m is owner else fastest.get(id(m)))
            for m in models}
    unsolved = dict(unsolved)

    def solve_unsolved(best: float) -> None:
        for key, (m, low) in sorted(unsolved.items(), key=lambda kv: kv[1][1]):
            if low > best * (1 + PRUNE_RTOL):
                break
            del unsolved[key]
            pool[key] = (m, _fastest(m, ceiling))
            m._release()
            best = min(best, pool[key][1].objective if pool[key][1] else best)

    for k in range(runners_up):
        solve_unsolved(min((sol.objective for key, (_, sol) in pool.items()
                            if sol is not None and key not in unsolved), default=float("inf")))
        left = [(m, sol) for key, (m, sol) in pool.items()
                if sol is not None and key not in unsolved]
        if not left:
            break
        m, sol = min(left, key=lambda ms: ms[1].objective)
        out.append(sol)
        pool[id(m)] = (m, m._next_runner_up(sol) if k < runners_up - 1 else None)
    return out


def choose(models: list[StrategyIlp], runners_up: int, preference: Preference, each: Each,
           bound: bool = True) -> tuple[list[IlpSolution], IlpStats, dict]:
    """The preferred solution over `models` and up to `runners_up` more by objective, their
    merged statistics, and the points the choice was made against ({'fastest': ...,
    'fastest_lossless': ...} where they differ): the rule of the module docstring, each round
    of independent solves (one per model) through `each`; `bound` False: every model's
    fastest solved (``_first_round``; the same choice, more solves)."""
    refs: dict = {}
    for m in models:
        m.snapshot, m.cuts = None, 0
    fastest, unsolved = _first_round(models, preference, each, bound)
    alive = [m for m in models if fastest.get(id(m)) is not None]
    if not alive:
        return [], _stats(models), refs

    def best_of(sols: dict) -> tuple[StrategyIlp, IlpSolution]:
        return min(((m, sols[id(m)]) for m in alive if sols.get(id(m)) is not None),
                   key=lambda ms: ms[1].objective)

    owner, chosen = best_of(fastest)
    refs["fastest"] = chosen
    best_obj = chosen.objective
    low = {id(m): fastest[id(m)].objective for m in alive}  # each model's admissible optimum,
    if preference.quantization == "auto":                   # or a lower bound of it
        if chosen.strategy.quantized:
            lossless, skipped = _lossless(alive, fastest, each)
            if any(v is not None for v in lossless.values()):
                lo_owner, lo = best_of(lossless)
                if not lo.objective > best_obj * (1 + preference.band) * (1 + TIME_RTOL):
                    best_obj, owner, chosen = lo.objective, lo_owner, lo
                    refs["fastest_lossless"] = lo
                    alive = [m for m in alive
                             if id(m) in skipped or lossless[id(m)] is not None]
                    for m in alive:
                        m._fix_lossless(True)
                        if id(m) not in skipped:
                            low[id(m)] = lossless[id(m)].objective
        else:  # the fastest is lossless: quantized candidates are not admissible
            for m in alive:
                m._fix_lossless(True)
    # the band's edge: the band above the fastest admissible candidate, quantized or not (so
    # no choice is slower than any of them beyond the band), and at most the ceiling
    top = refs["fastest"].objective * (1 + preference.band)
    if preference.ceiling is not None:
        top = min(top, max(best_obj, preference.ceiling * (1 + CEILING_RTOL)))
    # a model whose admissible optimum is beyond the band's edge has nothing in the band
    edge = top * (1 + PHASE2_RTOLS[-1])
    alive = [m for m in alive if m is owner or low[id(m)] <= edge]
    # lexicographic re-solves inside the band: each tie-break minimised with the objective
    # capped at the band's edge and the earlier tie-breaks at their optimum
    # (objectives compare in seconds across models; each model's cap is in its time unit)
    pending = {id(m): (m.cap, top / m.T.time_unit, PHASE2_RTOLS) for m in alive}
    solved = False  # whether a tie-break solve has held (the chosen is then re-derived)
    for name in preference.tie_breaks:
        floor = min(m.groups_floor for m in alive)
        at_floor = (chosen.groups == floor if name == GROUPS else
                    (name == RECOMPUTE and not chosen.strategy.ckpt_value) or name == STEP)
        if at_floor and not solved:
            # the admissible optimum is already at this criterion's least: no re-solve (the
            # step: no earlier criterion moved the choice off the fastest admissible)
            for m in alive:
                cap, v, rtols = pending[id(m)]
                cap.upBound = v + abs(v) * rtols[0] + 1e-12
                pending[id(m)] = ((m.cap, chosen.objective / m.T.time_unit, PHASE2_RTOLS)
                                  if name == STEP else
                                  (m.caps[name], floor if name == GROUPS else 0.0, (0.0,)))
            if name == GROUPS:  # models that cannot reach it drop (the others fail their solve)
                alive = [m for m in alive if m.groups_floor <= floor]
            continue

        def tie_break(ms, name=name, pending=pending):
            return each(lambda x: x._tie_break(name, pending[id(x)]), ms)

        if name == GROUPS:
            # a model has at least its floor of groups: the models of a floor above the least
            # found cannot tie with it, so they are not solved (levels in increasing order)
            values: dict = {}
            for level in sorted({m.groups_floor for m in alive}):
                found = [v for v in values.values() if v is not None]
                if found and round(min(found)) < level:
                    break
                values.update(tie_break([m for m in alive if m.groups_floor == level]))
        else:
            values = tie_break(alive)
        held = [m for m in alive if values.get(id(m)) is not None]
        if not held:
            break  # no slack holds: the last decision that held stands
        solved = True
        # compared across models in common units: recompute and the step are in each model's
        # time unit
        scale = {id(m): m.T.time_unit if name in (RECOMPUTE, STEP) else 1.0 for m in held}
        least = min(values[id(m)] * scale[id(m)] for m in held)
        if name == GROUPS:
            alive = [m for m in held if round(values[id(m)]) <= round(least)]
            pending = {id(m): (m.caps[name], round(least), (0.0,)) for m in alive}
        else:
            alive = [m for m in held
                     if values[id(m)] * scale[id(m)] <= least * (1 + tie_rtol(name)) + 1e-12]
            pending = {id(m): (m.caps[name], values[id(m)], PHASE2_RTOLS) for m in alive}
    if solved:
        held = [m for m in alive if m.snapshot is not None]
        got = each(lambda m: m._exact_solution(m.snapshot), held)
        exact = [(m, got[id(m)]) for m in held]
        owner, chosen = min(exact, key=lambda ms: (ms[1].objective, ms[1].memory_gib,
                                                   str(ms[1].strategy)))
    # runners-up: exclude each found decision, back to the objective alone
    for m in models:
        if m.built:  # (a model left unsolved may be unbuilt)
            m._release()
    out = [chosen]
    if runners_up:
        out += _runners_up(models, owner, chosen, fastest, runners_up, unsolved,
                           preference.ceiling)
    return out, _stats(models, owner), refs
