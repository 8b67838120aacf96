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
                           "the strategy, its checkpointing included: write ckpt in a strategy "
                           "string (e.g. p=8,g=8,os=8,ckpt) or drop the option")


def test_checkpointing_written_in_the_strategy_is_planned():
    code, out, err = run_cli([*SMALL, "--strategy", "zero3,ckpt", "--json"])
    assert code == 0, err
    decision = json.loads(out)["decision"]
    assert decision["ckpt"] is True and decision["strategy"] == "p=16,g=16,os=16,mb=1,ckpt"
