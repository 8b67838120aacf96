"""Fit the two scale terms of cost/straggler.py, a cluster's ``rank_jitter`` and its
``collective_rank_us``, to published runs of one job at several scales, and report what each
does to the validation buckets.

    python bench/fit_rank_jitter.py [--min-gpus 128]

The straggler term is ``cv x compute x e(N)``, e(N) the expected maximum of N standard
normals; the sync term ``u x the ranks of every data-parallel call``. Both change the
prediction of a job as its GPU count grows. Their evidence is therefore the *shape* of a job's
throughput over scale, not its level (which the compute fractions and the engine profiles
set). This script:

  families  rows in scope of one source, model, cluster (with its `set`), sequence length,
            engine, precision and strategy (micro-batch, checkpointing, TP, PP; a ZeRO-1
            optimizer shard spanning every data-parallel rank counts as one strategy at every
            scale), published as '=' (not a bound), at two or more GPU counts (with
            --min-gpus, counting only rows on that many GPUs or more); DeepSpeed rows are left
            out (their profile is being reworked apart);
  objective the sum over families of the squared deviations of log(predicted / published)
            from the family's mean: a per-family offset costs nothing, only a wrong decline
            (or rise) with scale does;
  grids     cv 0 to 0.08 in steps of 0.0025, u 0 to 6 us in steps of 0.25, every row
            re-predicted with the field set on its cluster (deterministic: rerunning prints
            the same values).

Prints, per field, the objective over its grid, the best value over all families and per
source (how much the sources agree), and the validation buckets (median / 90th percentile /
worst |throughput error| per scale, all rows in scope) at 0, at the fitted value and at each
source's best; then a third reading (``per_call_check``): jitter per blocking collective,
sigma x e(N) per call, solved from llm-foundry's H100 gaps at the larger scales and what it
implies at the smaller. docs/cost-model.md ("Collectives at scale") copies these figures.
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

FIELDS = {"rank_jitter": [round(0.0025 * i, 4) for i in range(33)],
          "collective_rank_us": [round(0.25 * i, 2) for i in range(25)]}
"""The cluster fields fitted and their grids: cv 0-0.08, microseconds 0-6."""


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


def with_set(doc: dict, key: str, value: float) -> dict:
    """`doc` with the cluster field `key` set to `value` on every row."""
    out = copy.deepcopy(doc)
    for row in out["rows"]:
        if row.get("cluster"):
            row["set"] = {**(row.get("set") or {}), key: value}
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


PER_CALL_FAMILIES = {"mpt-h100-7b-s2048": (8, 128, 512), "mpt-h100-3b-s2048": (128, 256, 512),
                     "mpt-h100-1b-s2048": (128, 256, 512)}
"""llm-foundry's H100 runs of one strategy at three scales (row id prefix: GPU counts)."""


def per_call_check(doc: dict) -> None:
    """The other reading, jitter per blocking collective: each of the step's k data-parallel
    calls waits sigma x e(N). sigma solved from the gap between the two larger scales (the
    seconds the model misses at the largest), then the loss it implies at the smallest scale,
    beside the measured one."""
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.cost.straggler import expected_max_normal as e
    from amsp_planner.validation import priced_job

    rows = {r["id"]: r for r in doc["rows"]}
    for fam, ns in PER_CALL_FAMILIES.items():
        pts = []
        for n in ns:
            r = rows[f"{fam}-{n}"]
            job, s, _, _ = priced_job(r, doc.get("models", {}))
            ev = evaluate(job, s)
            calls = sum(x.calls_per_step for x in ev.schedule if x.group != "TP")
            pts.append((n, r["value"], ev.time.step_s, calls))
        (n0, p0, s0, _), (n1, p1, s1, k1), (n2, p2, s2, k2) = pts
        missing = s2 * (p1 / p2) / (s2 / s1) - s2  # seconds the model lacks at n2 against n1
        sigma = missing / (k2 * (e(n2) - e(n1)))
        implied = k1 * sigma * (e(n1) - e(n0)) / s1
        missed = (p0 / p1) / (s1 / s0) - 1  # the fraction the model lacks at n1 against n0
        print(f"  {fam}: {missing * 1e3:.0f} ms missed at {n2} GPUs against {n1}: sigma "
              f"{sigma * 1e3:.2f} ms per call; from {n0} to {n1} GPUs that adds "
              f"{100 * implied:.1f} % of the step, the model misses {100 * missed:.1f} % there")


def fit(doc: dict, fams: dict, key: str, grid: list[float]) -> None:
    """Print the shape SSE over `grid` for cluster field `key`, its best value over all
    families and per source, and the buckets at 0, the best and each source's best."""
    runs = {}
    for v in grid:
        res = predict_rows(with_set(doc, key, v))
        runs[v] = (res, {r.id: r.error for r in res if r.error is not None})
    by_source: dict[str, dict] = defaultdict(dict)
    print(f"{key}: shape SSE (all families)")
    for v, (_, err) in runs.items():
        print(f"  {v:.4f}  {shape_sse(fams, err):.5f}")
        for src in {k[0] for k in fams}:
            by_source[src][v] = shape_sse({k: f for k, f in fams.items() if k[0] == src}, err)
    best = min(grid, key=lambda v: shape_sse(fams, runs[v][1]))
    print(f"fitted {key} (all families): {best:.4f}")
    for src, sse in sorted(by_source.items()):
        print(f"  best {key} for {src}: {min(sse, key=sse.get):.4f} "
              f"(SSE {sse[0.0]:.5f} at 0 -> {min(sse.values()):.5f})")
    print(f"buckets, {key} 0:      {buckets(runs[0.0][0])}")
    shown = {0.0}
    for v in [best] + [min(sse, key=sse.get) for _, sse in sorted(by_source.items())]:
        if v not in shown:
            shown.add(v)
            print(f"buckets, {key} {v:.4f}: {buckets(runs[v][0])}")


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
    for key, grid in FIELDS.items():
        fit(doc, fams, key, grid)
    print("jitter per blocking collective instead (sigma seconds per call):")
    per_call_check(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
