"""FP8 speed-up grids: the preset file's data (presets/fp8_matmul.yaml) and the interpolation
every grid is read with, a published or measured one alike (cost/fp8.py prices with them)."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def fp8_data() -> dict:
    import yaml

    path = Path(__file__).resolve().parent.parent / "presets" / "fp8_matmul.yaml"
    return yaml.safe_load(path.read_text())


def _axis(values: list[int], x: float) -> tuple[int, int, float, bool]:
    """Bracketing indices and weight in log2 space; clamped to the ends (flagged)."""
    lx = math.log2(x)
    logs = [math.log2(v) for v in values]
    if lx <= logs[0] or lx >= logs[-1]:
        i = 0 if lx <= logs[0] else len(values) - 1
        return i, i, 0.0, not math.isclose(lx, logs[i])
    j = next(i for i, v in enumerate(logs) if v >= lx)
    w = (lx - logs[j - 1]) / (logs[j] - logs[j - 1])
    return j - 1, j, w, False


def grid_speedup(g: dict, m: int, k: int, n: int) -> tuple[float, bool]:
    """Trilinear interpolation of a grid in (log2 M, log2 K, log2 N); a coordinate outside
    the grid takes the edge value (no extrapolation), and the result says it was clamped."""
    nk = len(g["K"])
    axes = [_axis(g["M"], m), _axis(g["K"], k), _axis(g["N"], n)]
    total = 0.0
    for bm in (0, 1):
        for bk in (0, 1):
            for bn in (0, 1):
                w = 1.0
                idx = []
                for bit, (lo, hi, t, _) in zip((bm, bk, bn), axes, strict=True):
                    w *= t if bit else 1.0 - t
                    idx.append(hi if bit else lo)
                if w:
                    total += w * g["speedup"][idx[0] * nk + idx[1]][idx[2]]
    return total, any(a[3] for a in axes)
