"""The what-if plot's letters: one where a line's strategy changes shape, and no two texts of
the figure overlap, checked on the Agg renderer's own text bounding boxes."""

from __future__ import annotations

import itertools

from amsp_planner.report.plots import relative_sharding, sweep_figure
from amsp_planner.whatif_grid import Point, Row

GPUS = (64, 128, 256, 512, 1024, 2048, 4096)


def _row(i: int, net: int, gpus: int, sharding: str, mfu: float) -> Row:
    point = Point(i, (("set:node_gbit_per_s", net), ("gpus", gpus)))
    return Row(point, "ok", strategy=sharding + ",mb=1", sharding=sharding, mfu=mfu,
               tokens_per_s=mfu * gpus * 1e4)


def _texts(fig):
    """Every text the figure draws except tick labels: letters, notes, key, legend, title."""
    out = [t for ax in fig.axes for t in ax.texts]
    out += list(fig.texts)
    for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]:
        if leg is not None:
            out += list(leg.get_texts())
    return [t for t in out if t.get_visible() and t.get_text()]


def _letters(fig):
    return [t for t in fig.axes[0].texts if len(t.get_text()) <= 3]


def _assert_no_overlap(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _texts(fig)]
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        # strict: boxes that only touch do not overlap
        inter = (min(ba.x1, bb.x1) - max(ba.x0, bb.x0), min(ba.y1, bb.y1) - max(ba.y0, bb.y0))
        assert not (inter[0] > 0 and inter[1] > 0), (a, ba, b, bb)


def test_letters_never_overlap_even_when_every_point_changes():
    """Eight lines on top of each other (the same MFU), the strategy changing shape at every
    point: the worst case for letters. None overlaps another, the legend or the key."""
    shapes = ["p=8,g=8,os=N", "p=N,g=N,os=N", "p=N,g=N,os=N,hpz=8", "p=8,g=N,os=N",
              "p=N,g=N,os=N,qwz,qgz", "p=16,g=16,os=N", "p=N,g=N,os=N,hpz=2"]
    rows, i = [], 0
    for net in (100, 200, 300, 400, 500, 600, 700, 800):
        for k, gpus in enumerate(GPUS):
            sh = shapes[(k + net // 100) % len(shapes)].replace("N", str(gpus))
            rows.append(_row(i, net, gpus, sh, 0.5))
            i += 1
    fig = sweep_figure(rows, "gpus", ["set:node_gbit_per_s"], "worst case")
    letters = _letters(fig)
    assert len(letters) >= 20  # most of the 56 changes found room
    key = " ".join(t.get_text() for t in fig.texts)
    left_out = 56 - len(letters)
    assert (f"{left_out} letter(s) left out" in key) == (left_out > 0)
    _assert_no_overlap(fig)


def test_a_line_that_keeps_its_shape_is_lettered_once():
    """p=8,g=8,os=N from 64 to 4,096 GPUs is one strategy growing with the job: one letter per
    line, not one per point (as when os=64, os=128, ... counted as changes)."""
    rows, i = [], 0
    for net, shape in ((100, "p=8,g=8,os={n}"), (400, "p={n},g={n},os={n},hpz=8")):
        for gpus in GPUS:
            rows.append(_row(i, net, gpus, shape.format(n=gpus), 0.6 - 0.01 * (i % 7)))
            i += 1
    assert relative_sharding(rows[3]) == "p=8,g=8,os=N"
    fig = sweep_figure(rows, "gpus", ["set:node_gbit_per_s"], "two lines")
    assert sorted(t.get_text() for t in _letters(fig)) == ["A", "B"]
    key = [t.get_text() for t in fig.texts]
    assert "A  p=8,g=8,os=N" in key and "B  p=N,g=N,os=N,hpz=8" in key
    _assert_no_overlap(fig)
