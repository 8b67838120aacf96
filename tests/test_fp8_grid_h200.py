"""The H200 SXM's measured rowwise grid (presets/fp8_matmul.yaml, id amsp-rowwise-h200): it is
the measurement files' numbers, it reproduces a separate measurement run on the same GPU
(including shapes between its grid points), and only the H200 SXM reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amsp_planner.cost import fp8
from amsp_planner.specs.cluster import GpuSpec, gpu_presets

DATA = Path(__file__).resolve().parent.parent / "bench" / "data"


def _gpu(preset: str, **change) -> GpuSpec:
    return GpuSpec(**{**gpu_presets()[preset], **change})


def _ratio(row: dict) -> float:
    return row["bf16_s"] / row["rowwise_s"]


def _grid() -> dict:
    return next(g for g in fp8.fp8_data()["grids"] if g["id"] == "amsp-rowwise-h200")


def test_grid_is_the_measurement_files():
    rows = [r for f in ("a", "b")
            for r in json.loads((DATA / f"fp8_linear_h200_rowwise_{f}.json").read_text())["rows"]]
    g = _grid()
    assert len(rows) == len(g["M"]) * len(g["K"]) * len(g["N"])
    nk = len(g["K"])
    for r in rows:
        i = g["M"].index(r["M"]) * nk + g["K"].index(r["K"])
        assert g["speedup"][i][g["N"].index(r["N"])] == pytest.approx(_ratio(r), abs=0.0051)


def test_grid_reproduces_a_separate_run_on_and_between_its_points():
    """bench/data/fp8_linear_h200_static.json: an earlier run (three arms per shape) at the
    Llama-3 linears; four of its shapes lie between the grid's points (N or K = 3584, 14336)."""
    h200 = _gpu("H200-SXM5-141GB")
    rows = json.loads((DATA / "fp8_linear_h200_static.json").read_text())["rows"]
    off_grid = 0
    for r in rows:
        s = fp8.linear_speedup(h200, "rowwise", r["M"], r["K"], r["N"])
        assert s.source == "amsp-rowwise-h200" and s.how == "table"
        assert s.value == pytest.approx(_ratio(r), rel=0.04), (r["M"], r["K"], r["N"])
        off_grid += r["K"] not in _grid()["K"] or r["N"] not in _grid()["N"]
    assert off_grid == 4


def test_only_the_named_gpu_reads_it():
    h100 = _gpu("H100-SXM5-80GB")
    assert fp8.linear_speedup(h100, "rowwise", 8192, 4096, 4096).source == "torchao-rowwise-h100"
    renamed = _gpu("H200-SXM5-141GB", name="H200-NVL-custom")
    assert fp8.linear_speedup(renamed, "rowwise", 8192, 4096, 4096).source == \
        "torchao-rowwise-h100"
    # the measured H200 grid is above torchao's H100 grid at the Llama-3-8B linears (bare
    # linear, faster HBM): the two GPUs are priced apart
    h200 = _gpu("H200-SXM5-141GB")
    for k, n in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)):
        assert fp8.linear_speedup(h200, "rowwise", 8192, k, n).value > \
            fp8.linear_speedup(h100, "rowwise", 8192, k, n).value


@pytest.mark.parametrize("cluster,recipe,grid", [
    ("dgx-h200-ndr", "rowwise", "amsp-rowwise-h200 (H200 SXM"),
    ("dgx-h100-ndr", "rowwise", "torchao-rowwise-h100 (H100"),
    ("dgx-h100-ndr", "tensorwise", None),   # the roofline prices tensorwise: no grid named
])
def test_compare_names_the_grid_that_priced_the_linears(cluster, recipe, grid):
    from amsp_testlib import run_cli

    code, out, err = run_cli(["compare", "--model", "llama3-8b", "--gpus", "16", "--cluster",
                              cluster, "--engine", "torchtitan", "--precision", "bf16,fp8",
                              "--fp8-recipe", recipe])
    assert code == 0, err
    lines = [ln for ln in (out + err).splitlines() if "linears priced from the grid" in ln]
    assert [grid in ln for ln in lines] == ([True] if grid else [])
