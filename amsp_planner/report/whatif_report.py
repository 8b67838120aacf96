"""Tables, CSV and JSON of what-if sweeps (strings and rich tables; never prints)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

from amsp_planner.errors import AmspUserError
from amsp_planner.outfile import check_output, contains, write_output
from amsp_planner.report.fmt import secs
from amsp_planner.whatif import Row, Sweep

FORMAT = "amsp-whatif"
VERSION = 1

_AXIS_TITLES = {"model": "model", "cluster": "cluster", "gpu_type": "GPU", "seq_len": "seq",
                "global_batch": "batch", "memory_limit_gib": "mem limit GiB", "gpus": "GPUs"}


def _axis_title(axis: str) -> str:
    return _AXIS_TITLES.get(axis, axis.removeprefix("set:"))


def _fmt_value(v) -> str:
    if v is None:
        return "default"
    if isinstance(v, float) and v.is_integer():
        return f"{v:.0f}"
    return str(v)


def title(sweep: Sweep) -> str:
    """The fixed axes in one line (the varying ones are columns / series)."""
    parts = []
    vary = set(sweep.varying())
    for axis, vals in sweep.axes():
        if axis in vary or axis == "gpus":
            continue
        v = vals[0]
        if v is None and axis in ("gpu_type", "memory_limit_gib"):
            continue
        if axis == "cluster":
            parts.append(f"on {v or 'dgx-a100-hdr'}")
        elif axis == "model":
            parts.append(str(v))
        elif axis == "global_batch":
            parts.append(f"batch {v if v is not None else '4M'}"
                         + (" seqs" if isinstance(v, int) else ""))
        else:
            parts.append(f"{_axis_title(axis)} {_fmt_value(v)}")
    return ", ".join(parts)


def _key_axes(sweep: Sweep, leave_out: str | None = None) -> list[str]:
    keys = [a for a in sweep.varying() if a != leave_out]
    if "gpus" not in keys and leave_out != "gpus":
        keys.append("gpus")
    return keys


def _status_cell(r: Row, notes: dict[str, int]) -> str:
    if r.ok:
        return r.strategy
    n = notes.setdefault(r.reason, len(notes) + 1)
    return f"{r.status} [{n}]"


def _money(x: float | None) -> str:
    return "" if x is None else f"${x:,.2f}"


def sweep_table(sweep: Sweep, rows: Sequence[Row]):
    """One row per point: the swept values, the optimum and the best named baseline."""
    from rich.table import Table

    keys = _key_axes(sweep)
    priced = any(r.usd_per_btok is not None for r in rows)
    t = Table(title=f"what-if: {title(sweep)} ({len(rows)} points)", title_justify="left")
    for a in keys:
        t.add_column(_axis_title(a), justify="left" if a in ("model", "cluster", "gpu_type")
                     else "right")
    t.add_column("strategy", overflow="fold", min_width=14)
    for col in ("mem GiB", "step (compute + optimizer + exposed)", "tokens/s", "MFU"):
        t.add_column(col, justify="right")
    if priced:
        t.add_column("$/B tokens", justify="right")
    for col in ("best baseline", "its tokens/s", "its MFU", "gain"):
        t.add_column(col, justify="left" if col == "best baseline" else "right")
    notes: dict[str, int] = {}
    for r in rows:
        cells = [_fmt_value(r.point.get(a)) for a in keys]
        if r.ok:
            cells += [r.strategy, f"{r.memory_gib:,.1f}",
                      f"{secs(r.step_s)} ({secs(r.compute_s)} + {secs(r.optimizer_s)} + "
                      f"{secs(r.exposed_comm_s)})",
                      f"{r.tokens_per_s:,.0f}", f"{r.mfu * 100:.1f}%"]
            if priced:
                cells.append(_money(r.usd_per_btok))
            if r.baseline:
                cells += [r.baseline, f"{r.baseline_tokens_per_s:,.0f}",
                          f"{r.baseline_mfu * 100:.1f}%", f"{r.gain * 100:+.1f}%"]
            else:
                cells += ["none fits", "", "", ""]
        else:
            cells += [_status_cell(r, notes), "", "", "", ""] + ([""] if priced else [])
            cells += ["", "", "", ""]
        t.add_row(*cells)
    return t


def compare_table(sweep: Sweep, rows: Sequence[Row]):
    """Clusters side by side: one row per job, per cluster its optimum (and cost)."""
    from rich.table import Table

    clusters = [c for c in sweep.clusters]
    keys = _key_axes(sweep, leave_out="cluster")
    priced = any(r.usd_per_btok is not None for r in rows)
    by_job: dict[tuple, dict] = {}
    for r in rows:
        job = tuple(r.point.get(a) for a in keys)
        by_job.setdefault(job, {})[r.point.get("cluster")] = r
    t = Table(title=f"clusters side by side: {title(sweep)}", title_justify="left")
    for a in keys:
        t.add_column(_axis_title(a), justify="left" if a in ("model", "gpu_type") else "right")
    for c in clusters:
        for col in ("strategy", "tokens/s", "MFU") + (("$/B tokens",) if priced else ()):
            t.add_column(f"{c}\n{col}", justify="left" if col == "strategy" else "right")
    first = clusters[0]
    for c in clusters[1:]:
        t.add_column(f"{c}\nvs {first}", justify="right")
    notes: dict[str, int] = {}
    for job, per in by_job.items():
        cells = [_fmt_value(v) for v in job]
        for c in clusters:
            r = per.get(c)
            if r is not None and r.ok:
                cells += [r.strategy, f"{r.tokens_per_s:,.0f}", f"{r.mfu * 100:.1f}%"]
                if priced:
                    cells.append(_money(r.usd_per_btok))
            else:
                cells += [_status_cell(r, notes) if r else "", "", ""] + ([""] if priced else [])
        a = per.get(first)
        for c in clusters[1:]:
            b = per.get(c)
            if a is not None and b is not None and a.ok and b.ok:
                txt = f"{b.tokens_per_s / a.tokens_per_s:.2f}x tokens/s"
                if priced and a.usd_per_btok and b.usd_per_btok:
                    txt += f", {b.usd_per_btok / a.usd_per_btok:.2f}x $"
                cells.append(txt)
            else:
                cells.append("")
        t.add_row(*cells)
    return t


def footnotes(rows: Sequence[Row]) -> list[str]:
    """'[n] reason' for each distinct reason of an invalid or infeasible row."""
    seen: dict[str, int] = {}
    for r in rows:
        if not r.ok and r.reason not in seen:
            seen[r.reason] = len(seen) + 1
    return [f"[{n}] {reason}" for reason, n in seen.items()]


# ----- files ----------------------------------------------------------------------------------
def _columns(rows: Sequence[Row]) -> list[str]:
    cols: dict[str, None] = {}
    for r in rows:
        cols.update(dict.fromkeys(r.to_dict()))
    return list(cols)


def csv_text(rows: Sequence[Row]) -> str:
    buf = io.StringIO()
    wr = csv.DictWriter(buf, fieldnames=_columns(rows), lineterminator="\n")
    wr.writeheader()
    for r in rows:
        wr.writerow({k: ("" if v is None else v) for k, v in r.to_dict().items()})
    return buf.getvalue()


def to_json(sweep: Sweep, rows: Sequence[Row]) -> str:
    doc = {
        "format": FORMAT, "version": VERSION,
        "axes": {a.removeprefix("set:"): list(v) for a, v in sweep.axes()},
        "varying": [a.removeprefix("set:") for a in sweep.varying()],
        "options": {k: v for k, v in vars(sweep.options).items() if k != "gpu_hour_price"},
        "gpu_hour_price": {str(c or "*"): p for c, p in sweep.options.gpu_hour_price},
        "rows": [r.to_dict() for r in rows],
    }
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def _is_plot(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(8).startswith((b"\x89PNG", b"%PDF", b"<?xml", b"<svg", b"%!PS"))


# option -> (what it holds, how an earlier one of it is recognised): only those are replaced
OUTPUTS = {
    "--csv": ("a what-if CSV", contains("index,", ",strategy,sharding,memory_gib,step_s,")),
    "--json": ("a what-if JSON", contains(f'"format": "{FORMAT}"')),
    "--plot": ("a plot", _is_plot),
}


def check_outputs(paths: dict[str, str | None]) -> None:
    """Refuse, before the sweep runs, any output path that could not be written or would
    replace something else; and a plot format matplotlib cannot write."""
    for option, path in paths.items():
        if path and path != "-":
            check_output(path, option, *OUTPUTS[option])
    plot = paths.get("--plot")
    if plot:
        from matplotlib.backend_bases import FigureCanvasBase

        ext = Path(plot).suffix.lstrip(".").lower()
        kinds = FigureCanvasBase.get_supported_filetypes()
        if ext and ext not in kinds:
            raise AmspUserError(f"--plot {plot}: matplotlib cannot write '.{ext}' images: use "
                                ".png, .svg or .pdf")


def write(option: str, path, content) -> Path:
    """Write one output (text, or a function writing a temporary path) atomically."""
    return write_output(path, option, *OUTPUTS[option], content)
