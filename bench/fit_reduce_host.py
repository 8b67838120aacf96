"""Fit DeepSpeed's two host-time terms to the published ZeRO-3 runs of GPT-3 175B, each priced
with the profile of the release that ran it, and print the 530B runs of the same sources as
held out; every other value of the cost model stays as it is:

- ``reduce_host_us`` of the current profile (``engines.REDUCE_HOST_US``): the per-(rank, tensor)
  interleave of ``reduce_scatter_coalesced`` (DeepSpeed >= 0.6.0), fitted to the runs of
  DeepSpeed 0.6.2 (the DeepSpeed Azure blog: 175B at 128-1,024 A100s, rows azure-175b-*; 530B
  at 512 and 1,024, azure-530b-*, held out);
- ``gather_host_us`` of ``deepspeed@0.3.14`` (``engine_versions.GATHER_HOST_US_0_3_14``): the
  per-(rank, gathered parameter) list all-gather of that release, fitted to the 175B runs of
  arXiv 2104.04473 Table 2 (mz3-175b-*), its 530B runs (mz3-530b-*) held out.

    python bench/fit_reduce_host.py [--step 0.5]

Each value minimises the sum of squared relative throughput errors over its fitted rows that
fit in memory, on a grid. Both stand in partly for what the model lacks at these scales
(docs/cost-model.md), so the fits are redone whenever the rest of the model moves these rows
(tests/test_fused_qkv.py keeps both constants at their fits).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from amsp_planner import engines  # noqa: E402
from amsp_planner.validation import load_rows, predict_rows  # noqa: E402

TERMS = {  # profile key: (Execution field, fitted rows, held-out rows, grid lo, hi)
    "deepspeed": ("reduce_host_us", "azure-175b-", "azure-530b-", 0.0, 40.0),
    "deepspeed@0.3.14": ("gather_host_us", "mz3-175b-", "mz3-530b-", 0.0, 80.0),
}


def rows_of(doc: dict, key: str) -> dict:
    """The in-scope rows of `key`'s fit and its held-out set."""
    _, fit, held, _, _ = TERMS[key]
    return {**doc, "rows": [r for r in doc["rows"]
                            if r["id"].startswith((fit, held)) and r["scope"] == "in"]}


def errors(doc: dict, us: float, key: str = "deepspeed") -> dict[str, float]:
    """Throughput error of each row of `doc` that fits in memory, with the profile `key`'s
    term = `us`; the profile is restored after."""
    field = TERMS[key][0]
    base = engines.PROFILES[key]
    engines.PROFILES[key] = dataclasses.replace(
        base, execution=dataclasses.replace(base.execution, **{field: us}))
    try:
        return {r.id: r.error for r in predict_rows(doc) if r.fits and r.error is not None}
    finally:
        engines.PROFILES[key] = base


def sse(doc: dict, us: float, key: str = "deepspeed") -> float:
    fit = TERMS[key][1]
    return sum(v * v for k, v in errors(doc, us, key).items() if k.startswith(fit))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", type=float, default=0.5)
    a = ap.parse_args(argv)
    doc = load_rows()
    for key, (field, fit, _, lo, hi) in TERMS.items():
        rows = rows_of(doc, key)
        grid = [lo + i * a.step for i in range(int((hi - lo) / a.step) + 1)]
        best = min(grid, key=lambda us: sse(rows, us, key))
        now = getattr(engines.PROFILES[key].execution, field)
        print(f"\n{key} {field} fitted: {best:g} us (the profile has {now:g})\n")
        print("| row | error at the fit | fitted or held out |")
        print("| --- | ---: | --- |")
        for k, v in errors(rows, best, key).items():
            print(f"| {k} | {v * 100:+.1f} % | {'fitted' if k.startswith(fit) else 'held out'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
