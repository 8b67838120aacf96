"""The published validation set (presets/validation.yaml) and the bands written from it
(presets/error_bands.json, bench/gpu_validation.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from amsp_planner.validation import (
    BANDS_FILE,
    JOB_FIELDS,
    Pair,
    RowResult,
    check_jobs,
    check_rows,
    load_rows,
    predict_rows,
    relative_band,
    relative_pairs,
    scale_bucket,
    step_time_band,
    summary,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def doc():
    return load_rows()


@pytest.fixture(scope="module")
def results(doc):
    return predict_rows(doc)


def test_every_row_has_a_source_an_engine_and_a_scope(doc):
    ids = [r["id"] for r in doc["rows"]]
    assert len(ids) == len(set(ids)), "row ids must be unique"
    for r in doc["rows"]:
        assert r["source"] in doc["sources"] and doc["sources"][r["source"]].strip(), r["id"]
        assert isinstance(r.get("engine"), str) and r["engine"], r["id"]
        scope = r.get("scope")
        assert scope == "in" or (isinstance(scope, str) and len(scope) > 10), \
            f"{r['id']}: an out-of-scope row states its reason"
        assert float(r["value"]) > 0 and r["gpus"] >= 1, r["id"]
        if scope == "in":  # a row in scope is a job the model prices
            assert r.get("strategy") and r.get("cluster"), r["id"]


@pytest.mark.parametrize(("field", "value", "says"), [
    ("engine", None, "field 'engine' is missing"), ("scope", "", "field 'scope' is missing"),
    ("source", "nowhere", "field 'source'"), ("strategy", None, "needs fields 'strategy'"),
    ("execution", {"max_live": 3}, "field 'execution': 'max_live' is not an Execution field"),
    ("execution", {"max_live_params": "3e9"}, "field 'execution': 'max_live_params' must be"),
    ("execution", [1], "field 'execution' must map")])
def test_a_bad_row_is_named_with_its_field(doc, field, value, says):
    bad = copy.deepcopy(doc)
    row = next(r for r in bad["rows"] if r["scope"] == "in")
    row[field] = value
    with pytest.raises(ValueError, match=f"row {row['id']}: .*{says}"):
        check_rows(bad)


def test_the_set_covers_engines_sources_scale_and_memory(doc):
    rows = doc["rows"]
    tput = [r for r in rows if r["metric"] != "memory"]
    assert len(tput) >= 80
    assert len({r["source"] for r in rows}) >= 8
    assert len({r["engine"] for r in rows}) >= 4
    assert sum(r["gpus"] >= 256 for r in tput) >= 25
    assert sum(r["metric"] == "memory" or "memory_gib" in r for r in rows) >= 30


def test_inline_models_have_the_published_parameter_counts(doc):
    from amsp_planner.specs.model import ModelSpec

    for name, published in doc["model_params"].items():
        assert ModelSpec(**doc["models"][name]).num_params == published, name


def test_scale_buckets_split_at_64_and_256():
    assert [scale_bucket(n) for n in (8, 64, 65, 255, 256, 16384)] == \
        ["<= 64", "<= 64", "65-255", "65-255", ">= 256", ">= 256"]


def test_pairs_are_one_job_with_two_strategies(doc, results):
    pairs = relative_pairs(doc, results)
    assert len(pairs) >= 20
    rows = {r["id"]: r for r in doc["rows"]}
    for p in pairs:
        a, b = rows[p.faster.id], rows[p.slower.id]
        assert all(a.get(f) == b.get(f) for f in JOB_FIELDS), (a["id"], b["id"])
        assert (a["strategy"], a["engine"]) != (b["strategy"], b["engine"])
        assert p.faster.published >= p.slower.published


def test_a_mismatched_pair_is_refused(doc):
    check_jobs(doc["rows"])  # the published pairs agree
    for field, value in (("gpus", 4096), ("global_batch_seqs", 1), ("model", "llama-7b"),
                         ("training", {"activation_profile": "fused"})):
        bad = copy.deepcopy(doc)
        tag = next(t for t, rows in check_jobs(bad["rows"]).items() if len(rows) >= 2)
        check_jobs(bad["rows"])[tag][1][field] = value
        with pytest.raises(ValueError, match=f"field '{field}'"):
            check_jobs(bad["rows"])


def test_ratio_error_by_hand():
    def row(i, published, predicted):
        return RowResult(i, "s", "e", 64, "tps_per_gpu", published, predicted, "=", "in",
                         None, i)

    p = Pair("j", row("a", 4000, 3000), row("b", 2000, 2000))
    assert p.measured == 2 and p.predicted == 1.5
    assert p.error == pytest.approx(-0.25) and p.order_kept
    assert not Pair("j", row("a", 4000, 1900), row("b", 2000, 2000)).order_kept


def test_the_bands_file_is_the_current_prediction(results):
    """error_bands.json holds what the rows give now (rerun bench/gpu_validation.py after a
    change to the rows or the cost model)."""
    bands = json.loads(BANDS_FILE.read_text())
    now = summary(results)
    assert bands["step_time"]["rows"] == now["rows"]
    assert bands["step_time"]["p90_abs_error"] == pytest.approx(now["p90_abs_error"])
    assert bands["memory"]["max_abs_error"] == pytest.approx(
        summary(results, memory=True)["max_abs_error"])
    for key in ("step_time_by_engine", "step_time_by_scale", "step_time_by_engine_scale",
                "memory_by_engine", "relative", "relative_by_engine", "relative_by_scale",
                "targets", "targets_met"):
        assert key in bands
    assert step_time_band() == bands["step_time"]["p90_abs_error"]
    # a subset's band counts from BAND_MIN_PAIRS pairs (a percentile of a few is their
    # largest); below, the wider set's stands: the scale bucket's, else all pairs'
    from amsp_planner.validation import BAND_MIN_PAIRS

    for eng, got in bands["relative_by_engine"].items():
        want = got if got["rows"] >= BAND_MIN_PAIRS else bands["relative"]
        assert relative_band(eng) == want["p90_abs_error"], eng
    for gpus, bucket in ((8, "<= 64"), (128, "65-255"), (512, ">= 256")):
        got = bands["relative_by_scale"].get(bucket)
        want = got if got and got["rows"] >= BAND_MIN_PAIRS else bands["relative"]
        assert relative_band("no-such-engine", gpus) == want["p90_abs_error"], bucket
    assert relative_band("no-such-engine") == bands["relative"]["p90_abs_error"]
    # the bands in use never come from fewer pairs, and do not jump between scale buckets
    # by more than the spread of the buckets that count
    used = [relative_band("no-such-engine", g) for g in (8, 128, 512)]
    assert max(used) - min(used) <= 0.01, used


def test_the_bench_reports_a_missed_target_without_failing(capsys):
    spec = importlib.util.spec_from_file_location("gpu_validation",
                                                  ROOT / "bench" / "gpu_validation.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith(("targets met", "targets MISSED"))
    assert "rows in scope / collected" in out


def test_a_key_given_twice_in_a_row_is_refused(tmp_path):
    # two `value:` keys in one row: YAML's safe_load keeps the last silently; the rows are read
    # as every input is, so the duplicate is named
    import amsp_planner.validation as v
    from amsp_planner.errors import AmspUserError

    bad = tmp_path / "rows.yaml"
    bad.write_text("rows:\n  - {id: a, source: s, engine: fsdp, gpus: 8, metric: tps_per_gpu,\n"
                   "     value: 1, value: 2, scope: in}\n")
    with pytest.raises(AmspUserError, match="value"):
        v.load_rows(bad)


def test_every_row_is_priced_with_its_own_engines_profile(results):
    """A row whose engine has a profile is priced with that profile, never the bundled
    runtime's: InternEvo's tensor-parallel rows run InternEvo's broadcast of the updated shards
    (engines.py), which is what separates zero1=-1 from zero1=4 at 1,024 GPUs."""
    from amsp_planner.engines import ENGINES

    for r in results:
        if r.priced_as and r.engine in ENGINES:  # its own, or its own at the row's release
            own = r.priced_as.split(" [")[0]  # a run's own settings follow in brackets
            assert own.split("@")[0] == r.engine, (r.id, r.priced_as)
    tp2 = [r for r in results if r.id.startswith("internlm-tp2-zero1-all")]
    assert tp2 and all(r.priced_as == "internevo" for r in tp2)


def test_torchtitan_pipeline_rows_run_its_default_eight_micro_batches(doc):
    """torchtitan 9dec370 (the 405B pipeline tables) splits the local batch into as many
    micro-batches as pipeline stages when pipeline_parallel_microbatches is unset
    (pipelining_utils.py build_pipeline_schedule): 8 at PP 8, so the published local batches
    (32 at 8K, 8 at 32K-256K) give micro-batches of 4 and 1."""
    from amsp_planner.strategy import parse_strategy_or_baseline

    local = {8192: 32, 32768: 8, 65536: 8, 131072: 8, 262144: 8}  # Tables 5 and 6
    rows = [r for r in doc["rows"] if r["source"] == "torchtitan-h100" and "pp=" in
            r.get("strategy", "")]
    assert {r["id"] for r in rows} >= {"tt-h100-l31-405b-pp-1f1b", "tt-h100-l31-405b-pp-32k",
                                       "tt-h100-l31-405b-pp-cp2",
                                       "tt-h100-l31-405b-pp-interleaved"}
    for r in rows:
        s = parse_strategy_or_baseline(r["strategy"], r["gpus"], 8)
        dp_shard = r["gpus"] // (s.tp * s.pp * s.cp)
        assert r["global_batch_seqs"] == local[r["seq_len"]] * dp_shard, r["id"]
        assert local[r["seq_len"]] // s.micro_batch == s.pp == 8, r["id"]
        assert r["training"]["tp_overlap"] and r["training"]["compile"], r["id"]  # the toml
