"""Pictures of what-if sweeps (matplotlib, headless: an Agg canvas, never pyplot).

`sweep_figure` draws MFU and tokens/s against the swept axis, one line per series (cluster,
model, --set value, ...), and marks every point where the optimal sharding changes along a line
with a ringed marker and the new strategy's text.
"""

from __future__ import annotations

from collections.abc import Sequence

from amsp_planner.whatif import Row

LABELS = {
    "gpus": "GPUs", "seq_len": "sequence length (tokens)", "memory_limit_gib": "memory limit (GiB)",
    "global_batch": "global batch", "node_gbit_per_s": "NIC Gbit/s per node",
    "nic_gbit_per_s": "Gbit/s per NIC",
}


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


def sweep_figure(rows: Sequence[Row], x_axis: str, series_axes: Sequence[str], title: str = "",
                 width_in: float = 11.0, height_in: float = 8.0, dpi: int = 100):
    """A Figure with MFU (top) and tokens/s (bottom) against `x_axis`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax_mfu, ax_tps = fig.subplots(2, 1, sharex=True)
    lines = series(rows, x_axis, series_axes)
    xs_all = sorted({_x(r, x_axis) for r in rows})
    log_x = x_axis in ("gpus", "seq_len", "global_batch") and len(xs_all) > 1 and xs_all[0] > 0
    changed_any = False
    for i, (name, rs) in enumerate(lines.items()):
        color = f"C{i % 10}"
        xs = [_x(r, x_axis) for r in rs]
        mfu = [r.mfu * 100 if r.ok else float("nan") for r in rs]
        tps = [r.tokens_per_s if r.ok else float("nan") for r in rs]
        ax_mfu.plot(xs, mfu, "o-", color=color, label=name, markersize=4)
        ax_tps.plot(xs, tps, "o-", color=color, label=name, markersize=4)
        bad = [x for x, r in zip(xs, rs, strict=True) if not r.ok]
        if bad:
            ax_mfu.plot(bad, [0] * len(bad), "x", color=color, markersize=7)
        prev = None
        for k, r in enumerate(rs):
            if not r.ok:
                continue
            if r.sharding != prev:
                changed_any = True
                for ax, y in ((ax_mfu, r.mfu * 100), (ax_tps, r.tokens_per_s)):
                    ax.plot([xs[k]], [y], "o", markersize=11, markerfacecolor="none",
                            markeredgecolor=color, markeredgewidth=1.5)
                ax_mfu.annotate(r.sharding, (xs[k], r.mfu * 100), textcoords="offset points",
                                xytext=(4, 6 + 9 * (i % 3)), fontsize=6.5, color=color,
                                rotation=20)
            prev = r.sharding
    for ax in (ax_mfu, ax_tps):
        ax.grid(True, alpha=0.3)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs_all)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_mfu.margins(y=0.2)
    ax_mfu.set_ylabel("MFU (%)")
    ax_tps.set_ylabel("tokens/s")
    if log_x:
        ax_tps.set_yscale("log")
    ax_tps.set_xlabel(axis_label(x_axis))
    ax_mfu.legend(fontsize=7, loc="lower left", ncol=2)
    note = "ringed points: the optimal sharding changes (text: the new strategy)"
    if changed_any:
        ax_tps.text(0.99, 0.02, note, transform=ax_tps.transAxes, ha="right", fontsize=7,
                    color="0.35")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def save_sweep_plot(rows: Sequence[Row], path, x_axis: str, series_axes: Sequence[str],
                    title: str = "") -> None:
    fig = sweep_figure(rows, x_axis, series_axes, title)
    fig.savefig(path)
