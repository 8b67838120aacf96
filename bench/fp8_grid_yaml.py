"""Turn measurements of bench/fp8_linear.py into grids in presets/fp8_matmul.yaml's format.

    python bench/fp8_grid_yaml.py bench/data/fp8_linear_h200_kernels.json [more.json ...]

The files' rows are merged (a later file's row replaces an earlier one of the same shape);
they must cover every (M, K, N) of their axes. Prints one grid per recipe (YAML, to paste under
``grids:`` with the source and date filled in); a gap in the rows is named, exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amsp_planner.calibrate_fp8 import RECIPES, grids_from_rows  # noqa: E402


def merged(paths: list[str]) -> tuple[list[dict], dict]:
    rows, machine = {}, {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        machine = doc.get("machine", machine)
        for r in doc["rows"]:
            rows[r["M"], r["K"], r["N"]] = r
    return list(rows.values()), machine


def missing(rows: list[dict]) -> list[tuple[int, int, int]]:
    axes = [sorted({r[a] for r in rows}) for a in ("M", "K", "N")]
    have = {(r["M"], r["K"], r["N"]) for r in rows}
    return [(m, k, n) for m in axes[0] for k in axes[1] for n in axes[2] if (m, k, n) not in have]


def to_yaml(grid: dict, machine: dict) -> str:
    gpu = machine.get("gpu", "?")
    lines = [f"  - id: measured-{grid['recipe']}-{gpu.split()[-1].lower()}",
             "    source: torchao   # the recipe family measured (calibrate_fp8.py)",
             "    gpu_arch: hopper",
             f"    gpu: {gpu}",
             "    gpu_names: []   # presets/gpus.yaml names it prices; empty: the whole arch",
             f"    recipe: {grid['recipe']}",
             "    measures: linear_fwd_bwd_kernels",
             f"    software: \"torch {machine.get('torch', '?')}, {machine.get('mode', '?')}\"",
             f"    M: {grid['M']}", f"    K: {grid['K']}", f"    N: {grid['N']}",
             "    speedup:"]
    nk = len(grid["K"])
    for i, row in enumerate(grid["speedup"]):
        if i % nk == 0:
            lines.append(f"      # M = {grid['M'][i // nk]}")
        vals = ", ".join(f"{v:.2f}" for v in row)
        lines.append(f"      - [{vals}]   # K = {grid['K'][i % nk]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python bench/fp8_grid_yaml.py MEASUREMENT.json [...]", file=sys.stderr)
        return 2
    rows, machine = merged(argv)
    gaps = missing(rows)
    if gaps:
        print(f"error: the rows miss {len(gaps)} of the axes' shapes (first: M={gaps[0][0]} "
              f"K={gaps[0][1]} N={gaps[0][2]}): measure them (bench/fp8_linear.py --shapes)",
              file=sys.stderr)
        return 2
    recipes = [r for r in RECIPES if all(f"{r}_s" in row for row in rows)]
    for g in grids_from_rows(rows, "", recipes):
        print(to_yaml(g, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
