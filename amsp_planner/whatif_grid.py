"""The grid of a what-if sweep: its axes, its points, what a point gives, and the options that
are not swept.

A ``Sweep`` holds one list of values per axis; its points are their cartesian product, in a
fixed order (``AXES`` outermost first, the ``--set`` keys in the order given, GPU count
innermost). ``SolveOptions`` are the ``amsp plan`` options every point shares; a ``Row`` is
what one point gives (the optimum, the best named baseline, the gain and whether it is a tie).
Plain data: ``whatif.py`` solves the points, ``report/whatif_report.py`` and
``report/plots.py`` show the rows.

Size limits, checked before any work: at most ``MAX_AXIS_VALUES`` values per option (counted
from the commas of the option's text, before its values are parsed) and at most ``MAX_POINTS``
points (``--max-points`` raises it, up to ``MAX_POINTS_CEILING``). The point count is the product
of the axis lengths (``len(sweep)``), never the grid itself. At about 0.1-0.3 s per point on one
core, 10,000 points are a job of tens of minutes; the product of a few long lists (1,000 x 1,000,
or 4.7e10) is not a sweep anyone can wait for, and building its list of points alone would not
fit in memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from amsp_planner.errors import AmspUserError

MAX_POINTS = 10_000
"""Points a sweep may have unless --max-points says otherwise."""
MAX_POINTS_CEILING = 100_000
"""The most --max-points may allow (the rows of a sweep are kept in memory)."""
MAX_AXIS_VALUES = 1_000
"""Values one option (one --set key) may list."""

# Axes in product order, outermost first; the --set keys go between "gpu_type" and "seq_len".
AXES = ("model", "cluster", "gpu_type", "seq_len", "global_batch", "memory_limit_gib", "gpus")


@dataclass(frozen=True)
class SolveOptions:
    """Everything of a point that is not swept (the `amsp plan` options)."""

    micro_batch: int | None = None
    activation_checkpointing: bool | int | str | None = None
    flash_attention: bool = True
    precision: str = "bf16"
    grad_accum_dtype: str = "bf16"
    zeropp: bool = True
    engine: str = "amsp"
    """The engine that runs the plans (amsp_planner/engines.py)."""
    objective: str = "time"
    solver: str = "exhaustive"
    time_limit_s: float = 30.0
    gpu_hour_price: tuple[tuple[str | None, float], ...] = ()
    """(cluster, price of one GPU-hour); cluster None prices every cluster."""
    headroom: float = 0.10
    quantization: str = "auto"
    tie_band: float | None = None
    """The choice options of `amsp plan` (``Preference``); None: the validated band."""
    prefer: str = "speed"

    def preference(self, job=None):
        from amsp_planner.solver.space import Preference

        return Preference.default(band=self.tie_band, headroom=self.headroom,
                                  quantization=self.quantization, job=job,
                                  prefer=self.prefer)


@dataclass(frozen=True)
class Point:
    """One job of the sweep: (axis, value) pairs in axis order."""

    index: int
    values: tuple[tuple[str, Any], ...]

    def get(self, axis: str, default=None):
        for k, v in self.values:
            if k == axis:
                return v
        return default

    @property
    def sets(self) -> dict[str, Any]:
        return {k[4:]: v for k, v in self.values if k.startswith("set:")}


@dataclass
class Row:
    """What a point gives. Figures are None unless status is 'ok'."""

    point: Point
    status: str
    """'ok', 'infeasible' (nothing fits in memory) or 'invalid' (not a valid job)."""
    reason: str = ""
    cluster_name: str = ""
    nodes: int | None = None
    batch_tokens: int | None = None
    strategy: str | None = None
    sharding: str | None = None
    """The strategy without micro-batch and checkpointing: what a 'strategy change' means."""
    memory_gib: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    optimizer_s: float | None = None
    exposed_comm_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    inter_gib_per_gpu: float | None = None
    baseline: str | None = None
    baseline_strategy: str | None = None
    baseline_memory_gib: float | None = None
    baseline_step_s: float | None = None
    baseline_tokens_per_s: float | None = None
    baseline_mfu: float | None = None
    usd_per_btok: float | None = None
    baseline_usd_per_btok: float | None = None
    band: float | None = None
    """The band inside which the gain over the baseline is a tie."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def gain(self) -> float | None:
        """Tokens/s of the optimum over the best named baseline's, minus one."""
        if not self.ok or not self.baseline_tokens_per_s:
            return None
        return self.tokens_per_s / self.baseline_tokens_per_s - 1

    def to_dict(self) -> dict[str, Any]:
        d = {"index": self.point.index}
        d.update((k.removeprefix("set:"), v) for k, v in self.point.values)
        for f in dataclasses.fields(self):
            if f.name != "point":
                d[f.name] = getattr(self, f.name)
        d["gain_vs_baseline"] = self.gain
        d["gain_is_tie"] = None if self.gain is None else abs(self.gain) <= self.band
        return d


@dataclass(frozen=True)
class Sweep:
    """The values of each axis; `points()` is their cartesian product."""

    models: tuple[str, ...]
    gpus: tuple[int, ...]
    clusters: tuple[str | None, ...] = (None,)
    gpu_types: tuple[str | None, ...] = (None,)
    sets: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """(cluster key, its values) in the order given; dotted keys reach nested fields."""
    seq_lens: tuple[int, ...] = (4096,)
    global_batches: tuple[str | int | None, ...] = (None,)
    """Global batch per point: tokens as text ('4M', '16384'), sequences as int, None = default."""
    memory_limits_gib: tuple[float | None, ...] = (None,)
    options: SolveOptions = field(default_factory=SolveOptions)

    def axes(self) -> list[tuple[str, tuple]]:
        ax = [("model", self.models), ("cluster", self.clusters), ("gpu_type", self.gpu_types)]
        ax += [(f"set:{k}", vals) for k, vals in self.sets]
        ax += [("seq_len", self.seq_lens), ("global_batch", self.global_batches),
               ("memory_limit_gib", self.memory_limits_gib), ("gpus", self.gpus)]
        return ax

    def varying(self) -> list[str]:
        """Axes with more than one value (set keys as 'set:key')."""
        return [name for name, vals in self.axes() if len(vals) > 1]

    def points(self) -> list[Point]:
        ax = self.axes()
        names = [n for n, _ in ax]
        return [Point(i, tuple(zip(names, combo, strict=True)))
                for i, combo in enumerate(itertools.product(*(v for _, v in ax)))]

    def __len__(self) -> int:
        return math.prod(len(v) for _, v in self.axes())

    def check_size(self, max_points: int = MAX_POINTS) -> None:
        """Refuse (AmspUserError, one line) a sweep of more than `max_points` points, counted as
        the product of its axes' lengths (the grid is not built)."""
        n = len(self)
        if n <= max_points:
            return
        long = [(a, len(v)) for a, v in self.axes() if len(v) > 1]
        shape = " x ".join(f"{k:,} {axis_option(a)}" for a, k in long)
        raise AmspUserError(f"the sweep has {n:,} points ({shape}), more than the limit of "
                            f"{max_points:,}: give fewer values, or raise the limit with "
                            f"--max-points (at most {MAX_POINTS_CEILING:,})")


_OPTIONS = {"model": "--model", "cluster": "--cluster", "gpu_type": "--gpu-type",
            "seq_len": "--seq-len", "global_batch": "--global-batch",
            "memory_limit_gib": "--memory-limit", "gpus": "--gpus"}


def axis_option(axis: str) -> str:
    """The option that sets an axis: 'gpus' -> '--gpus', 'set:k' -> '--set k'."""
    return f"--set {axis[4:]}" if axis.startswith("set:") else _OPTIONS.get(axis, axis)


def check_list_length(text: str, option: str) -> None:
    """Refuse a comma list of more than MAX_AXIS_VALUES items, counted from its commas before
    any item is parsed."""
    n = text.count(",") + 1
    if n > MAX_AXIS_VALUES:
        raise AmspUserError(f"{option}: {n:,} values, more than the limit of {MAX_AXIS_VALUES:,} "
                            "per option: give fewer values")
