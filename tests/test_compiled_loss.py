"""A cross-entropy under torch.compile (``cross_entropy: compiled``: OLMo-core's
``compile_loss``, torchtitan's compiled loss): its memory measured against eager on CPU
(bench/compiled_loss_memory.py), the model's terms by hand, the CLI and the runtime's refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from amsp_planner.cost.activations import head_bytes_per_token, loss_peak_bytes
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

BENCH = Path(__file__).resolve().parent.parent / "bench" / "compiled_loss_memory.py"
V = 128_256  # Llama-3-8B's vocabulary


def job(ce: str, profile: str = "compiled", seq: int = 8192) -> Job:
    t = TrainingSpec(seq_len=seq, global_batch_seqs=16, activation_profile=profile,
                     cross_entropy=ce, compile=True)
    return Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"), t, 8,
                      engine="torchtitan")


def test_measured_compiled_loss_holds_only_the_logits_gradient():
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(BENCH), "--tokens", "2048", "--vocab", "16384"],
                       capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(r.stdout.strip().splitlines()[-1])["bytes_per_token_entry"]
    # eager: fp32 copies of the logits and of their gradient (CPU's kernels keep more than
    # CUDA's measured 8); compiled: the bf16 gradient alone, 2 bytes
    assert got["eager"] >= 8
    assert got["compiled"] == pytest.approx(2.0, abs=0.5)
    # the model's compiled loss peak is that gradient: 2 bytes per token and entry
    j = job("compiled")
    assert loss_peak_bytes(j, 1) / (8192 * V) == pytest.approx(got["compiled"], abs=0.5)


@pytest.mark.parametrize("profile", ["compiled", "eager", "torchtitan"])
def test_compiled_loss_terms_by_hand(profile):
    eager, comp = job("logits", profile), job("compiled", profile)
    # saved: bf16 logits (2 bytes) instead of the fp32 log-probabilities (4)
    assert head_bytes_per_token(eager) - head_bytes_per_token(comp) == 2 * V
    # the backward's transient: the bf16 gradient (2) instead of eager's fp32 pair (8)
    assert loss_peak_bytes(eager, 2) - loss_peak_bytes(comp, 2) == 6 * V * 2 * 8192


def test_spec_cli_and_runtime():
    from amsp_testlib import run_cli

    from amsp_planner.runtime.support import check_tp

    assert TrainingSpec(cross_entropy="compiled").model_dump()["cross_entropy"] == "compiled"
    mem = {}
    for ce in ("logits", "compiled"):
        code, out, err = run_cli(["compare", "--model", "llama3-8b", "--gpus", "8",
                                  "--cluster", "dgx-h100-ndr", "--engine", "torchtitan",
                                  "--strategy", "p=8,g=8,os=8,mb=2", "--cross-entropy", ce])
        assert code == 0, err
        row = next(ln for ln in out.splitlines() if "p=8,g=8,os=8,mb=2" in ln)
        mem[ce] = float(row.split("│")[3])
    assert mem["compiled"] < mem["logits"]
    # in the breakdown: 8 bytes per token and entry less (2 saved + 6 transient), two
    # sequences of 4,096 tokens (the fragmentation allowance on top scales with them)
    from amsp_planner.cost.evaluate import evaluate

    s = Strategy(s_p=8, s_g=8, s_os=8, micro_batch=2)
    b = {ce: evaluate(job(ce, seq=4096), s).memory for ce in ("logits", "compiled")}
    act = {ce: m.activations + m.loss_peak for ce, m in b.items()}
    assert act["logits"] - act["compiled"] == pytest.approx(8 * V * 2 * 4096)
    with pytest.raises(AmspUserError) as e:
        check_tp(Strategy(s_p=8, s_g=8, s_os=8, micro_batch=1), job("compiled"))
    assert "cross_entropy compiled" in str(e.value) and "\n" not in str(e.value)
