"""Pictures of what-if sweeps (matplotlib, headless: an Agg canvas, never pyplot).

`sweep_figure` draws MFU and tokens/s against the swept axis, one line per series (cluster,
model, --set value, ...). A strategy is named by its shape (``relative_sharding``: a shard
degree equal to the point's data-parallel GPUs is written N), so a line whose plan keeps its
shape as it grows is lettered once. Where the shape changes along a line (and at its first
point) the MFU panel gets a letter in the line's colour, placed by ``place_labels`` at the
first of a list of offsets around the point whose rendered box meets no other letter, no
point's marker, and stays inside the panel: no two letters overlap. The key under the plot spells
the letters out; the series legend sits between the title and the panels. Points without a plan
are gaps in the lines and hollow triangles at the MFU panel's top edge, never an MFU of 0.
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


def relative_sharding(row: Row) -> str:
    """The row's sharding with every shard degree equal to its data-parallel GPUs (GPUs / tp)
    written N: 'p=8,g=8,os=512' at 512 GPUs is 'p=8,g=8,os=N'."""
    tokens = row.sharding.split(",")
    tp = next((int(t[3:]) for t in tokens if t.startswith("tp=")), 1)
    dp = (row.point.get("gpus") or 0) // tp
    out = []
    for t in tokens:
        key, _, value = t.partition("=")
        out.append(f"{key}=N" if key in ("p", "g", "os") and value == str(dp) else t)
    return ",".join(out)


def strategy_codes(lines: dict[str, list[Row]]) -> dict[str, str]:
    """A letter for each strategy shape (relative_sharding) that appears, in order of first
    appearance along the lines."""
    codes: dict[str, str] = {}
    for rs in lines.values():
        for r in rs:
            if r.ok and relative_sharding(r) not in codes:
                n = len(codes)
                codes[relative_sharding(r)] = chr(65 + n % 26) + ("" if n < 26 else str(n // 26))
    return codes


OFFSETS = [(0, 8), (0, -9), (10, 0), (-10, 0), (9, 8), (-9, 8), (9, -9), (-9, -9),
           (0, 17), (0, -18), (18, 0), (-18, 0), (16, 14), (-16, 14), (16, -14), (-16, -14),
           (0, 26), (0, -27), (26, 0), (-26, 0)]
"""Where a letter may go, in points from its point, nearest first."""
MARKER_PX = 4.0
"""Half the side of the box around a point's marker that letters keep clear of (pixels)."""


def place_labels(ax, labels, obstacles=()) -> int:
    """Annotate `ax` with (x, y, text, color) labels, each at the first of OFFSETS where its
    rendered box stays inside the axes and meets neither a box already placed nor one of
    `obstacles` (display-space Bboxes); returns how many found no such place (left out).

    Needs the figure's layout final (axes positions, scales and limits): draw it first."""
    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    taken = list(obstacles)
    left_out = 0
    for x, y, text, color in labels:
        for dx, dy in OFFSETS:
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy),
                              ha="center", va="center", fontsize=8, fontweight="bold",
                              color=color, annotation_clip=False)
            box = ann.get_window_extent(renderer).padded(1.0)
            fits = (inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0
                    and box.y1 <= inside.y1)
            if fits and not any(box.overlaps(t) for t in taken):
                taken.append(box)
                break
            ann.remove()
        else:
            left_out += 1
    return left_out


def _marker_boxes(ax, points):
    from matplotlib.transforms import Bbox

    boxes = []
    for x, y in points:
        px, py = ax.transData.transform((x, y))
        boxes.append(Bbox([[px - MARKER_PX, py - MARKER_PX], [px + MARKER_PX, py + MARKER_PX]]))
    return boxes


def sweep_figure(rows: Sequence[Row], x_axis: str, series_axes: Sequence[str], title: str = "",
                 width_in: float = 12.0, height_in: float = 9.0, dpi: int = 100):
    """A Figure with MFU (top) and tokens/s (bottom) against `x_axis`.

    Along each line, every point where the strategy's shape (relative_sharding) differs from
    the previous point's (and the first point) gets a letter in the MFU panel, placed where it
    overlaps nothing (place_labels); the key under the plot spells the letters out. Invalid and
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
    key_h = min(0.4, 0.05 + 0.022 * key_rows)
    legend_rows = -(-len(lines) // 4) if len(lines) > 1 else 0
    ax_mfu, ax_tps = fig.subplots(2, 1, sharex=True)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.94 - 0.025 * legend_rows,
                        bottom=0.07 + key_h, hspace=0.08)
    xs_all = sorted({_x(r, x_axis) for r in rows})
    log_x = x_axis in ("gpus", "seq_len", "global_batch") and len(xs_all) > 1 and xs_all[0] > 0
    no_plan = False
    labels, points = [], []
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
            points.append((xs[k], r.mfu * 100))
            shape = relative_sharding(r)
            if shape != prev:  # a letter where the shape changes along the line
                labels.append((xs[k], r.mfu * 100, codes[shape], color))
            prev = shape
    for ax in (ax_mfu, ax_tps):
        ax.grid(True, alpha=0.3)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs_all)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_mfu.margins(y=0.25)  # room above and below the lines for the letters
    ax_mfu.set_ylabel("MFU (%)")
    ax_tps.set_ylabel("tokens/s")
    if log_x:
        ax_tps.set_yscale("log")
    ax_tps.set_xlabel(axis_label(x_axis))
    if title:
        fig.suptitle(title, fontsize=10, y=0.985)
    if legend_rows:  # one line needs no legend: the title names it
        fig.legend(*ax_mfu.get_legend_handles_labels(), loc="upper center", ncol=4, fontsize=7,
                   bbox_to_anchor=(0.53, 0.965), frameon=False)
    notes = []
    if no_plan:
        notes.append(ax_mfu.annotate(
            "\u25bd at the top: no plan there (not a valid job, or nothing fits; see the table)",
            (0.99, 0.02), xycoords="axes fraction", ha="right", fontsize=7, color="0.3"))
    fig.canvas.draw()  # the layout is final: letters are placed against rendered boxes
    renderer = fig.canvas.get_renderer()
    obstacles = _marker_boxes(ax_mfu, points) + [n.get_window_extent(renderer) for n in notes]
    left_out = place_labels(ax_mfu, labels, obstacles)
    if codes:
        head = ("letters: the strategy from that point on along the line; N = the point's "
                "data-parallel GPUs (GPUs / tp)")
        if left_out:
            head += f"; {left_out} letter(s) left out for lack of room (the table has them all)"
        fig.text(0.08, key_h + 0.015, head, fontsize=7.5, color="0.3", va="top")
        for n, (sh, code) in enumerate(codes.items()):
            col, row = n // key_rows, n % key_rows
            fig.text(0.08 + 0.31 * col, key_h - 0.01 - 0.022 * row, f"{code}  {sh}",
                     fontsize=7.5, family="monospace", va="top")
    return fig
