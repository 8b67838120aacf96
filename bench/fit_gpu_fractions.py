"""Fit the GPU table's matmul and attention fractions per GPU generation, and report the error
on the rows the fit did not see.

    python bench/fit_gpu_fractions.py [--arch hopper ampere]

``achievable_fraction`` (large bf16 matmuls) and ``attention_fraction`` (flash attention,
forward + backward) of presets/gpus.yaml are the two free constants of the compute model
(cost/compute.py) per GPU generation: every GPU of one ``arch`` shares them. This script fits
them on a stated subset of the published rows of amsp_planner/presets/validation.yaml and
holds the others out:

  fit subset   bf16 throughput rows in scope on one node (<= 8 GPUs) of that generation: the
               step is compute, the elementwise kernels and the optimizer, with little
               communication to confound the rates;
  held out     every other row in scope of that generation: multi-node bf16 rows and every
               FP8 row (whose speed-up over bf16 the fit must therefore predict, not absorb).

Objective: the mean |throughput error| over the fit subset, searched on the grid achievable
0.40-0.90 and attention 0.20-0.60 in steps of 0.02, then in steps of 0.01 within 0.02 of the
best point (deterministic: rerunning prints the same values).
The table's other GPU constants (HBM fraction, kernel overhead, contention) are held fixed.
Prints the fitted pair, the fit-subset band and the held-out bands per scale bucket; the
values in gpus.yaml are copied from this output (its header names this script).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from amsp_planner.specs import load_cluster  # noqa: E402
from amsp_planner.validation import (  # noqa: E402
    BUCKETS,
    cluster_ref,
    load_rows,
    predict_rows,
    scale_bucket,
)

GRID_A = [round(0.40 + 0.02 * i, 2) for i in range(26)]
GRID_B = [round(0.20 + 0.02 * i, 2) for i in range(21)]
FIT_MAX_GPUS = 8
ATTENTION = {"ampere": 0.45, "hopper-700w": 0.32, "hopper-500w": 0.32}
"""attention_fraction held fixed (presets/gpus.yaml: FlashAttention-2's published rates, Dao,
arXiv 2307.08691, figures 4-7; not fitted here unless --fit-attention)."""


GROUPS = {
    "ampere": ("A100-SXM4-40GB", "A100-SXM4-80GB", "A800-SXM4-80GB"),
    "hopper-700w": ("H100-SXM5-80GB", "H200-SXM5-141GB"),
    "hopper-500w": ("H100-SXM5-96GB-500W",),
}
"""GPU entries that share one pair: a generation, and within Hopper the power class: the Grand
Teton H100 runs at a 500 W limit, its peak "between SXM and NVL" (torchtitan
benchmarks/llama3_h100_202412_torchtitan.md, footnote 2), the DGX H100 and H200 at 700 W."""


def arch_rows(doc: dict, arch: str) -> list[dict]:
    """The rows in scope of group `arch` that the model prices (a strategy and a cluster)."""
    out = []
    for row in doc["rows"]:
        if row.get("scope") != "in" or not row.get("cluster") or not row.get("strategy") \
                or row.get("metric") == "memory":
            continue
        if load_cluster(cluster_ref(row["cluster"]), row.get("set")).gpu.name in GROUPS[arch]:
            out.append(row)
    return out


def in_fit(row: dict) -> bool:
    return row["gpus"] <= FIT_MAX_GPUS and row.get("training", {}).get("precision",
                                                                        "bf16") == "bf16"


def errors(doc: dict, rows: list[dict], a: float, b: float) -> dict[str, float]:
    """Signed throughput error per row id with the pair (a, b) set on each row's GPU."""
    sub = copy.deepcopy(rows)
    for r in sub:
        r["set"] = {**r.get("set", {}), "gpu.achievable_fraction": a,
                    "gpu.attention_fraction": b}
    res = predict_rows({**doc, "rows": sub})
    return {r.id: r.error for r in res}


def band(errs: list[float]) -> str:
    if not errs:
        return "-"
    e = sorted(abs(x) for x in errs)
    p90 = e[min(len(e) - 1, int(round(0.9 * (len(e) - 1))))]
    return (f"{len(e)} rows, median {statistics.median(e) * 100:.1f} %, p90 {p90 * 100:.1f} %, "
            f"worst {e[-1] * 100:.1f} %, signed median {statistics.median(errs) * 100:+.1f} %")


def fit(doc: dict, arch: str, attention: float | None = None) -> tuple[float, float, list[str]]:
    rows = arch_rows(doc, arch)
    fit_rows = [r for r in rows if in_fit(r)]
    best = None

    def search(grid_a, grid_b):
        nonlocal best
        for a in grid_a:
            for b in grid_b:
                e = errors(doc, fit_rows, a, b)
                score = statistics.mean(abs(x) for x in e.values())
                if best is None or score < best[0] - 1e-12:
                    best = (score, a, b)

    grid_b = GRID_B if attention is None else [attention]
    search(GRID_A, grid_b)
    _, a0, b0 = best
    search([round(a0 + 0.01 * i, 2) for i in range(-2, 3)],
           [round(b0 + 0.01 * i, 2) for i in range(-2, 3)] if attention is None else grid_b)
    _, a, b = best
    e = errors(doc, rows, a, b)
    held = [r for r in rows if not in_fit(r)]
    lines = [f"{arch}: achievable_fraction {a:.2f}, attention_fraction {b:.2f}",
             f"  fit subset (bf16, <= {FIT_MAX_GPUS} GPUs): {band([e[r['id']] for r in fit_rows])}",
             f"  held out: {band([e[r['id']] for r in held])}"]
    for k in BUCKETS:
        sel = [e[r["id"]] for r in held if scale_bucket(r["gpus"]) == k]
        lines.append(f"    {k:7s} {band(sel)}")
    fp8 = [e[r["id"]] for r in held if r.get("training", {}).get("precision") == "fp8"]
    lines.append(f"    FP8 rows {band(fp8)}")
    return a, b, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(GROUPS))
    ap.add_argument("--fit-attention", action="store_true",
                    help="fit attention_fraction too (default: held at the GPU table's value)")
    args = ap.parse_args(argv)
    doc = load_rows()
    for arch in args.arch:
        att = None if args.fit_attention else ATTENTION[arch]
        print("\n".join(fit(doc, arch, att)[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
