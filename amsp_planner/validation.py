"""Published GPU runs as jobs, their predictions, and the error bands the planner reads.

    python bench/gpu_validation.py        # writes docs/validation.md and presets/error_bands.json

The rows (``presets/validation.yaml``) are published measurements of data-parallel-sharded
training, each with its source and the hardware it ran on. ``predict_rows`` turns every row
inside the model's scope into a Job and a Strategy and predicts the row's metric. The measured
error is data: ``error_bands()`` reads ``presets/error_bands.json``, which the benchmark writes
from the same rows, so every band the planner states comes from one place.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PRESETS = Path(__file__).resolve().parent / "presets"
ROWS_FILE = PRESETS / "validation.yaml"
BANDS_FILE = PRESETS / "error_bands.json"


@dataclass
class RowResult:
    id: str
    source: str
    metric: str
    published: float
    predicted: float | None
    bound: str
    scope: str
    order: str | None
    strategy: str
    step_s: float | None = None
    fits: bool | None = None
    memory_gib: float | None = None
    published_memory_gib: float | None = None

    @property
    def memory_error(self) -> float | None:
        if self.published_memory_gib is None or self.memory_gib is None:
            return None
        return self.memory_gib / self.published_memory_gib - 1

    @property
    def error(self) -> float | None:
        """Signed relative error of the prediction (predicted / published - 1)."""
        if self.predicted is None:
            return None
        return self.predicted / self.published - 1


def load_rows() -> dict:
    import yaml

    return yaml.safe_load(ROWS_FILE.read_text())


def _metric(ev, job, metric: str) -> float:
    m, t, n = job.model, job.training, job.num_gpus
    tps = ev.tokens_per_s / n
    if metric == "memory":
        return ev.memory.total / 2**30
    if metric == "tps_per_gpu":
        return tps
    if metric == "tflops_model":
        return tps * m.flops_per_token(t.seq_len) / 1e12
    if metric == "tflops_causal":  # attention over its causal half (6 L h s)
        return tps * (6.0 * m.num_flop_params + 6.0 * m.num_layers * m.hidden_size * t.seq_len) / 1e12
    if metric == "tflops_megatron":  # 96 B s l h^2 (1 + s/6h + V/16lh), recomputation counted
        b, s, nl, h, v = t.batch_seqs, t.seq_len, m.num_layers, m.hidden_size, m.vocab_size
        flops = 96 * b * s * nl * h * h * (1 + s / (6 * h) + v / (16 * nl * h))
        return flops / ev.step_s / n / 1e12
    raise ValueError(f"unknown metric {metric}")


def row_job(row: dict, models: dict):
    """The Job and Strategy of one row."""
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_cluster, load_model
    from amsp_planner.specs.model import ModelSpec
    from amsp_planner.strategy import parse_strategy_or_baseline

    name = row["model"]
    model = ModelSpec(**models[name]) if name in models else load_model(name)
    cluster = load_cluster(row["cluster"], row.get("set"))
    training = TrainingSpec(seq_len=row["seq_len"], global_batch_seqs=row["global_batch_seqs"],
                            **row.get("training", {}))
    job = Job.create(model, cluster, training, row["gpus"])
    return job, parse_strategy_or_baseline(row["strategy"], job.num_gpus, job.gpus_per_node)


def predict_rows(doc: dict | None = None) -> list[RowResult]:
    from amsp_planner.cost.evaluate import evaluate

    doc = doc or load_rows()
    out = []
    for row in doc["rows"]:
        r = RowResult(row["id"], row["source"], row["metric"], float(row["value"]), None,
                      row.get("bound", "="), row["scope"], row.get("order"), row["strategy"])
        job, s = row_job(row, doc.get("models", {}))
        ev = evaluate(job, s)
        r.predicted, r.step_s = _metric(ev, job, row["metric"]), ev.step_s
        r.fits, r.memory_gib = ev.fits, ev.memory.total / 2**30
        if row["metric"] == "memory" or "memory_gib" in row:
            r.published_memory_gib = float(row.get("memory_gib", row["value"]))
        out.append(r)
    return out


def orderings(results: list[RowResult]) -> dict[str, bool]:
    """Per order group: does the prediction keep the published order of throughput?"""
    results = [r for r in results if r.metric != "memory"]
    groups: dict[str, list[RowResult]] = {}
    for r in results:
        if r.order and r.scope == "in":
            groups.setdefault(r.order, []).append(r)
    return {g: [x.id for x in sorted(rs, key=lambda x: -x.published)]
            == [x.id for x in sorted(rs, key=lambda x: -x.predicted)] for g, rs in groups.items()}


def summary(results: list[RowResult], memory: bool = False) -> dict:
    """Median, 90th percentile and worst |error| of the rows in scope (throughput, or with
    `memory` the published peak memory)."""
    if memory:
        errs = sorted(abs(r.memory_error) for r in results
                      if r.scope == "in" and r.memory_error is not None)
    else:
        errs = sorted(abs(r.error) for r in results if r.scope == "in" and r.metric != "memory")
    if not errs:
        return {"rows": 0}
    p90 = errs[min(len(errs) - 1, int(round(0.9 * (len(errs) - 1))))]
    return {"rows": len(errs), "median_abs_error": statistics.median(errs),
            "p90_abs_error": p90, "max_abs_error": errs[-1]}


@lru_cache(maxsize=1)
def error_bands() -> dict:
    """The measured bands (``presets/error_bands.json``): {'step_time': {...}, ...}."""
    return json.loads(BANDS_FILE.read_text())


def step_time_band() -> float:
    """The relative step-time band the planner states: the validated 90th-percentile error."""
    return float(error_bands()["step_time"]["p90_abs_error"])


def memory_band() -> float:
    """The relative memory band: the validated worst |error| of the published peak memory."""
    return float(error_bands()["memory"]["max_abs_error"])
