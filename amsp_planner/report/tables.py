"""Grids of evaluations (compare, plan): raw values, formatted per column (report.grid)."""

from __future__ import annotations

from amsp_planner.cost.evaluate import Evaluation
from amsp_planner.report.fmt import GIB, bytes_h, gib, secs
from amsp_planner.report.grid import Col, Grid


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _count(x: float) -> str:
    return f"{x:,.0f}"


COMPARE_COLS = [
    Col("name", "name", right=False), Col("strategy", "strategy", right=False, strategy=True),
    Col("mem/GPU GiB", "memory_gib", lambda v: f"{v:,.2f}"),
    Col("fits", "fits", lambda v: "yes" if v else "NO"),
    Col("inter-node/GPU", "inter_bytes_per_gpu", bytes_h, wide=True),
    Col("intra-node/GPU", "intra_bytes_per_gpu", bytes_h, wide=True),
    Col("compute", "compute_s", secs, wide=True), Col("optimizer", "optimizer_s", secs, wide=True),
    Col("exposed comm", "exposed_comm_s", secs, wide=True), Col("step", "step_s", secs),
    Col("tokens/s", "tokens_per_s", _count), Col("MFU", "mfu", _pct),
]


def _vs(v) -> str:
    if v is None:
        return ""
    gain, tie = v
    return f"{gain * 100:+.1f}%" + (" tie" if tie else "")


def compare_grid(rows: list[tuple[str, Evaluation]], title: str, ref: Evaluation | None = None,
                 band: float | None = None) -> Grid:
    """The rows side by side; with `ref`, a column of tokens/s margins marked 'tie' within
    `band` (default: the validated step-time band): the chosen row's over each row when a row
    is named 'chosen', else each row's against `ref` (the fastest)."""
    cols = list(COMPARE_COLS)
    if ref is not None:
        if band is None:
            from amsp_planner.validation import step_time_band

            band = step_time_band()
        cols.append(Col("chosen vs it" if "chosen" in dict(rows) else "vs fastest", "vs", _vs))
    g = Grid(title, cols)
    for name, e in rows:
        row = [name, str(e.strategy), e.memory.total / GIB, e.fits,
               e.bytes_per_rank("inter"), e.bytes_per_rank("intra"), e.time.compute_s,
               e.time.optimizer_s, e.time.exposed_comm_s, e.step_s, e.tokens_per_s, e.mfu]
        if ref is not None:
            gain = (e.step_s / ref.step_s if "chosen" in dict(rows) else ref.step_s / e.step_s) - 1
            same = e is ref or str(e.strategy) == str(ref.strategy)
            row.append(None if same or not e.fits else (gain, abs(gain) <= band))
        g.rows.append(row)
    if ref is not None:
        from amsp_planner.report.plan_report import band_words

        g.caption = (f"tie: within the {band_words(band)} (the error of the predicted ratio "
                     "of two strategies, docs/validation.md), which cannot tell such rows apart")
    return g


SCHEDULE_COLS = [
    Col("phase", "phase", right=False), Col("op", "op", right=False),
    Col("group", "group", right=False), Col("size", "group_size", wide=True),
    Col("stride", "stride", wide=True), Col("per node", "members_per_node", wide=True),
    Col("dtype", "dtype", right=False, wide=True), Col("calls", "calls_per_step", _count, wide=True),
    Col("full bytes", "full_bytes_per_step", bytes_h, wide=True),
    Col("intra/GPU", "intra_bytes_per_rank_per_step", bytes_h),
    Col("inter/GPU", "inter_bytes_per_rank_per_step", bytes_h), Col("time", "time_s", secs),
]


def schedule_grid(e: Evaluation) -> Grid:
    g = Grid("collective schedule (per step, per GPU)", SCHEDULE_COLS)
    g.rows = [[getattr(s, c.key) for c in SCHEDULE_COLS] for s in e.schedule]
    return g


MEMORY_TERMS = ("params", "grads", "optimizer", "hpz", "gather_buffers", "grad_buffers",
                "staging", "step_buffer", "activations", "loss_peak", "fragmentation",
                "communicators", "context")


def memory_grid(e: Evaluation) -> Grid:
    g = Grid("memory per GPU", [Col("term", "term", right=False), Col("GiB", "bytes", gib)])
    m = e.memory
    g.rows = [[name, getattr(m, name)] for name in MEMORY_TERMS if getattr(m, name)]
    g.rows += [["total", m.total], ["limit", e.memory_limit]]
    return g


def inapplicable_line(job, tp: int = 1) -> str | None:
    """The named baselines this job leaves out, each with its reason (None when none is); with
    `tp`, over its data-parallel ranks."""
    from amsp_planner.strategy import inapplicable_baselines

    out = inapplicable_baselines(job.num_gpus // tp, max(1, job.gpus_per_node // tp))
    if not out:
        return None
    by_reason: dict[str, list[str]] = {}
    for name, why in out.items():
        by_reason.setdefault(why, []).append(name)
    return "not applicable here: " + "; ".join(f"{', '.join(names)} ({why})"
                                               for why, names in by_reason.items())
