"""Grids of evaluations (compare, plan): raw values, formatted per column (report.grid)."""

from __future__ import annotations

import math
from collections.abc import Callable

from amsp_planner.cost.evaluate import Evaluation
from amsp_planner.report.fmt import GIB, bytes_h, gib, secs
from amsp_planner.report.grid import Col, Grid


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _count(x: float) -> str:
    return f"{x:,.0f}"


def _bytes(key: str) -> Callable[[float], dict]:
    """CSV: a byte count as an integer (per-GPU shares of a collective are fractional)."""
    return lambda v: {key: None if v is None else round(v)}


COMPARE_COLS = [
    Col("name", "name", right=False), Col("strategy", "strategy", right=False, strategy=True),
    Col("mem GiB", "memory_gib", lambda v: f"{v:,.2f}"),
    Col("fits", "fits", lambda v: "yes" if v else "NO"),
    Col("inter-node/GPU", "inter_bytes_per_gpu", bytes_h, wide=True,
        csv=_bytes("inter_bytes_per_gpu")),
    Col("intra-node/GPU", "intra_bytes_per_gpu", bytes_h, wide=True,
        csv=_bytes("intra_bytes_per_gpu")),
    Col("compute", "compute_s", secs, wide=True), Col("optimizer", "optimizer_s", secs, wide=True),
    Col("exposed comm", "exposed_comm_s", secs, wide=True), Col("step", "step_s", secs, drop=1),
    Col("tokens/s", "tokens_per_s", _count), Col("MFU", "mfu", _pct, drop=2),
]


def _vs(v) -> str:
    if v is None:
        return ""
    gain, tie = v
    return f"{gain * 100:+.1f}%" + (" tie" if tie else "")


def _vs_csv(key: str, v) -> dict:
    """CSV: the margin in percent and whether it is inside the band (empty for the reference
    and for rows that do not fit)."""
    gain, tie = v if v is not None else (None, None)
    return {key: None if gain is None else round(gain * 100, 3), "within_band": tie}


def engine_line(job) -> str:
    """Which engine every number is for (its execution profile, engines.py), in words."""
    p = job.profile
    return f"numbers for {p.title} as it executes (--engine {p.name})"


def _with_engine(g: Grid, job) -> Grid:
    """The grid with its caption naming the engine its numbers are for."""
    if job is not None:
        g.caption = "; ".join(x for x in (g.caption, f"engine: {job.engine}") if x)
    return g


def compare_grid(rows: list[tuple[str, Evaluation]], title: str, ref: Evaluation | None = None,
                 band: float | None = None, job=None, by_identity: bool = False) -> Grid:
    """The rows side by side; with `ref`, a column of tokens/s margins marked 'tie' within
    `band` (default: the validated step-time band): the chosen row's over each row when a row
    is named 'chosen', else each row's against `ref` (the fastest). A row with `ref`'s strategy
    counts as `ref` (no margin) unless `by_identity` (the same strategy in another precision),
    whose names end in their precision: CSV gives it a column of its own, as JSON does."""
    cols = list(COMPARE_COLS)
    if by_identity:
        cols[0] = Col("name", "name", right=False, csv=lambda v: dict(
            zip(("name", "precision"), v.rsplit(" ", 1), strict=True)))
    if ref is not None:
        if band is None:
            from amsp_planner.validation import step_time_band

            band = step_time_band()
        key = "chosen_vs_it_pct" if "chosen" in dict(rows) else "vs_fastest_pct"
        cols.append(Col(key.removesuffix("_pct").replace("_", " "), key, _vs, words=True,
                        csv=lambda v, key=key: _vs_csv(key, v)))
    g = Grid(title, cols)
    for name, e in rows:
        row = [name, str(e.strategy), e.memory.total / GIB, e.fits,
               e.bytes_per_rank("inter"), e.bytes_per_rank("intra"), e.time.compute_s,
               e.time.optimizer_s, e.time.exposed_comm_s, e.step_s, e.tokens_per_s, e.mfu]
        if ref is not None:
            gain = (e.step_s / ref.step_s if "chosen" in dict(rows) else ref.step_s / e.step_s) - 1
            same = e is ref or (not by_identity and str(e.strategy) == str(ref.strategy))
            row.append(None if same or not e.fits else (gain, abs(gain) <= band))
        g.rows.append(row)
    if ref is not None:
        from amsp_planner.report.plan_report import band_words

        g.caption = (f"tie: within the {band_words(band)} (the error of the predicted ratio "
                     "of two strategies, docs/validation.md), which cannot tell such rows apart")
    return _with_engine(g, job)


SCHEDULE_COLS = [
    Col("phase", "phase", right=False), Col("op", "op", right=False),
    Col("group", "group", right=False), Col("size", "group_size", wide=True),
    Col("stride", "stride", wide=True), Col("per node", "members_per_node", wide=True),
    Col("dtype", "dtype", right=False, wide=True), Col("calls", "calls_per_step", _count, wide=True),
    Col("full bytes", "full_bytes_per_step", bytes_h, wide=True),
    Col("intra/GPU", "intra_bytes_per_rank_per_step", bytes_h,
        csv=_bytes("intra_bytes_per_rank_per_step")),
    Col("inter/GPU", "inter_bytes_per_rank_per_step", bytes_h,
        csv=_bytes("inter_bytes_per_rank_per_step")), Col("time", "time_s", secs),
]


def schedule_grid(e: Evaluation, job=None) -> Grid:
    g = Grid("collective schedule (per step, per GPU)", SCHEDULE_COLS)
    g.rows = [[getattr(s, c.key) for c in SCHEDULE_COLS] for s in e.schedule]
    return _with_engine(g, job)


MEMORY_TERMS = ("params", "grads", "optimizer", "hpz", "gather_buffers", "grad_buffers",
                "staging", "step_buffer", "expert_params", "expert_grads", "expert_optimizer",
                "expert_buffers", "dispatch_buffers", "activations", "loss_peak",
                "fragmentation", "communicators", "context")
"""The memory grid's rows, those that are not zero (the expert_ ones: a mixture of experts'
routed experts, the dense class's being the rows above them; docs/moe.md)."""


def memory_grid(e: Evaluation, job=None) -> Grid:
    g = Grid("memory per GPU", [Col("term", "term", right=False), Col("GiB", "bytes", gib)])
    m = e.memory
    g.rows = [[name, getattr(m, name)] for name in MEMORY_TERMS if getattr(m, name)]
    g.rows += [["total", m.total], ["limit", e.memory_limit]]
    return _with_engine(g, job)


def inapplicable_line(job, tp: int = 1, ckpt: bool | int | str = False) -> str | None:
    """The named baselines this job leaves out, each with its reason (None when none is); with
    `tp`, over its data-parallel ranks; `ckpt`: theirs (the plan's)."""
    from amsp_planner.cost.evaluate import job_baselines
    from amsp_planner.strategy_baselines import inapplicable_baselines

    out = inapplicable_baselines(job.num_gpus // tp, max(1, job.gpus_per_node // tp))
    lines = []
    if out:
        by_reason: dict[str, list[str]] = {}
        for name, why in out.items():
            by_reason.setdefault(why, []).append(name)
        lines.append("not applicable here: " + "; ".join(f"{', '.join(names)} ({why})"
                                                         for why, names in by_reason.items()))
    _, not_run = job_baselines(job, ckpt=ckpt, tp=tp)
    if not_run:
        lines.append(f"named baselines not run by {job.engine}, so not priced: " + "; ".join(
            f"{name} ({why})" for name, why in not_run.items()))
    return "\n".join(lines) or None


def fit_hint(job, limit: float, micro_batch: int, ckpt, tp: int) -> str | None:
    """When no named baseline fits: what would make one fit, one line. Tried in turn on the
    same baselines: activation checkpointing on, the smallest larger tensor-parallel degree the
    job admits that makes one fit (alone, then with checkpointing), the fewest of twice, 4x and
    8x the GPUs that do (alone, then with checkpointing), and the memory limit the least hungry
    one needs. None when some baseline fits."""
    from amsp_planner.cost.evaluate import evaluate_baselines
    from amsp_planner.cost.job import Job
    from amsp_planner.errors import AmspUserError

    def fitting(j, c, t):
        try:
            ev = evaluate_baselines(j, limit, micro_batch, c, t)
        except AmspUserError:  # e.g. a batch that more GPUs do not divide
            return []
        return sorted(ev.items(), key=lambda kv: kv[1].memory.total)

    now = fitting(job, ckpt, tp)
    if any(e.fits for _, e in now):
        return None
    ways = []

    def add(option: str, pairs) -> bool:
        fit = [(n, e) for n, e in pairs if e.fits]
        if fit:
            ways.append(f"{option} ({', '.join(n for n, _ in fit[:3])}: "
                        f"{gib(fit[0][1].memory.total)} GiB)")
        return bool(fit)

    if ckpt is not True:
        add("--activation-checkpointing on", fitting(job, True, tp))
    for t in (t for t in job.tp_options() if t > tp):
        if add(f"--tp {t}", fitting(job, ckpt, t)):
            break
        if ckpt is not True and add(f"--tp {t} --activation-checkpointing on",
                                    fitting(job, True, t)):
            break
    done = False
    for k in (2, 4, 8):
        try:
            more = Job.create(job.model, job.cluster, job.training, job.num_gpus * k, job.engine,
                              *job.split)
        except AmspUserError:
            continue
        for c, also in ((ckpt, ""), (True, " --activation-checkpointing on")):
            if (c is not True or ckpt is not True or not also) and not done:
                done = add(f"--gpus {more.num_gpus}{also}", fitting(more, c, tp))
        if done:
            break
    least = now[0][1].memory.total
    ways.append(f"--memory-limit {math.ceil(least / GIB * 10) / 10:g} ({now[0][0]})")
    return (f"hint: no baseline fits in {gib(limit)} GiB per GPU; one would with "
            + ", or ".join(ways) + "; `amsp plan` searches checkpointing, tp and ZeRO++ together")
