"""The planner at a fixed pipeline degree (``amsp plan --pp P``): every strategy of one stage,
priced as a pipeline.

A stage is a job of its own (cost/pipeline.py, ``stage_job``): its search space is that job's
(``SearchSpace.for_job``: tensor-parallel degrees, P/G/OS factors, ZeRO++, micro-batches and
checkpointing as the engine runs them), each candidate is priced with ``pp=P`` by the cost model
(bubble, sends and the first stage's activations of the micro-batches in flight included) and
the planner's rule (``preference``: solver/brute.py ``preferred_order``; the fastest without
one) chooses among those that fit the usable memory.
The ILP does not hold the bubble, which depends on the micro-batch count, nor the in-flight
activations, so the search enumerates, bisecting block checkpointing (none, the first K blocks,
full) in each group of otherwise equal candidates: memory falls and time rises along it, so the
first that fits is the group's fastest. The bisection reads the memory alone
(``cost/pipeline.py: pipeline_memory``); only each group's first that fits is priced whole. A
mixture of experts' space (every nested expert triple under each dense one on the amsp engine)
can hold millions: one counted above ``MAX_CANDIDATES``, or a search past
``SEARCH_DEADLINE_S``, is refused in one line naming the pins that narrow it. With P = 1 the
planner's ILP runs as before.
"""

from __future__ import annotations

from amsp_planner.ckpt_setting import checkpointed_blocks
from amsp_planner.cost.evaluate import Evaluation, evaluate
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError, InfeasibleError
from amsp_planner.strategy import Strategy
from amsp_planner.strategy_pipeline import check_pp

MAX_CANDIDATES = 1_000_000
"""A stage space counted larger than this is refused at once (``_counted``), not after the
deadline."""

SEARCH_DEADLINE_S = 60.0
"""Seconds the enumeration may run before it stops with a one-line error naming how to
narrow the space (a mixture of experts' stage space on the amsp engine holds millions of
candidates: every nested expert triple under every dense one)."""


def solve_pipeline(job: Job, pp: int, memory_limit: float | None, usable: float, *,
                   zeropp: bool = True, quantization: bool = True, tp: int | None = None,
                   runners_up: int = 3, ep: int | None = None,
                   deadline_s: float | None = None, preference=None) -> list[Evaluation]:
    """The best strategy with `pp` stages and up to `runners_up` more in the rule's order (and
    the fastest that fits, last, when it is not among them); `ep`
    pins a mixture of experts' expert-parallel degree. Refused in one line (AmspUserError)
    when the enumeration outlasts `deadline_s` (default ``SEARCH_DEADLINE_S``)."""
    import time

    from amsp_planner.cost.pipeline import pipeline_memory, stage_job
    from amsp_planner.solver.brute import preferred_order
    from amsp_planner.solver.space import FASTEST, SearchSpace

    start = time.monotonic()
    deadline_s = SEARCH_DEADLINE_S if deadline_s is None else deadline_s

    def too_large(count: int, timed: bool = True) -> None:
        if timed and time.monotonic() - start <= deadline_s:
            return
        pins = "--ep E, " if job.model.is_moe else ""
        raise AmspUserError(
            f"--pp {pp}: the stage's search space is too large to enumerate in "
            f"{deadline_s:g} s ({count:,} candidates): narrow it with {pins}--tp T, "
            "--micro-batch B or --activation-checkpointing, or an --engine that runs fewer "
            "settings (megatron)")

    try:
        check_pp(pp, 1, None, job.num_gpus, job.gpus_per_node)
        if pp > job.model.num_layers:
            raise ValueError(f"pp={pp} exceeds the {job.model.num_layers} blocks of "
                             f"{job.model.name}: use at most {job.model.num_layers}")
    except ValueError as e:
        raise AmspUserError(f"--pp {pp}: {e}") from None
    sj = stage_job(job, Strategy(pp=pp))
    space = SearchSpace.for_job(sj, zeropp=zeropp, quantization=quantization, tp=tp, ep=ep)
    evals, cache = [], {}
    if (n := _counted(space, sj)) > MAX_CANDIDATES:
        too_large(n, timed=False)
    candidates = []
    for c in space.candidates(sj):
        candidates.append(c)
        if len(candidates) % 20_000 == 0:
            too_large(len(candidates))

    def memory_of(c: Strategy) -> float | None:
        try:
            return pipeline_memory(job, c.with_(pp=pp), c).total
        except AmspUserError:
            return None  # e.g. a micro-batch count the schedule refuses

    least: tuple[float, Strategy] | None = None
    for i, ladder in enumerate(_ckpt_ladders(candidates, sj.model.num_layers)):
        # block checkpointing none < K=1 < ... < full: memory falls and time rises along the
        # ladder, so the first that fits is the group's fastest: bisect for it on the memory
        # alone, then price that one
        if i % 500 == 499:
            too_large(len(candidates))
        lo, hi = 0, len(ladder) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            mem = memory_of(ladder[mid])
            if mem is not None and (least is None or mem < least[0]):
                least = (mem, ladder[mid])
            if mem is not None and mem <= usable:
                hi = mid - 1
            else:
                lo = mid + 1
        if lo < len(ladder):
            try:
                evals.append(evaluate(job, ladder[lo].with_(pp=pp), memory_limit, cache))
            except AmspUserError:
                pass
    # the planner's rule (solver/brute.py: preferred_order; docs/planner.md): each group's
    # least-recompute point stands for the group, which its other points cannot beat on it
    fit = preferred_order(job, [e for e in evals if e.memory.total <= usable], "time",
                          FASTEST if preference is None else preference)
    if not fit:
        need = f"{least[0] / 2**30:.2f} GiB ({least[1].with_(pp=pp)})" if least else "-"
        raise InfeasibleError(f"--pp {pp}: nothing fits in {usable / 2**30:.2f} GiB per GPU: "
                              f"the least memory any strategy needs is {need}; try another "
                              "--pp, more GPUs or a smaller --micro-batch")
    out = fit[:1 + runners_up]
    fastest = fastest_of(fit)
    return out if any(e is fastest for e in out) else [*out, fastest]  # the report's reference


def fastest_of(evals: list[Evaluation]) -> Evaluation:
    """The fastest of `evals` (less memory, then the string, on equal time)."""
    return min(evals, key=lambda e: (e.step_s, e.memory.total, str(e.strategy)))


def _ckpt_ladders(candidates, num_layers: int) -> list[list[Strategy]]:
    """The candidates grouped by everything but block checkpointing, each group ordered by
    the blocks it checkpoints (``checkpointed_blocks``: none, the first K, full); op-level
    checkpointing is a ladder of its own."""
    groups: dict[tuple, list[tuple[int, Strategy]]] = {}
    for c in candidates:
        k, op = checkpointed_blocks(c.ckpt_value, num_layers)
        key = (c.with_(ckpt=False, ckpt_blocks=0, ckpt_op=False), op)
        groups.setdefault(key, []).append((k, c))
    return [[c for _, c in sorted(g, key=lambda kc: kc[0])] for g in groups.values()]


def _counted(space, sj: Job) -> int:
    """Candidates of the parts whose expert triples pair with every dense one (the amsp
    engine's rule): dense candidates x nested expert triples, counted without building them;
    0 for the other parts (their count is the enumeration's)."""
    from dataclasses import replace

    from amsp_planner.strategy_experts import nested_triples

    n = 0
    for sp in space.by_tp():
        fe = sp.expert_factors
        if not fe or sp.expert_pairs is not None:
            continue
        dense = replace(sp, expert_factors=(), expert_pairs=None)
        n += len(nested_triples(fe)) * sum(1 for _ in dense._candidates(sj))
    return n
