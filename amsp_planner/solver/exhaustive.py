"""Exact search by enumeration over the ILP's coefficient tables, every candidate at once (numpy).

The ILP (solver/ilp.py) reads the cost model into tables (solver/tables.py: seconds per unit
call of each collective and compute option, GiB per component) and states a decision's step
time and memory with them: sums of table entries, and per pipeline stage the max() of
``cost/step_time.stage_time``. Here the same tables and the same stage terms
(``cost/step_time.stages``, evaluated on arrays with ``np.maximum`` for max()) price every
candidate of the space exactly, and the choice rule (``Preference``) is a few reductions over
the arrays, in the brute force's order (solver/brute.py, ``preferred_order``).

A candidate (solver/candidates.py) is a configuration of P/G/OS factors and ZeRO++ switches
with an activation option, at one tensor-parallel degree: each degree's space has its own
tables (``SearchSpace.by_tp``, as the ILP builds one model per degree), and the rule is
applied to the union of their candidates. Where the rule breaks ties by recompute before
memory, only the smallest block count K that fits is priced (``candidates.prunes_blocks``).

Why: a what-if sweep solves hundreds of jobs, and the ILP's branch and bound on the max() stages
costs about 0.1-0.4 s per solve with several solves per point (docs/benchmarks.md); this prices
the few thousand to few hundred thousand candidates of a job in milliseconds. Both are exact; the
ILP is the planner's default (``amsp plan``), this is ``--solver exhaustive``, the what-if
sweep's default and ``amsp explain``'s re-solver. tests/test_preference.py and
tests/test_solver.py check both against the brute force on the same randomised instances,
and against each other on whole preset models.
"""

from __future__ import annotations

import time as _time
from collections import OrderedDict

import numpy as np

from amsp_planner.cost.job import Job
from amsp_planner.solver.candidates import Candidates, Configs, objective_of, prunes_blocks
from amsp_planner.solver.solution import IlpSolution, IlpStats
from amsp_planner.solver.space import (
    CEILING_RTOL,
    FASTEST,
    GROUPS,
    MEMORY,
    RECOMPUTE,
    STEP,
    TIME_RTOL,
    Preference,
    SearchSpace,
    tie_rtol,
)
from amsp_planner.solver.tables import GIB, Tables, tables_for
from amsp_planner.strategy import Strategy


def _least(mask: np.ndarray, values: np.ndarray, rtol: float) -> np.ndarray:
    """`mask` narrowed to the values within `rtol` (relative) of its least."""
    least = values[mask].min()
    return mask & (values <= least * (1 + rtol) + 1e-12)


PRICED_SPACES = 48
"""Spaces whose tables stay cached: a what-if sweep comes back to a job after every GPU count
of its memory-limit row (up to 4 tensor-parallel spaces each)."""
_PRICED: OrderedDict = OrderedDict()
"""(id(job), space) -> (job, tables, configurations): the last few jobs' tables, which do not
depend on the memory limit (a what-if sweep over limits solves one job several times). The job
is held so that its id is not reused while cached."""


def _priced(job: Job, space: SearchSpace) -> tuple[Tables, Configs]:
    key = (id(job), space)
    hit = _PRICED.get(key)
    if hit is None:
        T = tables_for(job, space)
        hit = _PRICED[key] = (job, T, Configs(job, space, T))
        while len(_PRICED) > PRICED_SPACES:
            _PRICED.popitem(last=False)
    _PRICED.move_to_end(key)
    return hit[1], hit[2]


class _Part:
    """The fitting candidates of one tensor-parallel degree's space, priced."""

    def __init__(self, job: Job, sp: SearchSpace, usable_gib: float, objective: str,
                 pref: Preference):
        self.T, self.cf = T, cf = _priced(job, sp)
        self.cand = cand = Candidates(job, T, cf, usable_gib, prunes_blocks(pref, T))
        self.obj = (objective_of(job, T, cf, cand, objective) * T.time_unit if len(cand)
                    else np.zeros(0))
        self.quant = cf.q[cand.c] | cf.qg[cand.c]
        self.rec = cand.rec * T.time_unit
        self.groups = cf.groups[cand.c].astype(float)
        self.mem = cand.mem

    def solution(self, i: int, num_layers: int) -> IlpSolution:
        cand, cf = self.cand, self.cf
        mb, ck = cand.options[int(cand.option[i])]
        ck = int(cand.blocks[i]) if ck == "K" else ck
        return IlpSolution(cf.strategy(int(cand.c[i]), mb, ck, num_layers), float(self.obj[i]),
                           float(self.mem[i]), "Optimal",
                           (cf.tp, int(cand.c[i]), int(cand.option[i])),
                           int(cf.groups[cand.c[i]]))


def search(job: Job, space: SearchSpace, usable_bytes: float, objective: str = "time",
           preference: Preference = FASTEST, runners_up: int = 0
           ) -> tuple[list[IlpSolution], IlpStats, dict]:
    """What ``rounds.solve_models`` returns, by enumeration over every tensor-parallel degree of
    the space (``SearchSpace.by_tp``) at once: the preferred solution, up to `runners_up` more
    by objective (distinct ILP decisions: degree, configuration and activation option), and
    the references {'fastest', 'fastest_lossless'} the choice was made against."""
    t0 = _time.perf_counter()
    parts = [_Part(job, sp, usable_bytes / GIB, objective, preference)
             for sp in space.by_tp() if sp.micro_batches]
    t1 = _time.perf_counter()
    stats = IlpStats(solver="exhaustive", build_time_s=t1 - t0,
                     num_variables=sum(pt.cand.total for pt in parts))
    refs: dict = {}
    where = np.concatenate([np.full(len(pt.cand), k) for k, pt in enumerate(parts)] or [[]])
    if not len(where):
        stats.status = "Infeasible"
        stats.solve_time_s = _time.perf_counter() - t1
        return [], stats, refs
    where = where.astype(np.int64)
    local = np.concatenate([np.arange(len(pt.cand)) for pt in parts])
    obj, quant, rec, groups, mem = (np.concatenate([getattr(pt, a) for pt in parts])
                                    for a in ("obj", "quant", "rec", "groups", "mem"))
    mem_bytes = mem * GIB
    L = job.model.num_layers

    def solution(i: int) -> IlpSolution:
        return parts[where[i]].solution(int(local[i]), L)

    def first(mask: np.ndarray) -> int:
        """The brute force's order inside `mask`: objective, memory, then the strategy string."""
        idx = np.nonzero(mask)[0]
        o = obj[idx]
        idx = idx[o == o.min()]
        m = mem_bytes[idx]
        idx = idx[m == m.min()]
        return min(idx, key=lambda i: str(solution(int(i)).strategy)) if len(idx) > 1 else idx[0]

    every = np.ones(len(obj), dtype=bool)
    if preference.ceiling is not None:
        every = obj <= preference.ceiling * (1 + CEILING_RTOL) + 1e-15
        if not every.any():
            stats.status = "Infeasible"
            stats.solve_time_s = _time.perf_counter() - t1
            return [], stats, refs
    refs["fastest"] = solution(first(every))
    admissible = every
    t_all = obj[every].min()
    if preference.quantization == "auto" and (every & ~quant).any():
        t_lossless = obj[every & ~quant].min()
        if not t_lossless > t_all * (1 + preference.band) * (1 + TIME_RTOL):
            admissible = every & ~quant
            if quant[first(every)]:
                refs["fastest_lossless"] = solution(first(admissible))
    # the band above the fastest admissible candidate, quantized or not (choice.py)
    tie = admissible & (obj <= t_all * (1 + preference.band + TIME_RTOL) + 1e-15)
    crit = {RECOMPUTE: rec, GROUPS: groups, STEP: obj, MEMORY: mem_bytes}
    for name in preference.tie_breaks:
        tie = _least(tie, crit[name], tie_rtol(name))
    out = [solution(first(tie))]
    # configurations that decode to one strategy (identical factors and prices: llama-13b at
    # TP 8 on 64 A100s has two) are one decision, as the ILP's no-good cut excludes them
    # together
    taken = {str(out[0].strategy)}
    for i in np.lexsort((mem_bytes, obj)):
        if len(out) > runners_up:
            break
        sol = solution(int(i))
        if (key := str(sol.strategy)) not in taken:
            taken.add(key)
            out.append(sol)
    stats.status = "Optimal"
    stats.solve_time_s = _time.perf_counter() - t1
    return out, stats, refs


def min_memory(job: Job, space: SearchSpace) -> Strategy:
    """The strategy of least memory per GPU in `space` (no limit), over every tensor-parallel
    degree. Activation memory is affine in the blocks checkpointed, so a block range's least is
    at one of its ends."""
    best = None
    frag = 1 + job.cluster.gpu.fragmentation_fraction
    for sp in space.by_tp():
        T, cf = _priced(job, sp)
        ends = []
        for j in T.fwd:
            mb, ck = j
            if j in T.krange:
                lo, hi = T.krange[j]
                ends += [(T.act[j], mb, lo), (T.act[j] + (hi - lo) * T.dact[j], mb, hi)]
            else:
                ends.append((T.act[j], mb, ck))
        if not ends:
            continue
        act, mb, ck = min(ends, key=lambda e: e[0])
        base = cf.states * frag + cf.comms
        c = int(np.argmin(base))
        total = base[c] + act * frag
        if best is None or total < best[0]:
            best = (total, cf.strategy(c, mb, ck, job.model.num_layers))
    return best[1]
