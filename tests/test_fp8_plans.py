"""FP8 plans as files and rows: the version that holds them, strategies written as priced
(fp8ag under --fp8-all-gather on), a given FP8 gather in a bf16 row, and what a single-precision
FP8 compare says about its figures."""

from __future__ import annotations

import json

import pytest
from amsp_testlib import run_cli

H100 = ["--model", "llama3-8b", "--gpus", "64", "--cluster", "dgx-h100-ndr"]


def _plan(tmp_path, *extra, name="p.json", model="llama3-8b"):
    out = tmp_path / name
    code, text, err = run_cli(["plan", "--model", model, *H100[2:], "-o", str(out), *extra])
    assert code == 0, err
    return json.loads(out.read_text()), text + err


def test_fp8_plans_are_version_6_and_bf16_plans_keep_theirs(tmp_path):
    # docs/planner.md: version 6 holds inputs.training.precision fp8 (a new value, its recipe)
    fp8, _ = _plan(tmp_path, "--engine", "fsdp2", "--precision", "fp8", name="f.json")
    bf16, _ = _plan(tmp_path, "--engine", "fsdp2", name="b.json")
    assert fp8["version"] == 6 and bf16["version"] < 6
    code, out, err = run_cli(["validate", str(tmp_path / "f.json")])
    assert code == 0 and "valid amsp plan v6" in out + err
    # a version the decision does not need is refused in one line
    from amsp_planner.plan_schema import content_digest

    edited = dict(fp8, version=3)
    edited["digest"] = content_digest(edited)
    (tmp_path / "e.json").write_text(json.dumps(edited))
    code, out, err = run_cli(["validate", str(tmp_path / "e.json")])
    assert code == 2 and "field 'version' is 3" in err and "version 6" in err


def test_a_given_strategy_under_fp8_all_gather_on_is_written_with_fp8ag(tmp_path):
    doc, text = _plan(tmp_path, "--engine", "fsdp2", "--precision", "fp8", "--fp8-recipe",
                      "tensorwise", "--fp8-all-gather", "on", "-s", "zero3")
    assert doc["decision"]["strategy"] == "p=64,g=64,os=64,fp8ag,mb=1"
    assert "strategy p=64,g=64,os=64,fp8ag,mb=1" in text
    code, out, err = run_cli(["validate", str(tmp_path / "p.json")])
    assert code == 0, err


def test_a_given_fp8_gather_is_the_fp8_rows_only():
    code, out, err = run_cli(["compare", *H100, "--engine", "fsdp2", "--precision", "bf16,fp8",
                              "--fp8-recipe", "tensorwise", "-s", "tp=2,p=32,g=32,os=32,fp8ag,mb=2",
                              "--json"])
    assert code == 0, err
    given = {r["precision"]: r for r in json.loads(out)["rows"] if r["name"] == "given"}
    assert given["bf16"]["strategy"] == "tp=2,p=32,g=32,os=32,mb=2"
    assert given["fp8"]["strategy"] == "tp=2,p=32,g=32,os=32,fp8ag,mb=2"


@pytest.mark.parametrize("engine,needle", [("amsp", "FP8 on amsp (the bundled runtime)"),
                                           ("megatron", "FP8 here (Transformer Engine, delayed)")])
def test_a_single_precision_fp8_compare_says_what_its_figures_cover(engine, needle):
    code, out, err = run_cli(["compare", *H100, "--engine", engine, "--precision", "fp8"])
    assert code == 0, err
    assert "fp8 (" in " ".join(out.split()[:40]) and needle in " ".join((out + err).split())
    code, out, err = run_cli(["compare", *H100, "--engine", engine, "--precision", "fp8",
                              "--json"])
    doc = json.loads(out)
    assert doc["precisions"][0].startswith("fp8 (") and needle in doc["precision_notes"][0]


def test_exports_an_engine_refuses_are_warned_at_planning(tmp_path):
    # torchao's MX recipe on an FSDP2 plan: priced, but the FSDP2 module converts with
    # Float8LinearConfig only (exports/fp8.py refuse)
    _, text = _plan(tmp_path, "--engine", "fsdp2", "--precision", "fp8", "--fp8-recipe", "mxfp8",
                    "--set", "gpu.arch=blackwell")
    assert "warning: --fp8-recipe mxfp8: priced, but amsp export --to fsdp2" in text
    code, out, err = run_cli(["export", str(tmp_path / "p.json"), "--to", "fsdp2", "-o",
                              str(tmp_path / "m.py")])
    assert code == 2 and "not mxfp8" in err


def test_an_fp8_megatron_mixture_of_experts_plan_prices_its_experts_in_fp8(tmp_path):
    _, said = _plan(tmp_path, "--engine", "megatron", "--precision", "fp8", name="m.json",
                    model="qwen3-30b-a3b")
    out = tmp_path / "m.json"
    said = " ".join(said.split())
    assert "also its shared and routed experts' matmuls (TE's grouped linears)" in said
    code, text, err = run_cli(["export", str(out), "--to", "megatron", "-o",
                               str(tmp_path / "m.sh")])
    assert code == 0, err
    assert "priced them in bf16" not in text + err  # the export runs what the plan priced


def _edited(tmp_path, doc, name, **training):
    """The plan with its training inputs changed and its hashes and digest recomputed (an
    edit amsp validate cannot tell from the hashes: the job itself must be refused)."""
    from amsp_planner.plan import sha256
    from amsp_planner.plan_schema import content_digest

    doc = json.loads(json.dumps(doc))
    t = doc["inputs"]["training"]
    for k, v in training.items():
        if v is None:
            t.pop(k, None)
        else:
            t[k] = v
    for key in ("model", "cluster", "training"):
        doc["inputs"]["hashes"][key] = sha256(doc["inputs"][key])
    doc["digest"] = content_digest(doc)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("engine,extra,edit,field,needle", [
    ("torchtitan", (), {"fp8_recipe": "delayed"}, "inputs.training.fp8_recipe",
     "engine torchtitan does not run it"),
    ("torchtitan", (), {"fp8_all_gather": "on"}, "inputs.training.fp8_all_gather",
     "tensorwise recipe only"),
    ("fsdp2", ("--fp8-recipe", "tensorwise", "--fp8-all-gather", "on", "-s", "zero3"),
     {"precision": "bf16", "fp8_recipe": None, "fp8_all_gather": None}, "decision.strategy",
     "the FP8 all-gather needs --precision fp8"),
])
def test_an_edited_fp8_plan_is_refused_naming_its_field(tmp_path, engine, extra, edit, field,
                                                         needle):
    doc, _ = _plan(tmp_path, "--engine", engine, "--precision", "fp8", *extra)
    path = _edited(tmp_path, doc, "e.json", **edit)
    for cmd in (["validate", path], ["explain", path, "--no-sensitivity"]):
        code, out, err = run_cli(cmd)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"e.json: field '{field}':" in err and needle in err


def test_an_amsp_fp8_plan_without_its_gathers_warns_that_nothing_is_fp8(tmp_path):
    fp8, text = _plan(tmp_path, "--precision", "fp8", "--fp8-all-gather", "off", name="f.json")
    bf16, plain = _plan(tmp_path, name="b.json")
    assert "warning: --precision fp8 --fp8-all-gather off: nothing is FP8 on amsp" in text
    assert "nothing is FP8" not in plain
    # as the warning says: the same strategy and step as the bf16 plan
    assert fp8["decision"]["strategy"] == bf16["decision"]["strategy"]
    assert fp8["predictions"]["tokens_per_s"] == pytest.approx(bf16["predictions"]["tokens_per_s"])
