"""Pictures of what-if sweeps (matplotlib, headless: an Agg canvas, never pyplot).

`sweep_figure` draws MFU and tokens/s against the swept axis, one line per series (cluster,
model, --set value, ...), and puts a letter where the optimal sharding changes along a line
(the key under the plot spells the letters out). Points without a plan are hollow triangles at
the top edge, never an MFU of 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from amsp_planner.whatif_grid import Row

LABELS = {
    "gpus": "GPUs", "seq_len": "sequence length (tokens)", "memory_limit_gib": "memory limit (GiB)",
    "global_batch": "global batch", "node_gbit_per_s": "NIC Gbit/s per node",
    "nic_gbit_per_s": "Gbit/s per NIC",
}

SERIES_UNITS = {"node_gbit_per_s": "Gb/s per node", "nic_gbit_per_s": "Gb/s per NIC",
                "memory_limit_gib": "GiB limit", "intra_gbyte_per_s": "GB/s in-node"}


def axis_label(axis: str) -> str:
    key = axis.removeprefix("set:")
    return LABELS.get(key, key)


def _series_name(row: Row, series_axes: Sequence[str]) -> str:
    parts = []
    for a in series_axes:
        v = row.point.get(a)
        key = a.removeprefix("set:")
        if a in ("model", "cluster", "gpu_type"):
            parts.append(str(v if v is not None else row.cluster_name))
        elif key in SERIES_UNITS:
            parts.append(f"{v:g} {SERIES_UNITS[key]}")
        else:
            parts.append(f"{key}={v}")
    return ", ".join(parts) or "sweep"


def series(rows: Sequence[Row], x_axis: str, series_axes: Sequence[str]
           ) -> dict[str, list[Row]]:
    """Rows grouped into lines (in first-seen order), each sorted along the x axis."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(_series_name(r, series_axes), []).append(r)
    for k in out:
        out[k].sort(key=lambda r: _x(r, x_axis))
    return out


def _x(row: Row, x_axis: str) -> float:
    v = row.point.get(x_axis)
    if x_axis == "global_batch":
        return float(row.batch_tokens or 0)
    return float(v) if v is not None else 0.0


def strategy_codes(lines: dict[str, list[Row]]) -> dict[str, str]:
    """A letter for each sharding that appears, in order of first appearance along the lines."""
    codes: dict[str, str] = {}
    for rs in lines.values():
        for r in rs:
            if r.ok and r.sharding not in codes:
                n = len(codes)
                codes[r.sharding] = chr(65 + n % 26) + ("" if n < 26 else str(n // 26))
    return codes


def sweep_figure(rows: Sequence[Row], x_axis: str, series_axes: Sequence[str], title: str = "",
                 width_in: float = 12.0, height_in: float = 9.0, dpi: int = 100):
    """A Figure with MFU (top) and tokens/s (bottom) against `x_axis`.

    Along each line, every point where the optimal sharding differs from the previous point's
    (and the first point) gets a letter, stacked above the point by line so letters of
    different lines never overlap; the key under the plot spells the letters out. Invalid and
    infeasible points are gaps in the line and hollow triangles at the MFU panel's top edge.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    lines = series(rows, x_axis, series_axes)
    codes = strategy_codes(lines)
    key_rows = -(-len(codes) // 3)
    key_h = min(0.4, 0.03 + 0.022 * key_rows)
    ax_mfu, ax_tps = fig.subplots(2, 1, sharex=True)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.94, bottom=0.07 + key_h, hspace=0.08)
    xs_all = sorted({_x(r, x_axis) for r in rows})
    log_x = x_axis in ("gpus", "seq_len", "global_batch") and len(xs_all) > 1 and xs_all[0] > 0
    no_plan = False
    for i, (name, rs) in enumerate(lines.items()):
        color = f"C{i % 10}"
        xs = [_x(r, x_axis) for r in rs]
        mfu = [r.mfu * 100 if r.ok else float("nan") for r in rs]
        tps = [r.tokens_per_s if r.ok else float("nan") for r in rs]
        ax_mfu.plot(xs, mfu, "o-", color=color, label=name, markersize=4)
        ax_tps.plot(xs, tps, "o-", color=color, label=name, markersize=4)
        bad = [x for x, r in zip(xs, rs, strict=True) if not r.ok]
        if bad:  # at the panel's top edge, hollow: no MFU value, not a 0 %
            edge = ax_mfu.get_xaxis_transform()
            ax_mfu.plot(bad, [1.0] * len(bad), "v", transform=edge, clip_on=False,
                        markerfacecolor="none", markeredgecolor=color, markersize=7)
            no_plan = True
        prev = None
        for k, r in enumerate(rs):
            if not r.ok:
                continue
            if r.sharding != prev:  # one letter per change, stacked by line: none overlap
                ax_mfu.annotate(codes[r.sharding], (xs[k], r.mfu * 100),
                                textcoords="offset points", xytext=(0, 6 + 9 * (i % 4)),
                                ha="center", fontsize=8, fontweight="bold", color=color)
            prev = r.sharding
    for ax in (ax_mfu, ax_tps):
        ax.grid(True, alpha=0.3)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs_all)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_mfu.margins(y=0.3)  # room above the lines for the stacked letters
    ax_mfu.set_ylabel("MFU (%)")
    ax_tps.set_ylabel("tokens/s")
    if log_x:
        ax_tps.set_yscale("log")
    ax_tps.set_xlabel(axis_label(x_axis))
    if len(lines) > 1:  # one line needs no legend: the title names it
        ax_mfu.legend(fontsize=7, loc="lower left", ncol=2)
    if no_plan:
        ax_mfu.annotate("\u25bd at the top: no plan there (not a valid job, or nothing fits; see "
                        "the table)", (0.99, 0.02), xycoords="axes fraction", ha="right",
                        fontsize=7, color="0.3")
    if codes:
        fig.text(0.08, key_h + 0.005, "letters: the optimal sharding from that point on along "
                 "the line", fontsize=7.5, color="0.3", va="top")
        items = list(codes.items())
        for n, (sh, code) in enumerate(items):
            col, row = n // key_rows, n % key_rows
            fig.text(0.08 + 0.31 * col, key_h - 0.02 - 0.022 * row, f"{code}  {sh}",
                     fontsize=7.5, family="monospace", va="top")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
