"""The planner at a fixed pipeline degree (``amsp plan --pp P``): every strategy of one stage,
priced as a pipeline.

A stage is a job of its own (cost/pipeline.py, ``stage_job``): its search space is that job's
(``SearchSpace.for_job``: tensor-parallel degrees, P/G/OS factors, ZeRO++, micro-batches and
checkpointing as the engine runs them), each candidate is priced with ``pp=P`` by the cost model
(bubble, sends and the first stage's activations of the micro-batches in flight included) and
the fastest that fits the usable memory wins (less memory, then the string, on equal time).
The ILP does not hold the bubble, which depends on the micro-batch count, nor the in-flight
activations, so the search enumerates, bisecting block checkpointing (none, the first K blocks,
full) in each group of otherwise equal candidates: memory falls and time rises along it, so the
first that fits is the group's fastest. With P = 1 the planner's ILP runs as before.
"""

from __future__ import annotations

from amsp_planner.ckpt_setting import checkpointed_blocks
from amsp_planner.cost.evaluate import Evaluation, evaluate
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError, InfeasibleError
from amsp_planner.strategy import Strategy
from amsp_planner.strategy_pipeline import check_pp


def solve_pipeline(job: Job, pp: int, memory_limit: float | None, usable: float, *,
                   zeropp: bool = True, quantization: bool = True, tp: int | None = None,
                   runners_up: int = 3) -> list[Evaluation]:
    """The best strategy with `pp` stages and up to `runners_up` more, fastest first."""
    from amsp_planner.cost.pipeline import stage_job
    from amsp_planner.solver.space import SearchSpace

    try:
        check_pp(pp, 1, None, job.num_gpus, job.gpus_per_node)
        if pp > job.model.num_layers:
            raise ValueError(f"pp={pp} exceeds the {job.model.num_layers} blocks of "
                             f"{job.model.name}: use at most {job.model.num_layers}")
    except ValueError as e:
        raise AmspUserError(f"--pp {pp}: {e}") from None
    if job.model.is_moe:
        raise AmspUserError(f"--pp {pp}: pipeline parallelism of a mixture-of-experts model is "
                            "not modelled: use --pp 1")
    sj = stage_job(job, Strategy(pp=pp))
    space = SearchSpace.for_job(sj, zeropp=zeropp, quantization=quantization, tp=tp)
    evals, cache = [], {}

    def price(c: Strategy) -> Evaluation | None:
        try:
            e = evaluate(job, c.with_(pp=pp), memory_limit, cache)
        except AmspUserError:
            return None  # e.g. a micro-batch count the schedule refuses
        evals.append(e)
        return e

    for ladder in _ckpt_ladders(space.candidates(sj), sj.model.num_layers):
        # block checkpointing none < K=1 < ... < full: memory falls and time rises along the
        # ladder, so the first that fits is the group's fastest: bisect for it
        lo, hi = 0, len(ladder) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            e = price(ladder[mid])
            if e is not None and e.memory.total <= usable:
                hi = mid - 1
            else:
                lo = mid + 1
    fit = sorted((e for e in evals if e.memory.total <= usable),
                 key=lambda e: (e.step_s, e.memory.total, str(e.strategy)))
    if not fit:
        least = min(evals, key=lambda e: e.memory.total, default=None)
        need = f"{least.memory.total / 2**30:.2f} GiB ({least.strategy})" if least else "-"
        raise InfeasibleError(f"--pp {pp}: nothing fits in {usable / 2**30:.2f} GiB per GPU: "
                              f"the least memory any strategy needs is {need}; try another "
                              "--pp, more GPUs or a smaller --micro-batch")
    return fit[:1 + runners_up]


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
