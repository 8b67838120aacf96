"""GPU validation: published runs predicted by the cost model, per engine and per scale.

    python bench/gpu_validation.py [--check] [--doc PATH]

Predicts every row of amsp_planner/presets/validation.yaml (published measurements, each with
its source) and writes docs/validation.md and amsp_planner/presets/error_bands.json. --check
prints only. A missed target is printed ("targets MISSED: ...") and never fails the run: the
exit code is 0 unless a row cannot be read or predicted.

Targets, in every scale bucket (<= 64, 65-255, >= 256 GPUs): median |throughput error|
<= 10 %, 90th percentile <= 20 %, worst <= 35 %, the published order of throughput kept
within a source; peak memory: median <= 10 %, worst <= 20 %, every published run that trained
predicted to fit.

error_bands.json keys (a band: {rows, collected, median_abs_error, p90_abs_error,
max_abs_error}, errors as fractions; `rows` are the rows in scope, `collected` all rows of
that kind):

- ``step_time``, ``memory``: the overall bands over every row in scope (the planner reads
  ``step_time.p90_abs_error`` and ``memory.max_abs_error``).
- ``step_time_by_engine``, ``step_time_by_scale``: {engine or bucket: band};
  ``step_time_by_engine_scale``: {engine: {bucket: band}}; ``memory_by_engine``.
- ``relative``: the band of the predicted ratio between two strategies run on the same job
  (pairs of rows sharing a ``job`` tag), with ``order_kept`` (share of pairs whose faster
  strategy is predicted faster); ``relative_by_engine`` (key 'a / b' for a pair of two
  engines), ``relative_by_scale``.
- ``targets``: the targets above; ``targets_met``: {check: bool}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from amsp_planner.validation import (  # noqa: E402
    BAND_MIN_PAIRS,
    BANDS_FILE,
    BUCKETS,
    FP8_SPEEDUP_POINTS,
    MOE_ROWS_FILE,
    fp8_pairs,
    load_rows,
    orderings,
    predict_rows,
    relative_pairs,
    relative_summary,
    scale_bucket,
    summary,
)

TARGETS = {"median": 0.10, "p90": 0.20, "max": 0.35, "memory_median": 0.10, "memory_max": 0.20}
UNITS = {"tps_per_gpu": "tokens/s/GPU", "tflops_model": "model TFLOP/s/GPU",
         "tflops_megatron": "TFLOP/s/GPU (Megatron formula)",
         "tflops_causal": "model TFLOP/s/GPU (causal attention)", "memory": "GiB per GPU"}
PROFILE_WHY = {
    "eager": "eager kernels (the default: the source names no fused or compiled kernels)",
    "fused": "fused / compiled kernels (the source runs torch.compile, fused norms or Liger)",
    "compiled": "torch.compile of the blocks, the loss eager (the source's torchtitan does not "
                "compile its loss)",
}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def band_cells(b: dict) -> str:
    """'in scope / collected (coverage) | median | p90 | worst' of one band."""
    cov = f"{b['rows']} / {b['collected']} ({b['rows'] / b['collected']:.0%})" if b["collected"] \
        else "0 / 0"
    if not b["rows"]:
        return f"{cov} | - | - | -"
    return (f"{cov} | {b['median_abs_error'] * 100:.1f} % | {b['p90_abs_error'] * 100:.1f} % | "
            f"{b['max_abs_error'] * 100:.1f} %")


def meets(b: dict) -> bool:
    return (not b["rows"] or (b["median_abs_error"] <= TARGETS["median"]
                              and b["p90_abs_error"] <= TARGETS["p90"]
                              and b["max_abs_error"] <= TARGETS["max"]))


def memory_meets(b: dict) -> bool:
    return (not b["rows"] or (b["median_abs_error"] <= TARGETS["memory_median"]
                              and b["max_abs_error"] <= TARGETS["memory_max"]))


def grouped(results, key) -> dict:
    out: dict = {}
    for r in results:
        out.setdefault(key(r), []).append(r)
    return dict(sorted(out.items()))


def pair_engine(p) -> str:
    """The engine of a pair ('a / b' for two engines, alphabetical)."""
    return " / ".join(sorted({p.faster.engine, p.slower.engine}))


def bands(results, pairs) -> dict:
    """Every band error_bands.json holds (module docstring)."""
    engines = grouped(results, lambda r: r.engine)
    scales = grouped(results, lambda r: r.bucket)
    return {
        "step_time": summary(results),
        "memory": summary(results, memory=True),
        "step_time_by_engine": {e: summary(rs) for e, rs in engines.items()},
        "step_time_by_scale": {b: summary(scales.get(b, [])) for b in BUCKETS},
        "step_time_by_engine_scale": {
            e: {b: summary([r for r in rs if r.bucket == b]) for b in BUCKETS}
            for e, rs in engines.items()},
        "memory_by_engine": {e: summary(rs, memory=True) for e, rs in engines.items()
                             if any(r.published_memory_gib is not None for r in rs)},
        "relative": relative_summary(pairs),
        "relative_by_engine": {e: relative_summary(ps) for e, ps in
                               grouped(pairs, pair_engine).items()},
        "relative_by_scale": {b: relative_summary(ps) for b in BUCKETS if (ps := [
            p for p in pairs if scale_bucket(p.faster.gpus) == b])},
    }


def unfit(results) -> list:
    """Rows in scope (runs that trained) predicted not to fit."""
    return [r for r in results if r.scope == "in" and r.fits is False]


def targets_met(b: dict, orders: dict, results) -> dict:
    return {
        "step_time_every_bucket": all(meets(x) for x in b["step_time_by_scale"].values()),
        "step_time_every_engine_bucket": all(meets(x) for e in b["step_time_by_engine_scale"].values()
                                             for x in e.values()),
        "orderings_kept": all(orders.values()),
        "memory": memory_meets(b["memory"]),
        "memory_every_engine": all(memory_meets(x) for x in b["memory_by_engine"].values()),
        "trained_runs_fit": not unfit(results),
    }


# ----- the document ---------------------------------------------------------------------------
def band_table(title: str, items: dict, check=meets) -> list[str]:
    lines = [f"| {title} | rows in scope / collected | median | 90th pct | worst | targets |",
             "|---|---|---:|---:|---:|---|"]
    for k, b in items.items():
        verdict_ = "-" if not b["rows"] else "met" if check(b) else "MISSED"
        lines.append(f"| {k} | {band_cells(b)} | {verdict_} |")
    return lines


def engine_scale_table(b: dict) -> list[str]:
    lines = ["| engine | " + " | ".join(f"{k} GPUs: in scope / collected, median, worst"
                                          for k in BUCKETS) + " |", "|---|---|---|---|"]
    for e, per in b["step_time_by_engine_scale"].items():
        cells = []
        for k in BUCKETS:
            x = per[k]
            cells.append("-" if not x["collected"] else f"{x['rows']} / {x['collected']}" + (
                f", {x['median_abs_error'] * 100:.1f} %, {x['max_abs_error'] * 100:.1f} %"
                + ("" if meets(x) else " MISSED") if x["rows"] else ""))
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return lines


def mem_cell(r) -> str:
    """The predicted memory of a row, and whether it fits."""
    return "-" if r.memory_gib is None else \
        f"{r.memory_gib:.1f}{'' if r.fits else ' (does not fit)'}"


def row_table(results) -> list[str]:
    lines = ["| row | engine (priced as) | GPUs | strategy | metric | published | predicted | "
             "error | memory GiB |", "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in results:
        if r.scope != "in" or r.metric == "memory":
            continue
        lines.append(
            f"| {r.id} | {r.engine} ({r.priced_as}) | {r.gpus} | `{r.strategy}` | {UNITS[r.metric]} | "
            f"{r.bound if r.bound == '>' else ''}{r.published:,.1f} | {r.predicted:,.1f} | "
            f"{pct(r.error)} | {mem_cell(r)} |")
    return lines


def memory_table(results) -> list[str]:
    lines = ["| row | engine | GPUs | strategy | activation profile (why) | figure | published GiB | "
             "predicted GiB | error | scope |", "|---|---|---:|---|---|---|---:|---:|---:|---|"]
    for r in results:
        if r.published_memory_gib is None:
            continue
        why = PROFILE_WHY.get(r.activation_profile, r.activation_profile) if r.memory_gib else "-"
        lines.append(f"| {r.id} | {r.engine} | {r.gpus} | `{r.strategy}` | {why} | "
                     f"{r.memory_kind if r.memory_gib else '-'} | {r.published_memory_gib:.1f} | {mem_cell(r)} | {pct(r.memory_error)} | "
                     f"{'in' if r.scope == 'in' else 'out: ' + r.scope} |")
    return lines


def pair_table(pairs) -> list[str]:
    lines = ["| job | faster (measured) | slower | GPUs | measured ratio | predicted ratio | "
             "error of the ratio | order kept |", "|---|---|---|---:|---:|---:|---:|---|"]
    for p in pairs:
        lines.append(f"| {p.job} | {p.faster.id} `{p.faster.strategy}` | {p.slower.id} "
                     f"`{p.slower.strategy}` | {p.faster.gpus} | {p.measured:.3f} | "
                     f"{p.predicted:.3f} | {pct(p.error)} | {'yes' if p.order_kept else 'NO'} |")
    return lines


def fp8_lines(results) -> list[str]:
    """FP8 rows beside the bf16 rows of the same sources: each published speed-up against the
    predicted one (target: within FP8_SPEEDUP_POINTS), and the FP8 rows' throughput error."""
    pairs = fp8_pairs(results)
    fp8 = [r for r in results if r.precision == "fp8" and r.scope == "in"
           and r.metric != "memory"]
    if not fp8:
        return []
    collected = sum(r.precision == "fp8" and r.metric != "memory" for r in results)
    errs = sorted(abs(r.error) for r in fp8)
    ok = sum(abs(p.points) <= FP8_SPEEDUP_POINTS for p in pairs)
    out = ["## FP8 against bf16", "",
           "Published FP8 rows (`training: {precision: fp8}`, docs/fp8.md) beside the bf16 row of "
           "the same source and job (`bf16_row`): the published speed-up (FP8 throughput / bf16) "
           "against the predicted one; target: within "
           f"{FP8_SPEEDUP_POINTS:g} points. FP8 throughput rows in scope: {len(fp8)} of {collected} "
           "collected, median |throughput "
           f"error| {100 * statistics.median(errs):.1f} %, "
           f"worst {100 * errs[-1]:.1f} %; speed-ups within {FP8_SPEEDUP_POINTS:g} points: "
           f"{ok} of {len(pairs)}.", "",
           "| source | bf16 row | FP8 row | recipe | GPUs | published speed-up | predicted | "
           "difference | bf16 error | FP8 error |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for p in pairs:
        out.append(f"| {p.fp8.source} | {p.bf16.id} | {p.fp8.id} | {p.fp8.recipe} | "
                   f"{p.fp8.gpus} | {p.published:.3f} | {p.predicted:.3f} | {p.points:+.1f} pts "
                   f"| {pct(p.bf16.error)} | {pct(p.fp8.error)} |")
    out += ["", "Per source: its pairs, how many are within "
            f"{FP8_SPEEDUP_POINTS:g} points, and the median of its differences (a source whose "
            "pairs scatter both ways has a median near zero and misses both ways).", "",
            "| source | pairs | within | median difference | largest |", "|---|---:|---:|---:|---:|"]
    medians = []
    for src in dict.fromkeys(p.fp8.source for p in pairs):
        pts = [p.points for p in pairs if p.fp8.source == src]
        medians.append(statistics.median(pts))
        out.append(f"| {src} | {len(pts)} | {sum(abs(x) <= FP8_SPEEDUP_POINTS for x in pts)} | "
                   f"{medians[-1]:+.1f} pts | {max(pts, key=abs):+.1f} pts |")
    within = sum(abs(m) <= FP8_SPEEDUP_POINTS for m in medians)
    out += ["", f"Each source's speed-up (the median of its pairs) within {FP8_SPEEDUP_POINTS:g} "
            f"points: {within} of {len(medians)} sources; pair by pair: {ok} of {len(pairs)}."]
    alone = [r for r in fp8 if not r.bf16_row]
    if alone:
        out += ["", "FP8 rows without a published bf16 row of the same job: "
                + ", ".join(f"{r.id} ({pct(r.error)})" for r in alone) + "."]
    return out + [""]


def exclusions(results) -> list[str]:
    lines = ["| row | engine | GPUs | published | predicted | error | why outside |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        if r.scope == "in":
            continue
        pred = "-" if r.predicted is None else f"{r.predicted:,.1f}"
        lines.append(f"| {r.id} | {r.engine} | {r.gpus} | {r.published:,.1f} {UNITS[r.metric]} | "
                     f"{pred} | {pct(r.error)} | {r.scope} |")
    return lines


def verdict(met: dict) -> str:
    missed = [k for k, ok in met.items() if not ok]
    return "targets met" if not missed else "targets MISSED: " + ", ".join(missed)


def write_doc(results, b, orders, pairs, met, doc) -> str:
    st, mem = b["step_time"], b["memory"]
    bad = unfit(results)
    out = ["# Validation against published GPU runs", "",
           "Generated by `python bench/gpu_validation.py` from `amsp_planner/presets/validation.yaml`",
           "(every row with its source); do not edit by hand. The bands are written to",
           "`amsp_planner/presets/error_bands.json`, which the planner reads.", "",
           f"Targets in every scale bucket: median |throughput error| <= {TARGETS['median']:.0%}, "
           f"90th percentile <= {TARGETS['p90']:.0%}, worst <= {TARGETS['max']:.0%}, published "
           f"orderings kept; peak memory median <= {TARGETS['memory_median']:.0%}, worst <= "
           f"{TARGETS['memory_max']:.0%}, every run that trained predicted to fit.", "",
           f"**{verdict(met)}.** ({len(results)} rows from {len(doc['sources'])} sources.)", "",
           "## Coverage", "",
           "| kind | rows in scope / collected | median | 90th pct | worst |", "|---|---|---:|---:|---:|",
           f"| throughput | {band_cells(st)} |", f"| peak memory | {band_cells(mem)} |",
           f"| strategy pairs (relative band) | {b['relative']['rows']} pairs | "
           + (f"{b['relative']['median_abs_error'] * 100:.1f} % | {b['relative']['p90_abs_error'] * 100:.1f} % | "
              f"{b['relative']['max_abs_error'] * 100:.1f} % |" if b["relative"]["rows"] else "- | - | - |"),
           "", "Every row outside the scope is listed with its reason under "
           "[Rows outside the model's scope](#rows-outside-the-models-scope).", "",
           "## Throughput per scale bucket", ""]
    out += band_table("GPUs", b["step_time_by_scale"])
    out += ["", "## Throughput per engine", "", "The engine the source ran; `priced as` in the row "
            "table names the execution profile that priced it (`engine@version` for a row "
            "that names a past release with a profile of its own, amsp_planner/"
            "engine_versions.py).", ""]
    out += band_table("engine", b["step_time_by_engine"])
    out += ["", "Per engine and scale bucket:", ""] + engine_scale_table(b)
    out += ["", "Published orderings (throughput, within one source): "
            + ", ".join(f"{g} {'kept' if ok else 'NOT kept'}" for g, ok in sorted(orders.items())), ""]
    out += ["## Relative band: the error of the ratio between two strategies", "",
            "From sources that ran two or more strategies on the same job (same model, GPUs, "
            "cluster and batch; a strategy is a sharding, micro-batch and checkpointing on an "
            "engine; rows sharing a `job` tag, checked field by field): the "
            "predicted throughput ratio of the measured-faster strategy over the slower one "
            "against the measured ratio. This band, not the absolute one, says whether two "
            "candidates of one job are a tie. The planner takes the 90th percentile of the "
            "job's engine's pairs, else of its scale bucket's, else of all, a subset only from "
            f"{BAND_MIN_PAIRS} pairs (`BAND_MIN_PAIRS` in amsp_planner/validation.py): the "
            "rows below with fewer are shown, not used.", ""]
    if pairs:
        out += ["| pairs | count | median | 90th pct | worst | order |", "|---|---|---:|---:|---:|---|"]
        out += [f"| all | {b['relative']['rows']} pairs | {b['relative']['median_abs_error'] * 100:.1f} % | "
                f"{b['relative']['p90_abs_error'] * 100:.1f} % | {b['relative']['max_abs_error'] * 100:.1f} % | "
                f"order kept in {b['relative']['order_kept']:.0%} |"]
        for title, key in (("engine", "relative_by_engine"), ("GPUs", "relative_by_scale")):
            for k, x in b[key].items():
                out.append(f"| {title} {k} | {x['rows']} pairs | {x['median_abs_error'] * 100:.1f} % | "
                           f"{x['p90_abs_error'] * 100:.1f} % | {x['max_abs_error'] * 100:.1f} % | "
                           f"order kept in {x['order_kept']:.0%} |")
        out += ["", "The pairs:", ""] + pair_table(pairs)
    out += [""] + fp8_lines(results)
    out += ["", "## Peak memory per GPU", "",
            "Rows with a published peak memory, with the activation profile the prediction used "
            "and the figure the source published (reserved: torch.cuda.max_memory_reserved; "
            "allocated: max_memory_allocated or peak active; device: nvidia-smi), predicted as "
            "that figure (docs/memory.md). Per engine (rows in scope):", ""]
    out += band_table("engine", b["memory_by_engine"], check=memory_meets)
    out += ["", f"Overall: {band_cells(mem).replace(' | ', ', ')} (median, 90th percentile, worst).", ""]
    out += memory_table(results)
    out += ["", ("Every run in scope that trained is predicted to fit." if not bad else
                 f"{len(bad)} runs in scope that trained are predicted NOT to fit: "
                 + ", ".join(r.id for r in bad) + ".")]
    out += ["", "## Rows in scope", ""] + row_table(results)
    out += ["", "## Rows outside the model's scope", "",
            "Predicted where the job is expressible, for information; not counted in the "
            "statistics above.", ""] + exclusions(results)
    out += ["", "## Sources", ""]
    out += [f"- **{k}**: {v}" for k, v in doc["sources"].items()]
    return "\n".join(out) + "\n"


MOE_TARGETS = {"median": 0.15}
"""Issue #26: median |throughput error| <= 15 % on the MoE runs, every run that trained
predicted to fit."""


def moe_section(results, doc) -> tuple[list[str], dict]:
    """The mixture-of-experts runs (presets/validation_moe.yaml): their own statistics, rows in
    scope, rows outside and sources."""
    st, mem, bad = summary(results), summary(results, memory=True), unfit(results)
    met = {"median": st["rows"] > 0 and st["median_abs_error"] <= MOE_TARGETS["median"],
           "fit": not bad}
    out = ["## Mixture-of-experts runs", "",
           "From `amsp_planner/presets/validation_moe.yaml` (its own statistics, not in the "
           f"bands above). Targets: median |throughput error| <= {MOE_TARGETS['median']:.0%}, "
           "every run that trained predicted to fit: "
           + ("met" if all(met.values()) else "NOT met") + f". {len(results)} rows from "
           f"{len(doc['sources'])} sources.", "",
           "| kind | rows in scope / collected | median | 90th pct | worst |",
           "|---|---|---:|---:|---:|", f"| throughput | {band_cells(st)} |",
           f"| peak memory | {band_cells(mem)} |", "",
           ("Every MoE run in scope that trained is predicted to fit." if not bad else
            f"{len(bad)} MoE runs in scope that trained are predicted NOT to fit: "
            + ", ".join(r.id for r in bad) + "."), ""]
    out += row_table(results) + ["", "Outside the model's scope:", ""] + exclusions(results)
    out += ["", "Sources:", ""] + [f"- **{k}**: {v}" for k, v in doc["sources"].items()]
    return out, {"step_time": st, "memory": mem, "targets": MOE_TARGETS, "targets_met": met,
                 "unfit": [r.id for r in bad]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print only; write nothing")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "validation.md"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    doc = load_rows()
    results = predict_rows(doc)
    pairs = relative_pairs(doc, results)
    moe_doc = load_rows(MOE_ROWS_FILE)
    moe_lines, moe_bands = moe_section(predict_rows(moe_doc), moe_doc)
    seconds = time.perf_counter() - t0
    b, orders = bands(results, pairs), orderings(results)
    met = targets_met(b, orders, results)
    for title, items, check in (("GPUs", b["step_time_by_scale"], meets),
                                ("engine", b["step_time_by_engine"], meets),
                                ("memory", b["memory_by_engine"], memory_meets)):
        print("\n".join(band_table(title, items, check)), end="\n\n")
    print("\n".join(engine_scale_table(b)), end="\n\n")
    print("relative band:", json.dumps(b["relative"]), "\nby engine:",
          json.dumps(b["relative_by_engine"]), "\nby scale:", json.dumps(b["relative_by_scale"]))
    print(f"overall throughput {band_cells(b['step_time'])}; memory {band_cells(b['memory'])}; "
          f"{len(unfit(results))} trained runs predicted not to fit; {seconds:.1f} s")
    print(f"MoE runs: throughput {band_cells(moe_bands['step_time'])}; memory "
          f"{band_cells(moe_bands['memory'])}; not fitting: {moe_bands['unfit'] or 'none'}")
    if not args.check:
        text = write_doc(results, b, orders, pairs, met, doc)
        Path(args.doc).write_text(text + "\n" + "\n".join(moe_lines) + "\n")
        BANDS_FILE.write_text(json.dumps({**b, "targets": TARGETS, "targets_met": met,
                                          "moe": moe_bands,
                                          "source": "bench/gpu_validation.py"}, indent=2) + "\n")
    print("\n".join(fp8_lines(results)))
    print(verdict(met))
    return 0


if __name__ == "__main__":
    sys.exit(main())
