"""Evaluate one strategy for one job: memory, schedule, step time, throughput."""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import MemoryBreakdown, memory
from amsp_planner.cost.schedule import ScheduleEntry, build_schedule, regather
from amsp_planner.cost.step_time import StepTime, step_time
from amsp_planner.strategy import Strategy


@dataclass(frozen=True)
class Evaluation:
    strategy: Strategy
    n_micro: int
    memory: MemoryBreakdown
    schedule: tuple[ScheduleEntry, ...]
    time: StepTime
    memory_limit: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

    @property
    def step_s(self) -> float:
        return self.time.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch_tokens / self.time.step_s

    batch_tokens: int = 0
    model_flops_per_step: float = 0.0
    peak_flop_per_s_total: float = 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / self.time.step_s / self.peak_flop_per_s_total

    def bytes_per_rank(self, scope: str) -> float:
        """Bytes a GPU sends per step, 'intra' or 'inter' node (ring convention)."""
        key = f"{scope}_bytes_per_rank_per_step"
        return sum(getattr(e, key) for e in self.schedule)

    def to_dict(self) -> dict:
        return {
            "strategy": str(self.strategy),
            "n_micro": self.n_micro,
            "fits": self.fits,
            "memory_limit_bytes": self.memory_limit,
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict(),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "intra_bytes_per_rank_per_step": self.bytes_per_rank("intra"),
            "inter_bytes_per_rank_per_step": self.bytes_per_rank("inter"),
            "schedule": [e.to_dict() for e in self.schedule],
        }


def engine_runs(job: Job, s: Strategy) -> str | None:
    """Why the job's engine does not run `s` (its tensor parallelism, (P, G, OS) shapes, ZeRO++
    switches and checkpointing, as its search space holds them: ``EngineProfile.triples``,
    ``runs_ckpt``), or None."""
    eng = job.profile
    if s.tp > 1 and not eng.tp:
        return f"{eng.title} does not run tensor parallelism here"
    n, r = job.num_gpus // s.tp, max(1, job.gpus_per_node // s.tp)
    shapes = eng.triples(n, r, job.training)
    if shapes is not None and (s.s_p, s.s_g, s.s_os) not in shapes:
        return f"its shards are {eng.shapes_text}"
    off = [k for k, on, ok in (("qwz", s.qwz, eng.qwz), ("hpz", s.hpz > 1, eng.hpz),
                               ("qgz", s.qgz, eng.qgz)) if on and not ok]
    if off:
        return f"no {', '.join(off)}"
    if not eng.runs_ckpt(s.ckpt_value, job.model.num_layers):
        return f"it runs checkpointing {eng.ckpt_text}"
    return None


def as_priced(job: Job, s: Strategy) -> Strategy:
    """`s` written as the job prices it: with ``--fp8-all-gather on`` every sharded parameter
    gather is FP8, so a strategy with s_P > 1 carries ``fp8ag`` (its string then reproduces
    the row)."""
    on = job.fp8_gathers_all and s.s_p > 1 and not (s.fp8ag or s.qwz)  # qwz: Job.check refuses
    return s.with_(fp8ag=True) if on else s


def job_baselines(job: Job, micro_batch: int = 1, ckpt: bool | int | str = False, tp: int = 1,
                  cp: int = 1) -> tuple[dict[str, Strategy], dict[str, str]]:
    """The named baselines of the job (same micro-batch, checkpointing, tensor- and
    context-parallel degrees) its engine runs, and those it does not, with why."""
    from amsp_planner.strategy_baselines import named_baselines

    bl = {k: v.with_(cp=cp) for k, v in named_baselines(
        job.num_gpus, job.gpus_per_node, micro_batch, ckpt, tp).items()}
    if job.model.is_moe:  # the experts sharded as the dense triple; no ZeRO++ (docs/moe.md)
        bl.pop("zeropp", None)
    elif job.fp8_gathers_all:  # every sharded gather is FP8 (not qwZ's INT8): written so
        bl = {k: as_priced(job, v.with_(qwz=False)) for k, v in bl.items()}
    why = {k: w for k, s in bl.items() if (w := engine_runs(job, s)) is not None}
    return {k: s for k, s in bl.items() if k not in why}, why


def evaluate_baselines(job: Job, memory_limit: float | None = None, micro_batch: int = 1,
                       ckpt: bool | int | str = False, tp: int = 1, cp: int = 1
                       ) -> dict[str, Evaluation]:
    """Every named baseline of the job its engine runs, evaluated (``job_baselines``)."""
    runs, _ = job_baselines(job, micro_batch, ckpt, tp, cp)
    return {name: evaluate(job, s, memory_limit) for name, s in runs.items()}


def best_baseline(baselines: dict[str, Evaluation]) -> tuple[str, Evaluation] | None:
    """The fastest baseline that fits (least memory on equal step time); None if none fits."""
    fitting = [(n, e) for n, e in baselines.items() if e.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda ne: (ne[1].step_s, ne[1].memory.total))


def evaluate(job: Job, s: Strategy, memory_limit: float | None = None,
             schedules: dict | None = None) -> Evaluation:
    """Everything the cost model predicts for `s` on `job` (checks `s` first). `schedules`,
    when given, caches the collective schedule across strategies that differ only in
    checkpointing (which moves no bytes without TP and without an engine that gathers a
    recomputed block again: with tp > 1 the recomputed forward repeats its TP collectives, so
    the key keeps the checkpointing; the re-gathers' multiple is part of the key)."""
    if s.pp > 1:
        return evaluate_pipeline(job, s, memory_limit, schedules)
    s = job.checked(s)
    if s.cp > 1:
        return _evaluate_cp(job, s, memory_limit)
    n_micro = job.n_micro(s)
    if schedules is None:
        sched = build_schedule(job, s, n_micro)
    else:
        key = s if s.tp > 1 or s.ep > 1 else (s.with_(ckpt=False, ckpt_blocks=0, ckpt_op=False),
                                              regather(job, s))
        if key not in schedules:
            schedules[key] = build_schedule(job, s, n_micro)
        sched = schedules[key]
    t = step_time(job, sched, n_micro, s.micro_batch, s.ckpt_value, s.s_os, s.tp, s.ep,
                  s.expert_factor("os"))
    limit = job.cluster.memory_bytes if memory_limit is None else memory_limit
    return Evaluation(
        strategy=s,
        n_micro=n_micro,
        memory=memory(job, s),
        schedule=sched,
        time=t,
        memory_limit=limit,
        batch_tokens=job.training.batch_tokens,
        model_flops_per_step=job.training.batch_tokens * job.model.flops_per_token(job.training.seq_len),
        peak_flop_per_s_total=job.num_gpus * job.cluster.peak_flop_per_s,
    )


def _evaluate_cp(job: Job, s: Strategy, memory_limit: float | None) -> Evaluation:
    """`s` with context parallelism: the per-rank view's schedule, with the K/V exchange's
    entries, and time; the memory of ``memory`` (cost/context_parallel.py)."""
    from amsp_planner.cost.context_parallel import cp_entries, cp_view

    view, flat = cp_view(job, s.cp), s.with_(cp=1)
    n_micro = view.n_micro(flat)
    sched = build_schedule(view, flat, n_micro) + tuple(cp_entries(view, s, n_micro))
    t = step_time(view, sched, n_micro, s.micro_batch, s.ckpt_value, s.s_os, s.tp)
    return Evaluation(
        strategy=s, n_micro=n_micro, memory=memory(job, s), schedule=sched, time=t,
        memory_limit=job.cluster.memory_bytes if memory_limit is None else memory_limit,
        batch_tokens=job.training.batch_tokens,
        model_flops_per_step=job.training.batch_tokens * job.model.flops_per_token(job.training.seq_len),
        peak_flop_per_s_total=job.num_gpus * job.cluster.peak_flop_per_s)


def evaluate_pipeline(job: Job, s: Strategy, memory_limit: float | None = None,
                      schedules: dict | None = None) -> Evaluation:
    """A strategy with pp > 1: its stage job evaluated unpipelined, then the bubble, the
    sends and the in-flight activations added (cost/pipeline.py)."""
    from amsp_planner.cost import pipeline as P

    job.check(s)
    P.check(job, s)
    sj = P.stage_job(job, s)
    ev = evaluate(sj, P.flat(s), memory_limit, schedules)
    time, p2p = P.pipeline_time(job, s, ev.time, ev.n_micro)
    return Evaluation(
        strategy=s, n_micro=ev.n_micro, memory=P.stage_memory(sj, s, ev.memory, ev.n_micro),
        schedule=ev.schedule + (p2p,), time=time, memory_limit=ev.memory_limit,
        batch_tokens=job.training.batch_tokens,
        model_flops_per_step=job.training.batch_tokens * job.model.flops_per_token(
            job.training.seq_len),
        peak_flop_per_s_total=job.num_gpus * job.cluster.peak_flop_per_s)
