"""amsp plan: an option that cannot apply to a given strategy is an error, not a no-op."""

from __future__ import annotations

import json

import pytest
from amsp_testlib import run_cli

SMALL = ["plan", "--model", "tiny", "--gpus", "16", "--cluster", "cpu-local",
         "--global-batch-seqs", "64", "-o", "-"]


@pytest.mark.parametrize("value", ["on", "off"])
def test_activation_checkpointing_with_a_named_strategy_is_refused(value):
    code, out, err = run_cli([*SMALL, "--strategy", "zero3", "--activation-checkpointing", value])
    assert code == 2 and out == ""
    assert err.strip() == (f"error: --activation-checkpointing {value}: --strategy zero3 fixes "
                           "the strategy, its checkpointing included: write ckpt, ckpt=K or "
                           "ckpt=op in a strategy string (e.g. p=8,g=8,os=8,ckpt=12) or drop "
                           "the option")


def test_checkpointing_written_in_the_strategy_is_planned():
    code, out, err = run_cli([*SMALL, "--strategy", "zero3,ckpt", "--json"])
    assert code == 0, err
    decision = json.loads(out)["decision"]
    assert decision["ckpt"] is True and decision["strategy"] == "p=16,g=16,os=16,mb=1,ckpt"


@pytest.mark.parametrize("value, ckpt, token", [("1", 1, "ckpt=1"), ("op", "op", "ckpt=op"),
                                                ("2", True, "ckpt"), ("0", False, None)])
def test_activation_checkpointing_pins_blocks_or_op(value, ckpt, token):
    # tiny has 2 blocks: 1 is partial, 2 is every block (written "ckpt"), 0 is none; data
    # parallel only (--tp 1: a tensor-parallel plan would be version 3)
    code, out, err = run_cli([*SMALL, "--activation-checkpointing", value, "--tp", "1",
                              "--json"])
    assert code == 0, err
    doc = json.loads(out)
    decision = doc["decision"]
    assert decision["ckpt"] == ckpt and type(decision["ckpt"]) is type(ckpt)
    parts = decision["strategy"].split(",")
    assert (token in parts) if token else not any(p.startswith("ckpt") for p in parts)
    assert doc["version"] == (1 if isinstance(ckpt, bool) else 2)


@pytest.mark.parametrize("args, needle", [
    (["--activation-checkpointing", "maybe"],
     "--activation-checkpointing maybe: use auto, on, off, a block count K"),
    (["--activation-checkpointing", "3"], "--activation-checkpointing 3: the model has 2 blocks"),
    (["--strategy", "p=16,g=16,os=16,ckpt=3"], "ckpt=3 exceeds the model's 2 blocks"),
    (["--strategy", "zero3,ckpt=-1"], "the block count must be at least 0"),
])
def test_bad_checkpointing_is_one_line(args, needle):
    code, out, err = run_cli([*SMALL, *args])
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_partial_and_op_plans_load_back(tmp_path):
    from amsp_planner.plan import load_plan

    for strategy, want in (("zero3,ckpt=1", 1), ("zero3,ckpt=op", "op")):
        path = tmp_path / "plan.json"
        code, _, err = run_cli([*SMALL[:-2], "--strategy", strategy, "-o", str(path)])
        assert code == 0, err
        plan = load_plan(path)
        assert plan.strategy.ckpt_value == want
        doc = json.loads(path.read_text())
        doc["version"] = 1  # a version 1 plan holds true/false only
        path.write_text(json.dumps(doc))
        code, _, err = run_cli(["explain", str(path)])
        assert code == 2 and "version 1 plan holds true or false" in err, err


def test_baselines_of_a_given_strategy_keep_its_checkpointing():
    code, out, err = run_cli([*SMALL, "--strategy", "p=4,g=4,os=16,ckpt=1", "--json"])
    assert code == 0, err
    baselines = json.loads(out)["baselines"]
    assert baselines and all(b["strategy"].endswith(",ckpt=1") for b in baselines.values())
