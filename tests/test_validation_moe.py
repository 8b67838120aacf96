"""The published mixture-of-experts runs (presets/validation_moe.yaml, issue #26 part 6): schema,
sources, the MoE fields and the figures derived from published ones. The rows are priced by
bench/gpu_validation.py once the MoE cost model lands; until then this file is their only reader."""

from __future__ import annotations

import re

import pytest

from amsp_planner.specs import load_cluster, load_model
from amsp_planner.specs.model import ModelSpec
from amsp_planner.strategy import Strategy
from amsp_planner.textfile import load
from amsp_planner.validation import PRESETS, check_jobs, check_rows

MOE_FILE = PRESETS / "validation_moe.yaml"
PRECISIONS = {"bf16", "fp8", "fp8-cs", "fp8-mx"}


@pytest.fixture(scope="module")
def doc():
    return check_rows(load(MOE_FILE))


def _model(doc, name: str) -> ModelSpec:
    models = doc.get("models", {})
    return ModelSpec(**models[name]) if name in models else load_model(name)


def test_rows_have_the_base_schema_unique_ids_and_used_sources(doc):
    rows = doc["rows"]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "row ids must be unique"
    assert len(rows) >= 15 and len({r["source"] for r in rows}) >= 3
    assert {r["source"] for r in rows} == set(doc["sources"]), "every source is used"
    check_jobs(rows)
    for key, text in doc["sources"].items():
        assert re.search(r"https://\S+", text), f"source {key} gives its address"


def test_every_row_says_where_its_figures_are_and_its_moe_setup(doc):
    for r in doc["rows"]:
        assert isinstance(r.get("where"), str) and len(r["where"]) > 10, r["id"]
        assert float(r["value"]) > 0 and r["gpus"] >= 1, r["id"]
        assert r.get("precision") in PRECISIONS, r["id"]
        if "ep" in r:
            assert isinstance(r["ep"], int) and r["ep"] >= 1 and r["gpus"] % r["ep"] == 0, r["id"]
        if "expert_imbalance" in r:
            assert r["expert_imbalance"] >= 1.0, r["id"]
        scope = r["scope"]
        assert scope == "in" or (isinstance(scope, str) and len(scope) > 10), r["id"]
        if r.get("oom"):
            assert r["metric"] == "memory" and r.get("bound") == ">", r["id"]
        assert r.get("bound", "=") in ("=", ">", "<"), r["id"]


def test_a_row_in_scope_is_a_whole_published_job_with_balanced_routing(doc):
    """What the planner would price: bf16, or FP8 on a Megatron engine (whose experts run FP8
    there: cost/fp8_bytes.py fp8_experts) with the row's precision priced, the routing balance
    given, every batch setting, an expert-parallel strategy whose degree is the published one,
    a model it can build."""
    from amsp_planner.engines import runs_as
    from amsp_planner.validation import pricing_engine

    rows_in = [r for r in doc["rows"] if r["scope"] == "in"]
    assert rows_in
    for r in rows_in:
        assert r.get("training", {}).get("precision", "bf16") == r["precision"], r["id"]
        engine = pricing_engine(r["engine"], r.get("engine_version"))[0]
        assert r["precision"] == "bf16" or runs_as(engine) == "megatron", r["id"]
        assert r.get("expert_imbalance") == 1.0, r["id"]
        assert r.get("seq_len") and r.get("global_batch_seqs") and r.get("ep"), r["id"]
        s = Strategy.parse(r["strategy"])
        assert s.has_experts and s.ep == r["ep"], r["id"]
        s.check(r["gpus"], load_cluster(r["cluster"], r.get("set")).gpus_per_node)
        s.n_micro(r["global_batch_seqs"], r["gpus"])
        s.check_experts(_model(doc, r["model"]).num_experts)
        m = _model(doc, r["model"])
        assert m.is_moe and m.num_experts % r["ep"] == 0, r["id"]
        assert r["seq_len"] <= m.max_seq_len, r["id"]


def test_rows_outside_the_model_say_why(doc):
    """A precision, GPU or parallelism the planner lacks puts a row out of scope, by its reason;
    pipeline stages no longer do, nor does FP8 under Megatron (its experts run FP8 there)."""
    for r in doc["rows"]:
        layout = r.get("layout", {})
        why = r["scope"].lower()
        if r["precision"] != "bf16" and r["scope"] != "in" and "fp8" in why:
            assert "fp8 [inf] are modelled" in why or "fp8 are modelled" in why \
                or "recipe" in why or "mxfp8" in why, r["id"]
        if layout.get("pp", 1) > 1:  # pipeline stages of a MoE model are priced (cost/pipeline.py)
            assert not why.startswith("pipeline") and "pipeline parallelism (" not in why, r["id"]
        if layout.get("tp", 1) > 1:
            assert "tensor parallelism" in why, r["id"]
        if "expert_imbalance" not in r:
            assert r["scope"] != "in", r["id"]


DERIVED = re.compile(r"value \(derived\) = (\d+) x (\d+) / ([\d.]+) s / (\d+)")


def test_derived_throughputs_recompute_from_the_published_step_times(doc):
    """Every "value (derived) = seqs x tokens / step s / GPUs" note, recomputed; and the two
    in-scope rows' published tokens/s/GPU against their published step times."""
    seen = 0
    for r in doc["rows"]:
        m = DERIVED.search(r.get("note", ""))
        if m:
            seqs, tokens, step, gpus = int(m[1]), int(m[2]), float(m[3]), int(m[4])
            assert gpus == r["gpus"], r["id"]
            assert r["value"] == pytest.approx(seqs * tokens / step / gpus, abs=0.05), r["id"]
            seen += 1
    assert seen >= 6
    # NeMo AutoModel table: 512 x 4096 / 21.773 s / 8 and 256 x 4096 / 10.04 s / 8
    byid = {r["id"]: r for r in doc["rows"]}
    assert byid["automodel-qwen3-30b-a3b-8"]["value"] == pytest.approx(512 * 4096 / 21.773 / 8,
                                                                       rel=0.001)
    assert byid["automodel-gpt-oss-20b-8"]["value"] == pytest.approx(256 * 4096 / 10.04 / 8,
                                                                     rel=0.001)


def test_inline_gpt_oss_20b_has_the_model_card_counts(doc):
    """gpt-oss model card (arXiv 2508.10925, table 1): 20.91B total, 3.61B active without the
    embedding; the card rounds to 0.01B."""
    pub = doc["model_params_published"]["gpt-oss-20b"]
    m = _model(doc, "gpt-oss-20b")
    assert abs(m.num_params - pub["total"]) <= 0.005e9
    active = m.num_active_params - m.embedding_params()
    assert abs(active - pub["active_without_embedding"]) <= 0.005e9
    # 24 layers of gpt-oss-120b's shape with 32 instead of 128 experts
    big = load_model("gpt-oss-120b")
    assert (big.num_params - m.num_params) == pytest.approx(
        12 * big.layer_params(0) + 24 * 96 * big.expert_params(), rel=0.01)


def test_rows_in_scope_are_priced_with_their_expert_imbalance(doc):
    """The rows in scope are jobs the MoE cost model prices (bench/gpu_validation.py reports
    their statistics); a row's expert_imbalance reaches the training spec: an imbalanced gate
    is predicted slower than the balanced one the source forced."""
    import copy

    from amsp_planner.validation import MOE_ROWS_FILE, load_rows, predict_rows, row_job

    assert load_rows(MOE_ROWS_FILE) == doc
    rows_in = [r for r in doc["rows"] if r["scope"] == "in"]
    got = predict_rows({**doc, "rows": rows_in})
    assert all(r.predicted and r.predicted > 0 and r.fits is not None for r in got)
    row = copy.deepcopy(rows_in[0])
    job, _ = row_job(row, doc.get("models", {}))
    assert job.training.expert_imbalance == row["expert_imbalance"] == 1.0
    row["expert_imbalance"] = 1.5
    (skewed,) = predict_rows({**doc, "rows": [row]})
    assert skewed.predicted < got[0].predicted
