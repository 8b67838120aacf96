"""Fit a cluster's ``rank_jitter`` (cost/straggler.py) to published runs of one job at several
scales, and report what it does to the validation buckets.

    python bench/fit_rank_jitter.py

The straggler term is ``cv x compute x e(N)``, e(N) the expected maximum of N standard normals:
it changes the prediction of a job as its GPU count grows. Its evidence is therefore the
*shape* of a job's throughput over scale, not its level (which the compute fractions and the
engine profiles set). This script:

  families  rows in scope of one source, model, cluster (with its `set`), sequence length,
            engine, precision and strategy (micro-batch, checkpointing, TP,
            PP; a ZeRO-1 optimizer shard spanning every data-parallel rank counts as one
            strategy at every scale), published as '=' (not a bound), at two or more GPU
            counts; DeepSpeed rows are left out (their profile is being reworked apart);
  objective the sum over families of the squared deviations of log(predicted / published)
            from the family's mean: a per-family offset costs nothing, only a wrong decline
            (or rise) with scale does;
  grid      cv 0 to 0.08 in steps of 0.0025, every row re-predicted with ``rank_jitter`` set
            on its cluster (deterministic: rerunning prints the same values).

Prints the objective over the grid, the best cv over all families and per source (how much the
sources agree), and the validation buckets (median / 90th percentile / worst |throughput
error| per scale, all rows in scope) with cv = 0, the fitted cv and each source's best cv. docs/cost-model.md
("Collectives at scale") copies these figures.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from amsp_planner.validation import BUCKETS, load_rows, predict_rows, summary  # noqa: E402

GRID = [round(0.0025 * i, 4) for i in range(33)]


def _strategy_key(strategy: str, gpus: int) -> str:
    """The strategy with the GPU count taken out: an optimizer shard over every data-parallel
    rank (os = N / (tp pp)) reads 'os=all'; p=, g= and os= otherwise kept."""
    toks = strategy.split(",")
    tp = next((int(t[3:]) for t in toks if t.startswith("tp=")), 1)
    pp = next((int(t[3:]) for t in toks if t.startswith("pp=")), 1)
    out = []
    for t in toks:
        m = re.fullmatch(r"(p|g|os)=(\d+)", t)
        if m and int(m.group(2)) * tp * pp == gpus:
            t = f"{m.group(1)}=all"
        out.append(t)
    return ",".join(out)


def family_key(row: dict) -> tuple:
    return (row["source"], row["model"], row["cluster"], str(row.get("set")), row["seq_len"],
            row["engine"], str(row.get("training")), _strategy_key(row["strategy"], row["gpus"]))


def families(doc: dict, min_gpus: int = 1) -> dict[tuple, list[str]]:
    """Row ids per family (module docstring) on `min_gpus` or more GPUs, families with two or
    more GPU counts only."""
    fam: dict[tuple, list[dict]] = defaultdict(list)
    for row in doc["rows"]:
        if (row["scope"] != "in" or not row.get("strategy") or row.get("bound", "=") != "="
                or "deepspeed" in row["engine"] or row["metric"] == "memory"
                or row["gpus"] < min_gpus):
            continue
        fam[family_key(row)].append(row)
    return {k: [r["id"] for r in v] for k, v in fam.items() if len({r["gpus"] for r in v}) > 1}


def with_jitter(doc: dict, cv: float) -> dict:
    out = copy.deepcopy(doc)
    for row in out["rows"]:
        if row.get("cluster"):
            row["set"] = {**(row.get("set") or {}), "rank_jitter": cv}
    return out


def shape_sse(fams: dict, err: dict[str, float]) -> float:
    sse = 0.0
    for ids in fams.values():
        logs = [math.log(1 + err[i]) for i in ids]
        mean = statistics.fmean(logs)
        sse += sum((x - mean) ** 2 for x in logs)
    return sse


def buckets(results) -> str:
    cells = []
    for b in BUCKETS:
        s = summary([r for r in results if r.bucket == b])
        cells.append(f"{b}: {s['rows']} rows, {100 * s['median_abs_error']:.1f} / "
                     f"{100 * s['p90_abs_error']:.1f} / {100 * s['max_abs_error']:.1f} %")
    return " | ".join(cells)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--min-gpus", type=int, default=1,
                    help="fit on the rows of a family with at least this many GPUs")
    args = ap.parse_args(argv)
    doc = load_rows()
    fams = families(doc, args.min_gpus)
    n_rows = sum(len(v) for v in fams.values())
    print(f"{len(fams)} families, {n_rows} rows, sources: "
          f"{', '.join(sorted({k[0] for k in fams}))}")
    runs = {}
    for cv in GRID:
        res = predict_rows(with_jitter(doc, cv))
        runs[cv] = (res, {r.id: r.error for r in res if r.error is not None})
    by_source: dict[str, dict] = defaultdict(dict)
    print("cv      shape SSE (all families)")
    for cv, (_, err) in runs.items():
        print(f"{cv:.4f}  {shape_sse(fams, err):.5f}")
        for src in {k[0] for k in fams}:
            by_source[src][cv] = shape_sse({k: v for k, v in fams.items() if k[0] == src}, err)
    best = min(GRID, key=lambda cv: shape_sse(fams, runs[cv][1]))
    print(f"fitted cv (all families): {best:.4f}")
    for src, sse in sorted(by_source.items()):
        print(f"  best cv for {src}: {min(sse, key=sse.get):.4f} "
              f"(SSE {sse[0.0]:.5f} at 0 -> {min(sse.values()):.5f})")
    print(f"buckets, cv 0:      {buckets(runs[0.0][0])}")
    shown = {0.0}
    for cv in [best] + [min(sse, key=sse.get) for _, sse in sorted(by_source.items())]:
        if cv not in shown:
            shown.add(cv)
            print(f"buckets, cv {cv:.4f}: {buckets(runs[cv][0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
