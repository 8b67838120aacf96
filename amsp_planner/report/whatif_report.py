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
from amsp_planner.report.grid import Col, Grid
from amsp_planner.whatif_grid import Row, Sweep

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


def _pct(v) -> str:
    return f"{v * 100:.1f}%"


def _count(v) -> str:
    return f"{v:,.0f}"


def _axis_cols(keys: list[str]) -> list[Col]:
    return [Col(_axis_title(a), a, _fmt_value, right=a not in ("model", "cluster", "gpu_type"))
            for a in keys]


def sweep_grid(sweep: Sweep, rows: Sequence[Row]) -> Grid:
    """One row per point: the swept values, the optimum and the best named baseline."""
    keys = _key_axes(sweep)
    priced = any(r.usd_per_btok is not None for r in rows)
    cols = _axis_cols(keys) + [
        Col("strategy", "strategy", right=False, strategy=True),
        Col("mem GiB", "memory_gib", lambda v: f"{v:,.1f}"),
        Col("step", "step_s", secs, drop=2),
        Col("compute", "compute_s", secs, wide=True),
        Col("optimizer", "optimizer_s", secs, wide=True),
        Col("exposed comm", "exposed_comm_s", secs, wide=True),
        Col("tokens/s", "tokens_per_s", _count), Col("MFU", "mfu", _pct, drop=3)]
    if priced:
        cols.append(Col("$/B tokens", "usd_per_btok", _money))
    cols += [Col("best baseline", "baseline", right=False, wide=True),
             Col("its tokens/s", "baseline_tokens_per_s", _count, wide=True),
             Col("its MFU", "baseline_mfu", _pct, wide=True),
             Col("gain", "gain_vs_baseline", lambda v: f"{v * 100:+.1f}%"),
             Col("margin", "gain_is_tie", lambda v: "tie" if v else "beyond band",
                 words=True)]
    g = Grid(f"what-if: {title(sweep)} ({len(rows)} points)", cols)
    band = next((r.band for r in rows if r.band is not None), None)
    if band is not None:
        from amsp_planner.report.plan_report import band_words

        g.caption = (f"margin: the gain over the best baseline against the {band_words(band)} "
                     "(the error of the predicted ratio of two strategies, docs/validation.md);"
                     " a tie is not a decision")
    notes: dict[str, int] = {}
    for r in rows:
        d = r.to_dict()
        cells = [r.point.get(a) for a in keys]
        cells += [d.get(c.key) for c in cols[len(keys):]]
        if not r.ok:
            cells[len(keys)] = _status_cell(r, notes)
        elif r.reason:  # kept no slower than a point with less of a resource (monotone.py)
            cells[len(keys)] = f"{r.strategy} *"
        if r.ok and not r.baseline:
            cells[[c.key for c in cols].index("baseline")] = "none fits"
        g.rows.append(cells)
    return g


def compare_grid(sweep: Sweep, rows: Sequence[Row]) -> Grid:
    """Clusters side by side: one row per job, per cluster its optimum (and cost)."""
    clusters = list(sweep.clusters)
    keys = _key_axes(sweep, leave_out="cluster")
    priced = any(r.usd_per_btok is not None for r in rows)
    by_job: dict[tuple, dict] = {}
    for r in rows:
        by_job.setdefault(tuple(r.point.get(a) for a in keys), {})[r.point.get("cluster")] = r
    cols = _axis_cols(keys)
    fields = [("strategy", False), ("tokens_per_s", True), ("mfu", False)]
    fields += [("usd_per_btok", False)] if priced else []
    fmts = {"strategy": str, "tokens_per_s": _count, "mfu": _pct, "usd_per_btok": _money}
    heads = {"strategy": "strategy", "tokens_per_s": "tokens/s", "mfu": "MFU",
             "usd_per_btok": "$/B tokens"}
    for c in clusters:
        cols += [Col(f"{c} {heads[f]}", f"{c}:{f}", fmts[f], right=f != "strategy", wide=wide,
                     strategy=f == "strategy", drop=int(f == "mfu")) for f, wide in fields]
    first = clusters[0]
    cols += [Col(f"{c} vs {first}", f"{c}:vs:{first}", right=True, words=True)
             for c in clusters[1:]]
    g = Grid(f"clusters side by side: {title(sweep)}", cols)
    notes: dict[str, int] = {}
    for job, per in by_job.items():
        cells = list(job)
        for c in clusters:
            r = per.get(c)
            if r is not None and r.ok:
                cells += [getattr(r, f) for f, _ in fields]
            else:
                cells += [_status_cell(r, notes) if r else None] + [None] * (len(fields) - 1)
        a = per.get(first)
        for c in clusters[1:]:
            b = per.get(c)
            txt = None
            if a is not None and b is not None and a.ok and b.ok:
                txt = f"{b.tokens_per_s / a.tokens_per_s:.2f}x tokens/s"
                if priced and a.usd_per_btok and b.usd_per_btok:
                    txt += f", {b.usd_per_btok / a.usd_per_btok:.2f}x $"
            cells.append(txt)
        g.rows.append(cells)
    return g


def footnotes(rows: Sequence[Row]) -> list[str]:
    """'[n] reason' for each distinct reason of an invalid or infeasible row, and '*' for rows
    the monotone sweep kept no slower than a point before them."""
    seen: dict[str, int] = {}
    for r in rows:
        if not r.ok and r.reason not in seen:
            seen[r.reason] = len(seen) + 1
    out = [f"[{n}] {reason}" for reason, n in seen.items()]
    if any(r.ok and r.reason for r in rows):
        out.append("* kept no slower than the choice at the point with less of the swept "
                   "resource, which runs here (docs/whatif.md, \"Monotone sweeps\"; the row's "
                   "reason in CSV and JSON names it)")
    return out


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
        if path is not None and path != "-":  # "" too: check_output refuses it
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
