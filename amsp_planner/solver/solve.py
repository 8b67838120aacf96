"""solve(): the planner's entry point. ILP, decode, re-check with the cost model, baselines.

    from amsp_planner.solver import solve
    result = solve(job, memory_limit)          # result.best is an Evaluation
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from amsp_planner.cost.evaluate import Evaluation, best_baseline, evaluate, evaluate_baselines
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError, InfeasibleError
from amsp_planner.solver.ilp import StrategyIlp
from amsp_planner.solver.rank_terms import priced
from amsp_planner.solver.rounds import solve_models
from amsp_planner.solver.solution import IlpStats, SolverError
from amsp_planner.solver.space import FASTEST, Preference, SearchSpace, objective_value
from amsp_planner.solver.tables import GIB

AGREE_RTOL = 1e-6
SOLVERS = ("highs", "cbc", "exhaustive")
"""The ILP on HiGHS or CBC, or the exact enumeration over the ILP's tables (solver/exhaustive.py)."""


@dataclass
class SolveResult:
    best: Evaluation
    runners_up: list[Evaluation]
    baselines: dict[str, Evaluation]
    stats: IlpStats
    objective: str
    space: SearchSpace
    memory_limit: float
    notes: list[str] = field(default_factory=list)
    preference: Preference = FASTEST
    fastest: Evaluation | None = None
    """The fastest candidate that fits with the headroom (quantized or not)."""
    fastest_lossless: Evaluation | None = None
    """The fastest lossless candidate, when the fastest is quantized and did not win by more
    than the band."""

    @property
    def best_baseline(self) -> tuple[str, Evaluation] | None:
        return best_baseline(self.baselines)


def check_agreement(job: Job, sol, limit: float, objective: str) -> Evaluation:
    """Re-evaluate an ILP solution with the cost model; both must agree."""
    e = evaluate(job, sol.strategy, limit)
    want = objective_value(e, objective)
    if not math.isclose(sol.objective, want, rel_tol=AGREE_RTOL, abs_tol=1e-12):
        raise AssertionError(
            f"ILP and cost model disagree on {sol.strategy}: objective {sol.objective!r} vs {want!r}"
        )
    mem = e.memory.total / GIB
    if not math.isclose(sol.memory_gib, mem, rel_tol=AGREE_RTOL, abs_tol=1e-9):
        raise AssertionError(
            f"ILP and cost model disagree on {sol.strategy}: memory {sol.memory_gib} vs {mem} GiB"
        )
    return e


def solve(job: Job, memory_limit: float | None = None, *, objective: str = "time",
          solver: str = "highs", zeropp: bool = True, micro_batch: int | None = None,
          ckpt: bool | int | str | None = None, runners_up: int = 3, time_limit_s: float = 30.0,
          preference: Preference | None = None, tp: int | None = None,
          idle: Callable[[], object] | None = None, ep: int | None = None,
          pp: int = 1) -> SolveResult:
    """The preferred strategy for `job` under `memory_limit` bytes (default: the GPU's memory)
    by `preference` (default ``Preference.default``: the validated relative band, 10 % headroom,
    lossless unless quantization wins beyond the band, least recompute, fewer process groups,
    the lower objective, less memory).

    `tp` pins the tensor-parallel degree (None: every degree the job admits, one ILP each,
    the rule applied across them: ``solve_models``); `ep` a mixture of experts'
    expert-parallel degree (None: every degree, both placements, one ILP each).

    `pp` > 1 runs the planner at that pipeline degree (``solver/pipeline_search.py``, the
    search ``amsp plan --pp`` runs): a plan's re-solves (``amsp explain``) repeat its search.

    `idle`: work the caller does next, independent of the solves, run by this thread while
    the ILP's second round of solves runs in its solver threads (``solve_models``).

    Raises InfeasibleError (with what the best strategy needs and what would make it fit)
    when nothing fits.
    """
    if objective not in ("time", "comm"):
        raise AmspUserError(f"--objective '{objective}': use 'time' or 'comm'")
    if solver not in SOLVERS:
        raise AmspUserError(f"--solver '{solver}': use {', '.join(SOLVERS)}")
    pref = Preference.default(job=job) if preference is None else preference
    limit = job.cluster.memory_bytes if memory_limit is None else memory_limit
    usable = pref.usable(limit)
    if pp > 1:
        return _solve_pipeline(job, pp, limit, usable, objective, zeropp, tp, runners_up, pref,
                               ep)
    if tp is None and not job.tp_options():  # a job made for a given pp or cp strategy
        raise InfeasibleError(
            f"the global batch of {job.training.batch_seqs} sequences does not split into whole "
            f"sequences over the data-parallel ranks of {job.num_gpus} GPUs at any tensor-"
            "parallel degree without pipeline or context parallelism: search with --pp P, or "
            "a global batch that is a multiple of the data-parallel ranks")
    space = SearchSpace.for_job(job, zeropp=zeropp, micro_batch=micro_batch, ckpt=ckpt,
                                quantization=pref.quantization != "off", tp=tp, ep=ep)
    notes = []
    if objective == "time" and solver != "exhaustive" and priced(job):
        solver = "exhaustive"
        notes.append("rank_jitter / collective_rank_us are set: the search enumerates "
                     "(--solver exhaustive, exact), the ILP does not price their terms "
                     "(docs/cost-model.md, 'Collectives at scale')")
    if solver == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            solver = "cbc"
            notes.append("highspy is not importable: fell back to CBC")
    if solver == "exhaustive":
        from amsp_planner.solver.exhaustive import search

        sols, stats, refs = search(job, space, usable, objective, pref, runners_up)
    else:
        try:
            models = [StrategyIlp(job, sp, usable, objective, solver, time_limit_s, defer=True)
                      for sp in space.by_tp()]
            sols, stats, refs = solve_models(models, runners_up=runners_up, preference=pref,
                                             idle=idle)
        except SolverError as e:
            raise AmspUserError(str(e)) from None
    if not sols:
        raise InfeasibleError(infeasible_message(job, space, limit, solver, time_limit_s, pref))
    evals = [check_agreement(job, s, limit, objective) for s in sols]
    ref = {k: evals[0] if s.strategy == sols[0].strategy else
           check_agreement(job, s, limit, objective) for k, s in refs.items()}
    baselines = evaluate_baselines(job, limit, evals[0].strategy.micro_batch,
                                   evals[0].strategy.ckpt_value, evals[0].strategy.tp)
    return SolveResult(evals[0], evals[1:], baselines, stats, objective, space, limit, notes,
                       pref, ref.get("fastest"), ref.get("fastest_lossless"))


def _solve_pipeline(job: Job, pp: int, limit: float, usable: float, objective: str,
                    zeropp: bool, tp: int | None, runners_up: int, pref: Preference,
                    ep: int | None = None) -> SolveResult:
    """``solve`` at a fixed pipeline degree: the enumeration of ``solve_pipeline``, its named
    baselines data parallel (pp=1) at the best plan's tp, micro-batch and checkpointing, as
    ``amsp plan --pp`` reports them."""
    from amsp_planner.solver.pipeline_search import fastest_of, solve_pipeline

    found = solve_pipeline(job, pp, limit, usable, zeropp=zeropp,
                           quantization=pref.quantization != "off", tp=tp, runners_up=runners_up,
                           ep=ep, preference=pref)
    s = found[0].strategy
    notes = []
    try:
        baselines = evaluate_baselines(job, limit, s.micro_batch, s.ckpt_value, s.tp)
    except AmspUserError as e:  # e.g. the batch does not divide over pp times the DP ranks
        baselines = {}
        notes.append(f"named baselines (pp=1) not priced: {e}")
    stats = IlpStats(solver="pipeline", status="Optimal")
    space = SearchSpace.for_job(job, zeropp=zeropp, tp=tp)
    fastest = fastest_of(found)
    return SolveResult(found[0], found[1:], baselines, stats, objective, space, limit, notes,
                       pref, fastest=None if fastest is found[0] else fastest)


def min_memory_strategy(job: Job, space: SearchSpace, solver: str = "highs",
                        time_limit_s: float = 30.0) -> Evaluation:
    """The strategy of least memory per GPU in `space` (ILP without the memory limit, one per
    tensor-parallel degree), with the solver the search used."""
    if solver == "exhaustive":
        from amsp_planner.solver.exhaustive import min_memory

        return evaluate(job, min_memory(job, space), float("inf"))
    out = []
    for sp in space.by_tp():
        model = StrategyIlp(job, sp, float("inf"), "time", solver, time_limit_s)
        model.prob.setObjective(model.mem_expr)
        try:
            model._run()
        except SolverError as e:
            raise AmspUserError(str(e)) from None
        out.append(evaluate(job, model._decode(), float("inf")))
    return min(out, key=lambda e: e.memory.total)


def infeasible_message(job: Job, space: SearchSpace, limit: float, solver: str = "highs",
                       time_limit_s: float = 30.0, pref: Preference = FASTEST) -> str:
    e = min_memory_strategy(job, space, solver, time_limit_s)
    usable = pref.usable(limit)
    m = e.memory
    need = m.total / GIB
    act = m.activations + m.loss_peak
    terms = {"model states": m.model_states, "activations": act, "buffers": m.buffers,
             "context + fragmentation + communicators": m.context + m.fragmentation
             + m.communicators}
    top = max(terms, key=terms.get)
    fixes = []
    if top == "activations" or act > 0.25 * m.total:
        if not e.strategy.ckpt and not space.allows_checkpointing():
            fixes.append("allow activation checkpointing (--activation-checkpointing auto|on)")
        if e.strategy.micro_batch > 1:
            fixes.append("a smaller --micro-batch")
        fixes.append(f"a shorter --seq-len than {job.training.seq_len}")
    other = m.total - m.model_states * (1 + job.cluster.gpu.fragmentation_fraction)
    room = usable - other
    if room > 0 and m.model_states > 0:
        factor = m.model_states * (1 + job.cluster.gpu.fragmentation_fraction) / room
        want = job.num_gpus * factor
        r = job.cluster.gpus_per_node
        gpus = r * 2 ** math.ceil(math.log2(max(1.0, want / r)))
        fixes.append(f"about {gpus} GPUs (model states shrink with more GPUs when fully sharded)")
    fixes.append("a GPU with more memory (--set gpu.memory_gib=...)")
    if pref.headroom and m.total <= limit:
        free = 1 - m.total / limit
        fixes.insert(0, f"less headroom (--headroom {math.floor(free * 100) / 100:.2f}: "
                        f"{e.strategy} leaves {free * 100:.1f} % of the memory free)")
    where = (f"{usable / GIB:.2f} GiB per GPU ({limit / GIB:.2f} GiB less the "
             f"{pref.headroom * 100:.0f} % --headroom)" if pref.headroom else
             f"{limit / GIB:.2f} GiB per GPU")
    return (
        f"nothing fits in {where}: the least memory any strategy needs is "
        f"{need:.2f} GiB ({e.strategy}), dominated by {top} ({terms[top] / GIB:.2f} GiB); "
        f"to fit, try {'; or '.join(fixes)}"
    )
