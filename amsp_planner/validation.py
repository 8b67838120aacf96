"""Published GPU runs as jobs, their predictions, and the error bands the planner reads.

    python bench/gpu_validation.py        # writes docs/validation.md and presets/error_bands.json

The rows (``presets/validation.yaml``; mixture-of-experts runs in ``validation_moe.yaml``, read
with ``load_rows(MOE_ROWS_FILE)`` and summarised apart) are published measurements of LLM
training, each with its source, the engine that ran it and the hardware. ``predict_rows``
turns every row that is a job of this model into a Job and a Strategy, priced with the
execution profile of the row's engine (``pricing_engine``: the release the row ran where it names
one with a profile of its own, engine_versions.py; an engine without a profile of its
own is priced as the one that executes the same way, and a strategy the profile does not
express falls back to the bundled runtime's profile, said in ``RowResult.priced_as``), and
predicts the row's metric. Rows out of scope state why (context parallelism, asynchronous TP, FP8
matmuls, offload, a setup the source does not publish ...); they are kept and listed, never
dropped.

Statistics: ``summary`` (median, 90th percentile and worst |error| with the rows in scope and
collected), by engine and by scale bucket (``scale_bucket``: <= 64, 65-255, >= 256 GPUs), and
the relative band (``relative_pairs``): rows sharing a ``job`` tag ran the same job (every
field of ``JOB_FIELDS`` equal, ``check_jobs``) with different strategies (a sharding, micro-batch
and checkpointing on an engine); the error of the predicted throughput ratio between two of
them against the measured ratio.

The measured error is data: ``error_bands()`` reads ``presets/error_bands.json``, which the
benchmark writes from the same rows, so every band the planner states comes from one place.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from functools import lru_cache

from amsp_planner.validation_rows import (  # noqa: F401 (re-exported)
    MOE_ROWS_FILE,
    PRESETS,
    REQUIRED,
    ROWS_FILE,
    check_rows,
    load_rows,
)

BANDS_FILE = PRESETS / "error_bands.json"


@dataclass
class RowResult:
    id: str
    source: str
    engine: str
    gpus: int
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
    priced_as: str = ""
    """The engine profile the prediction used, with the reason where it is not the row's own."""
    activation_profile: str = "eager"
    job: str | None = None
    memory_kind: str = "reserved"
    """The figure the published peak is: 'reserved', 'allocated' or 'device' (docs/memory.md)."""
    precision: str = "bf16"
    recipe: str = ""
    bf16_row: str | None = None
    """An FP8 row's bf16 counterpart: the same source's run of the same job in bf16."""

    @property
    def bucket(self) -> str:
        return scale_bucket(self.gpus)

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


BUCKETS = ("<= 64", "65-255", ">= 256")


def scale_bucket(gpus: int) -> str:
    """The scale bucket of a job: <= 64, 65-255 or >= 256 GPUs."""
    return BUCKETS[0] if gpus <= 64 else BUCKETS[1] if gpus < 256 else BUCKETS[2]


# Engines the published rows ran that have no execution profile of their own: priced with the
# profile of the engine that executes the same way (FairScale's FSDP as FSDP2; FSDP1 and
# Composer's FSDP have their own, engines.PRICED_ONLY;
# Megatron-DeepSpeed, Megatron's tensor and pipeline parallelism with DeepSpeed's ZeRO-1, as
# Megatron-Core: its distributed optimizer moves a ZeRO-1 step's bytes, reduce-scatter +
# all-gather = the all-reduce of DeepSpeed's BF16_Optimizer).
PRICED_AS = {"fairscale": "fsdp2", "megatron-deepspeed": "megatron", "megatron-bridge": "megatron"}


def pricing_engine(engine: str, version: str | None = None) -> tuple[str, str]:
    """The engine profile a row is priced with, and why when it is not the row's own: the
    profile of the release the row ran (`version`, its ``engine_version``) where
    engine_versions.py has one, else the engine's current one."""
    from amsp_planner.engines import DEFAULT_ENGINE, ENGINES, PRICED_ONLY, VERSIONED

    if version and f"{engine}@{version}" in VERSIONED:
        return f"{engine}@{version}", ""
    if engine in ENGINES or engine in PRICED_ONLY:
        return engine, (f"{engine} {version} has no profile: priced as the current release"
                        if version else "")
    alt = PRICED_AS.get(engine, DEFAULT_ENGINE)
    alt = alt if alt in ENGINES else DEFAULT_ENGINE
    return alt, f"{engine} has no profile: priced as {alt}"


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


VALIDATION_CLUSTERS = PRESETS / "validation_clusters"
"""Clusters only published rows ran on (``grand-teton-h100``), kept out of the presets a user
picks from (a second H100 type there would make ``--gpu-type h100`` ambiguous)."""


def cluster_ref(name: str) -> str:
    """A row's cluster: a spec of ``validation_clusters/`` by name, else a preset."""
    path = VALIDATION_CLUSTERS / f"{name}.yaml"
    return str(path) if path.is_file() else name


def row_job(row: dict, models: dict, engine: str | None = None):
    """The Job and Strategy of one row, priced with `engine`'s profile (default: the row's)."""
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_cluster, load_model
    from amsp_planner.specs.model import ModelSpec
    from amsp_planner.strategy import parse_strategy_or_baseline

    name = row["model"]
    model = ModelSpec(**models[name]) if name in models else load_model(name)
    cluster = load_cluster(cluster_ref(row["cluster"]), row.get("set"))
    moe = {"expert_imbalance": row["expert_imbalance"]} if "expert_imbalance" in row else {}
    training = TrainingSpec(seq_len=row["seq_len"], global_batch_seqs=row["global_batch_seqs"],
                            **row.get("training", {}), **moe)
    engine = engine or pricing_engine(row["engine"], row.get("engine_version"))[0]
    given = parse_strategy_or_baseline(row["strategy"], row["gpus"], cluster.gpus_per_node)
    job = Job.create(model, cluster, training, row["gpus"], engine=engine, pp=given.pp,
                     cp=given.cp)
    if row.get("execution"):  # the run's own configuration (validation_rows._check_execution)
        job = replace(job, settings=tuple(sorted(row["execution"].items())))
    s = parse_strategy_or_baseline(row["strategy"], job.num_gpus, job.gpus_per_node)
    job.check(s)
    return job, s


def priced_job(row: dict, models: dict):
    """The row's Job and Strategy and the profile that priced them: the row's engine, or, where
    that profile does not express the row's strategy (a limit of the profile, not of the cost
    model), the bundled runtime's, said in the result."""
    from amsp_planner.engines import DEFAULT_ENGINE
    from amsp_planner.errors import AmspUserError

    engine, why = pricing_engine(row["engine"], row.get("engine_version"))
    try:
        return (*row_job(row, models, engine), engine, why)
    except AmspUserError:
        if engine == DEFAULT_ENGINE:
            raise
        job, s = row_job(row, models, DEFAULT_ENGINE)
        return job, s, DEFAULT_ENGINE, f"{engine}'s profile does not run {row['strategy']}"


def predict_rows(doc: dict | None = None) -> list[RowResult]:
    from amsp_planner.cost.evaluate import evaluate

    doc = doc or load_rows()
    out = []
    for row in doc["rows"]:
        r = RowResult(row["id"], row["source"], row["engine"], row["gpus"], row["metric"],
                      float(row["value"]), None, row.get("bound", "="), row["scope"],
                      row.get("order"), row.get("strategy", ""), job=row.get("job"),
                      precision=row.get("training", {}).get("precision", "bf16"),
                      bf16_row=row.get("bf16_row"))
        if "memory_gib" in row or row["metric"] == "memory":
            r.published_memory_gib = float(row.get("memory_gib", row["value"]))
        out.append(r)
        if not row.get("strategy") or not row.get("cluster"):
            continue  # out of scope and not expressible as a job of this model
        job, s, engine, why = priced_job(row, doc.get("models", {}))
        r.priced_as = engine + (f" ({why})" if why else "") + (
            " [the run's settings: " + ", ".join(f"{k} {v:,.0f}" for k, v in job.settings)
            + "]" if job.settings else "")
        r.activation_profile = job.training.activation_profile
        if r.precision == "fp8":
            from amsp_planner.cost.fp8 import default_recipe

            r.recipe = job.training.fp8_recipe or default_recipe(job.engine)
        ev = evaluate(job, s)
        r.predicted, r.step_s = _metric(ev, job, row["metric"]), ev.step_s
        # the published figure's kind (docs/memory.md): torch's max_memory_reserved unless
        # the row says 'allocated' or 'device' (nvidia-smi); fitting is decided on the device
        r.fits = ev.fits
        kind = "device" if r.published_memory_gib is None else row.get("memory_kind",
                                                                         "reserved")
        r.memory_gib, r.memory_kind = ev.memory.peak(kind) / 2**30, kind
    return out


@dataclass
class Fp8Pair:
    """An FP8 row and its bf16 row: the published and predicted FP8 speed-up (throughput
    ratio FP8 / bf16) and their difference in points."""
    fp8: RowResult
    bf16: RowResult

    @property
    def published(self) -> float:
        return self.fp8.published / self.bf16.published

    @property
    def predicted(self) -> float:
        return self.fp8.predicted / self.bf16.predicted

    @property
    def points(self) -> float:
        """Predicted minus published speed-up, in percentage points."""
        return 100 * (self.predicted - self.published)


FP8_SPEEDUP_POINTS = 5.0
"""Target: each source's published bf16-vs-FP8 speed-up within 5 points (issue 27)."""


def fp8_pairs(results: list[RowResult]) -> list[Fp8Pair]:
    """Every in-scope FP8 row with an in-scope `bf16_row`, in file order."""
    by_id = {r.id: r for r in results}
    return [Fp8Pair(r, by_id[r.bf16_row]) for r in results
            if r.bf16_row and r.scope == "in" and by_id[r.bf16_row].scope == "in"]


def orderings(results: list[RowResult]) -> dict[str, bool]:
    """Per order group: does the prediction keep the published order of throughput?"""
    groups: dict[str, list[RowResult]] = {}
    for r in results:
        if r.order and r.scope == "in" and r.metric != "memory":
            groups.setdefault(r.order, []).append(r)
    return {g: [x.id for x in sorted(rs, key=lambda x: -x.published)]
            == [x.id for x in sorted(rs, key=lambda x: -x.predicted)] for g, rs in groups.items()}


def _stats(errs: list[float]) -> dict:
    errs = sorted(errs)
    if not errs:
        return {"rows": 0}
    p90 = errs[min(len(errs) - 1, int(round(0.9 * (len(errs) - 1))))]
    return {"rows": len(errs), "median_abs_error": statistics.median(errs),
            "p90_abs_error": p90, "max_abs_error": errs[-1]}


def summary(results: list[RowResult], memory: bool = False) -> dict:
    """Median, 90th percentile and worst |error| of the rows in scope (throughput, or with
    `memory` the published peak memory), with `collected`: the rows of that kind collected,
    in scope or not."""
    if memory:
        rows = [r for r in results if r.published_memory_gib is not None]
        errs = [abs(r.memory_error) for r in rows if r.scope == "in" and r.memory_error is not None]
    else:
        rows = [r for r in results if r.metric != "memory"]
        errs = [abs(r.error) for r in rows if r.scope == "in"]
    return {**_stats(errs), "collected": len(rows)}


# What two rows of one `job` tag must share: the same job (model, hardware, GPUs, batch,
# training settings and the metric it is reported in); only the strategy differs: the sharding,
# micro-batch and checkpointing, and the engine that runs it.
JOB_FIELDS = ("source", "model", "cluster", "set", "gpus", "seq_len", "global_batch_seqs",
              "training", "metric")


@dataclass
class Pair:
    """Two strategies published on one job: measured and predicted ratio of throughput
    (`faster` measured faster over `slower`) and the error of the predicted ratio."""
    job: str
    faster: RowResult
    slower: RowResult

    @property
    def measured(self) -> float:
        return self.faster.published / self.slower.published

    @property
    def predicted(self) -> float:
        return self.faster.predicted / self.slower.predicted

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1

    @property
    def order_kept(self) -> bool:
        return self.predicted >= 1 or self.measured == 1


def check_jobs(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of each `job` tag; ValueError naming the field where two rows of one tag do
    not run the same job, or run the same strategy twice."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("job"):
            groups.setdefault(row["job"], []).append(row)
    for tag, rs in groups.items():
        for r in rs[1:]:
            for f in JOB_FIELDS:
                if r.get(f) != rs[0].get(f):
                    raise ValueError(f"validation.yaml: rows {rs[0]['id']} and {r['id']} share "
                                     f"job '{tag}' but differ in field '{f}': give them different "
                                     "job tags")
    return groups


def relative_pairs(doc: dict, results: list[RowResult]) -> list[Pair]:
    """Every pair of in-scope rows of one `job` tag with different strategies."""
    by_id = {r.id: r for r in results}
    pairs = []
    for tag, rows in check_jobs(doc["rows"]).items():
        rs = [by_id[r["id"]] for r in rows if by_id[r["id"]].scope == "in"]
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                if (a.strategy, a.engine) == (b.strategy, b.engine):
                    continue  # the same run twice: no ratio between strategies
                fast, slow = (a, b) if a.published >= b.published else (b, a)
                pairs.append(Pair(tag, fast, slow))
    return pairs


def relative_summary(pairs: list[Pair]) -> dict:
    """Median, 90th percentile and worst |error of the predicted ratio| over `pairs`, and the
    share of pairs whose faster strategy is predicted faster."""
    s = _stats([abs(p.error) for p in pairs])
    if pairs:
        s["order_kept"] = sum(p.order_kept for p in pairs) / len(pairs)
    return s


@lru_cache(maxsize=1)
def error_bands() -> dict:
    """The measured bands (``presets/error_bands.json``): {'step_time': {...}, ...}."""
    return json.loads(BANDS_FILE.read_text())


def step_time_band(job=None) -> float:
    """The relative step-time band the planner states: the validated 90th-percentile error;
    for a mixture-of-experts `job`, the larger of it and the MoE runs' own (``moe`` in
    presets/error_bands.json, from presets/validation_moe.yaml)."""
    b = error_bands()
    band = float(b["step_time"]["p90_abs_error"])
    moe = b.get("moe", {}).get("step_time", {})
    if job is not None and job.model.is_moe and moe.get("rows"):
        band = max(band, float(moe["p90_abs_error"]))
    return band


def memory_band() -> float:
    """The relative memory band: the validated worst |error| of the published peak memory."""
    return float(error_bands()["memory"]["max_abs_error"])


BAND_MIN_PAIRS = 20
"""Pairs a subset (an engine's, a scale bucket's) needs before its 90th percentile is the
band: below it the percentile is the largest of a few (8 pairs of one source gave 1.5 % at
65-255 GPUs, between 8.1 % and 8.6 % on either side), so the wider set's stands."""


def relative_band(engine: str | None = None, gpus: int | None = None) -> float | None:
    """The validated 90th-percentile error of the predicted throughput ratio between two
    strategies of one job (``relative`` in presets/error_bands.json): of `engine`'s pairs, else
    of the pairs at `gpus`' scale bucket, else of all pairs, a subset counting only with
    ``BAND_MIN_PAIRS`` pairs or more; None before it is measured."""
    b = error_bands()
    for key, k in (("relative_by_engine", engine),
                   ("relative_by_scale", scale_bucket(gpus) if gpus else None)):
        got = b.get(key, {}).get(k) if k else None
        if got and got.get("rows", 0) >= BAND_MIN_PAIRS:
            return float(got["p90_abs_error"])
    rel = b.get("relative")
    return float(rel["p90_abs_error"]) if rel and rel.get("rows") else None
