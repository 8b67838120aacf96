"""Plan files that contradict themselves: every field that repeats the decision (the components,
the ZeRO++ switches, micro-batch, accumulation, checkpointing, the predictions and the schedule,
the baselines, the runners-up) is re-derived on loading, and a plan with any one of them edited,
its digest recomputed as a script that rewrites plans would, is refused in one line naming the
field, by validate, explain, export and train alike."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from amsp_testlib import assert_user_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amsp_planner.plan import sha256

GOLDEN = Path(__file__).parent / "golden"
PLANS = {name: json.loads((GOLDEN / name).read_text()) for name in (
    "tiny_cpu-local_8.json",  # version 1, no references
    "llama-7b_dgx-a100-hdr_1024.json",  # ZeRO-3 with references that use ZeRO++
    "llama2-70b_dgx-h100-ndr_512.json",  # version 3, tp=8
)}
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _leaves(doc, prefix: str, skip=()):
    """(path as the error names it, container, key) of every scalar under `doc`."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc)
    for k, v in items:
        if k in skip:
            continue
        path = f"{prefix}[{k}]" if isinstance(doc, list) else f"{prefix}.{k}"
        if isinstance(v, dict | list):
            yield from _leaves(v, path)
        else:
            yield path, doc, k


def _redundant_leaves(doc: dict) -> list[tuple[str, object, object]]:
    """The fields that repeat the decision (the bands are the validation's, not the plan's)."""
    out = list(_leaves(doc["decision"], "decision"))
    out += _leaves(doc["predictions"], "predictions", skip=("bands",))
    out += _leaves(doc["baselines"], "baselines")
    out += _leaves(doc["runners_up"], "runners_up")
    return out


def _changed(value, draw):
    """Another value of the same JSON type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + draw(st.sampled_from([1, 2, 7, -1])) if value != 1 else 2
    if isinstance(value, float):
        return value * draw(st.sampled_from([0.5, 1.01, 2.0])) + 1.0
    if value is None:
        return 1
    return draw(st.sampled_from([value + "x", value.upper() + "_", "all_reduce", "p=8,g=8,os=8,mb=1"
                                 ])) if value not in ("all_reduce",) else "reduce_scatter"


def _write(tmp_path, doc) -> Path:
    # the digest recomputed as the plan module defines it (SHA-256 of the canonical JSON of
    # everything but 'volatile' and 'digest'), as a script rewriting a plan would
    doc["digest"] = sha256({k: v for k, v in doc.items() if k not in ("volatile", "digest")})
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


@st.composite
def one_edit(draw):
    name = draw(st.sampled_from(sorted(PLANS)))
    doc = copy.deepcopy(PLANS[name])
    leaves = _redundant_leaves(doc)
    path, parent, key = draw(st.sampled_from(leaves))
    new = _changed(parent[key], draw)
    if new == parent[key]:
        new = parent[key] + "_" if isinstance(new, str) else not parent[key]
    parent[key] = new
    return name, path, doc


@SETTINGS
@given(one_edit(), st.sampled_from(["validate", "export"]))
def test_any_redundant_field_edited_is_refused_naming_it(tmp_path, edit, command):
    name, field, doc = edit
    argv = [command, str(_write(tmp_path, doc))] + (["--to", "deepspeed"] if command == "export"
                                                     else [])
    line = assert_user_error(*run_cli(argv))
    assert f"'{field}" in line, (name, field, line)


KINDS = {
    # kind -> (edit, the field the line must name)
    "strategy vs factors": (lambda d: d["decision"].__setitem__("strategy", "p=8,g=8,os=8,mb=1"),
                            "decision.strategy"),
    "P factor": (lambda d: d["decision"]["components"]["p"].__setitem__("factor", 7),
                 "decision.components.p.factor"),
    "mesh": (lambda d: d["decision"]["components"]["os"].__setitem__("mesh", [8, 1]),
             "decision.components.os.mesh"),
    "hpz": (lambda d: d["decision"].__setitem__("hpz", 8), "decision.hpz"),
    "qwz": (lambda d: d["decision"].__setitem__("qwz", True), "decision.qwz"),
    "qgz": (lambda d: d["decision"].__setitem__("qgz", True), "decision.qgz"),
    "micro-batch": (lambda d: d["decision"].__setitem__("micro_batch", 2), "decision.micro_batch"),
    "accumulation": (lambda d: d["decision"].__setitem__("grad_accum", 3), "decision.grad_accum"),
    "checkpointing": (lambda d: d["decision"].__setitem__("ckpt", True), "decision.ckpt"),
    "fits": (lambda d: d["predictions"].__setitem__("fits", False), "predictions.fits"),
    "step time": (lambda d: d["predictions"]["time"].__setitem__("step_s", 0.5),
                  "predictions.time.step_s"),
    "schedule op renamed": (lambda d: d["predictions"]["schedule"][0].__setitem__(
        "op", "all_reduce"), "predictions.schedule[0].op"),
    "schedule entry dropped": (lambda d: d["predictions"]["schedule"].pop(),
                               "predictions.schedule"),
    "schedule a string": (lambda d: d["predictions"].__setitem__(  # as long as the schedule
        "schedule", "x" * len(d["predictions"]["schedule"])), "predictions.schedule"),
    "baseline fits": (lambda d: d["baselines"]["zero3"].__setitem__("fits", False),
                      "baselines.zero3.fits"),
    "baseline dropped": (lambda d: d["baselines"].pop("zero3"), "baselines"),
    "search zeropp": (lambda d: d["inputs"]["search"].__setitem__("zeropp", "yes"),
                      "inputs.search.zeropp"),
    "preference band": (lambda d: d["inputs"]["search"]["preference"].__setitem__("band", "x"),
                        "inputs.search.preference.band"),
    "preference tie-breaks": (lambda d: d["inputs"]["search"]["preference"].__setitem__(
        "tie_breaks", "memory"), "inputs.search.preference.tie_breaks"),
    "preference quantization": (lambda d: d["inputs"]["search"]["preference"].__setitem__(
        "quantization", 1), "inputs.search.preference.quantization"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("command", ["validate", "explain", "train"])
def test_each_kind_of_contradiction_is_one_line_in_every_reader(tmp_path, kind, command):
    edit, field = KINDS[kind]
    doc = copy.deepcopy(PLANS["tiny_cpu-local_8.json"])
    edit(doc)
    argv = [command, str(_write(tmp_path, doc))]
    if command == "explain":
        argv.append("--no-sensitivity")
    if command == "train":
        argv += ["--steps", "1", "--cpu"]
    line = assert_user_error(*run_cli(argv))
    assert f"'{field}" in line, line


def test_unedited_plans_still_validate(tmp_path):
    for name, doc in PLANS.items():
        code, out, err = run_cli(["validate", str(_write(tmp_path, copy.deepcopy(doc)))])
        assert code == 0 and "valid amsp plan" in out, (name, err)


def test_a_plan_with_runners_up_and_pinned_search_round_trips_and_its_edits_are_caught(tmp_path):
    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--model", "tiny", "--gpus", "8", "--cluster", "cpu-local",
                            "--seq-len", "128", "--global-batch-seqs", "32", "--runners-up", "3",
                            "--no-zeropp", "--micro-batch", "2", "-o", str(plan)])
    assert code == 0, err
    assert run_cli(["validate", str(plan)])[0] == 0
    doc = json.loads(plan.read_text())
    assert doc["runners_up"]
    for edit, field in (
        (lambda d: d["runners_up"][0].__setitem__("fits", not d["runners_up"][0]["fits"]),
         "runners_up[0].fits"),
        (lambda d: d["inputs"]["search"].__setitem__("micro_batch", 4),
         "inputs.search.micro_batch"),
        (lambda d: d["inputs"]["search"].__setitem__("zeropp", True) or d["decision"].update(
            strategy="p=1,g=1,os=8,qwz,mb=2"), "decision"),
    ):
        d = copy.deepcopy(doc)
        edit(d)
        line = assert_user_error(*run_cli(["validate", str(_write(tmp_path, d))]))
        assert f"'{field}" in line, line
