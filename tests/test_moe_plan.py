"""A mixture of experts through `amsp plan` and the plan file (version 4, docs/moe.md): the
experts' decision written and re-derived on load, older versions still loading, and bad MoE
input refused in one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from amsp_testlib import assert_user_error, run_cli

from amsp_planner.plan import load_plan
from amsp_planner.plan_schema import content_digest

GOLDEN = Path(__file__).parent / "golden"
Q3 = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "64"]


def test_plan_qwen3_moe_on_64_gpus_prints_e_and_both_triples(tmp_path):
    out_file = tmp_path / "q3.json"
    code, out, err = run_cli([*Q3, "-o", str(out_file)])
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("experts: e="))
    assert "dense p/g/os = " in line and "expert p/g/os = " in line
    doc = json.loads(out_file.read_text())
    assert doc["version"] == 4
    ex = doc["decision"]["experts"]
    plan = load_plan(out_file)  # the decision re-derived from the strategy string
    s = plan.strategy
    assert s.has_experts and ex["ep"] == s.ep and ex["span"] == s.ep_span
    assert [ex["components"][c]["factor"] for c in ("p", "g", "os")] == [s.ep_p, s.ep_g, s.ep_os]
    assert f"e={s.ep} " in line
    assert f"expert p/g/os = {s.ep_p}/{s.ep_g}/{s.ep_os}" in line
    assert 128 % s.ep == 0 and 64 % s.ep == 0


def test_a_given_moe_strategy_round_trips_through_the_plan_file(tmp_path):
    f = tmp_path / "p.json"
    s = "ep=8,p=64,g=64,os=64,ep.p=8,ep.g=8,ep.os=8,mb=1,ckpt"
    code, _, err = run_cli([*Q3, "--strategy", s, "-o", str(f)])
    assert code == 0, err
    doc = json.loads(f.read_text())
    assert doc["decision"]["strategy"] == s
    # in the node at e = 8 the 8 ranks holding the same experts are one per node
    assert doc["decision"]["experts"]["components"]["p"] == {"factor": 8, "mesh": [1, 8],
                                                             "scope": "inter"}
    assert str(load_plan(f).strategy.with_(grad_accum=None)) == s
    # an edited expert factor (its digest made to match) is refused on load, naming it
    doc["decision"]["experts"]["components"]["p"]["factor"] = 4
    doc["digest"] = content_digest(doc)
    f.write_text(json.dumps(doc))
    code, out, err = run_cli(["validate", str(f)])
    assert_user_error(code, out, err, "decision.experts.components.p.factor")
    # and a version 3 plan cannot hold experts
    doc["decision"]["experts"]["components"]["p"]["factor"] = 8
    doc["version"] = 3
    doc["digest"] = content_digest(doc)
    f.write_text(json.dumps(doc))
    code, out, err = run_cli(["validate", str(f)])
    assert_user_error(code, out, err, "decision.experts", "version 3")


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.name)
def test_older_plan_versions_still_load(golden):
    plan = load_plan(golden)
    assert plan.doc["version"] < 4 and not plan.strategy.has_experts


@pytest.mark.parametrize("args, needles", [
    (["--strategy", "ep=3,p=64,g=64,os=64,mb=1"], ["ep=3", "does not divide"]),
    (["--ep", "3"], ["--ep 3", "divide"]),
    (["--ep", "x"], ["--ep x", "auto"]),
    (["--expert-imbalance", "0.5"], ["expert-imbalance"]),
    (["--expert-imbalance", "nan"], ["expert-imbalance"]),
    (["--strategy", "ep=8,p=64,g=64,os=64,ep.p=16,mb=1"], ["ep.p=16"]),
    (["--strategy", "ep=8,ep.span,p=64,g=64,os=64,qwz,mb=1"], ["ZeRO++"]),
])
def test_bad_moe_input_is_one_line_exit_2(args, needles):
    code, out, err = run_cli([*Q3, *args, "-o", "-"])
    assert_user_error(code, out, err, *needles)


def test_experts_not_dividing_the_degree_and_bad_top_k_are_one_line(tmp_path):
    spec = tmp_path / "m.yaml"
    base = ("name: m\nnum_layers: 2\nhidden_size: 256\nnum_heads: 4\nffn_hidden_size: 512\n"
            "vocab_size: 1000\nexpert_ffn_hidden_size: 128\n")
    spec.write_text(base + "num_experts: 12\nexperts_per_token: 2\n")
    code, out, err = run_cli(["plan", "--model", str(spec), "--gpus", "16", "--strategy",
                              "ep=8,p=16,g=16,os=16,mb=1", "-o", "-"])
    assert_user_error(code, out, err, "ep=8 does not divide the model's 12 routed experts")
    spec = tmp_path / "k.yaml"
    spec.write_text(base + "num_experts: 4\nexperts_per_token: 6\n")
    code, out, err = run_cli(["plan", "--model", str(spec), "--gpus", "16", "-o", "-"])
    assert_user_error(code, out, err, "experts_per_token")


def test_ep_on_a_dense_model_is_refused():
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "--ep", "8",
                              "-o", "-"])
    assert_user_error(code, out, err, "--ep 8", "no routed experts")


def test_tp_of_a_mixture_of_experts_is_refused_for_what_it_is():
    # 1024 sequences split over 32 ranks: the batch is not why; TP of an MoE model is not modelled
    code, out, err = run_cli(["compare", "--model", "qwen3-30b-a3b", "--gpus", "64", "--cluster",
                              "dgx-h100-ndr", "--tp", "2"])
    assert_user_error(code, out, err, "--tp 2", "mixture of experts", "not modelled")
    assert "global batch" not in err
