"""amsp explain's FP8 crossover: the per-GPU batch and the model size below which FP8 stops
paying, checked by hand against torchao's published H100 rowwise table."""

import math
import re

import pytest
from amsp_testlib import run_cli

from amsp_planner.cost.job import Job
from amsp_planner.report.fp8_sensitivity import fp8_crossover
from amsp_planner.specs import ModelSpec, TrainingSpec, load_cluster
from amsp_planner.strategy import Strategy


def _square(hidden: int, heads: int) -> ModelSpec:
    """Multi-head attention with the FFN as wide as the hidden size: every linear of a block
    (wq, wk, wv, wo, w1, w3, w2) is hidden x hidden, so the block's matmuls get exactly the
    table's speed-up of that one shape and FP8 pays exactly where the table says > 1."""
    return ModelSpec(name="square", num_layers=2, hidden_size=hidden, num_heads=heads,
                     ffn_hidden_size=hidden, vocab_size=32000)


def _crossover(precision="fp8", recipe="rowwise", engine="torchtitan", cluster="dgx-h100-ndr"):
    t = TrainingSpec(seq_len=4096, global_batch_seqs=8, precision=precision, fp8_recipe=recipe)
    job = Job.create(_square(8192, 64), load_cluster(cluster), t, 8, engine)
    return fp8_crossover(job, Strategy.parse("p=8,g=8,os=8,mb=1"))


def test_batch_crossover_is_where_the_rowwise_table_crosses_one():
    c = _crossover()
    b = c["batch"]
    # torchao H100 rowwise table (docs/static/fp8-rowwise-perf.png), K = N = 8192:
    # M = 2048: 0.82, M = 4096: 1.01 (M = 8192 ... 32768: 1.20, 1.33, 1.41; 1024: 0.62).
    # Linear in log2 M between them: 1 at 2048 x 2^(0.18 / 0.19).
    m_star = 2048 * 2 ** (0.18 / 0.19)
    assert b["pays"] == "above" and not b["also_pays_lower"]
    assert b["below"] == pytest.approx(m_star, rel=0.011)


def test_model_crossover_is_where_the_table_crosses_one_along_its_diagonal():
    c = _crossover()
    w = c["model"]
    # M = 4096 (one sequence of 4096 per GPU). Every linear h x h with h between 4096 and 8192:
    # the table at (K, N) = (4096, 4096) 0.84, (4096, 8192) 1.01, (8192, 4096) 0.91,
    # (8192, 8192) 1.01; bilinear in (log2 K, log2 N) along the diagonal at weight u:
    # 0.84 (1-u)^2 + (1.01 + 0.91) u (1-u) + 1.01 u^2 = 1  ->  0.07 u^2 - 0.24 u + 0.16 = 0
    u = (0.24 - math.sqrt(0.24 ** 2 - 4 * 0.07 * 0.16)) / (2 * 0.07)
    h_star = 4096 * 2 ** u  # about 7,667
    assert w["pays"] == "above"
    assert w["hidden"] == pytest.approx(h_star, rel=0.011)
    # the size named is the parameter count at that width: a model of hidden 7,680 (60 heads
    # of 128) counted by ModelSpec is within the bracket
    assert w["params"] == pytest.approx(_square(7680, 60).num_params, rel=0.02)


def test_a_bf16_plan_gets_the_engine_default_recipe_and_the_same_crossover():
    c = _crossover(precision="bf16", recipe=None)
    assert c["recipe"] == "rowwise"  # torchtitan's Float8LinearConverter default
    assert c["batch"]["below"] == pytest.approx(_crossover()["batch"]["below"])
    # one sequence of 4096 is above the crossover: the step gets faster in FP8
    assert c["step_s"]["fp8"] < c["step_s"]["bf16"] and c["step_gain"] > 0


def test_not_priced_where_the_engine_has_no_fp8():
    assert _crossover(precision="bf16", recipe=None, engine="deepspeed") == {
        "applicable": False, "why": "engine deepspeed has no FP8 path here"}


def test_explain_names_the_crossovers(tmp_path):
    plan = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--model", "llama3-8b", "--gpus", "64", "--cluster",
                            "dgx-h100-ndr", "--engine", "torchtitan", "--precision", "fp8",
                            "--fp8-recipe", "tensorwise", "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan), "--no-sensitivity"])
    assert code == 0, err
    assert "FP8 (tensorwise, torchtitan; this plan's precision)" in out
    assert "per-GPU batch: FP8 stops paying (the blocks' matmuls) below" in out
    assert re.search(r"model size: at [\d,]+ tokens per micro-batch FP8 stops paying \(the blocks' matmuls\) below "
                     r"[\d.]+B parameters", out)
    # an A100 plan has no FP8 line
    code, _, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "8", "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan), "--no-sensitivity"])
    assert code == 0 and "FP8" not in out


def test_explain_of_an_fp8_mixture_of_experts_says_what_fp8_prices(tmp_path):
    # its attention's linears are priced FP8, its experts bf16: the crossover is not computed,
    # and the line says so without saying FP8 is unpriced
    plan = tmp_path / "moe.json"
    code, _, err = run_cli(["plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--cluster",
                            "dgx-h100-ndr", "--engine", "torchtitan", "--precision", "fp8",
                            "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan)])
    assert code == 0, err
    text = " ".join(out.split())
    assert "FP8 against bf16 (where FP8 stops paying): not computed (a mixture of experts: " \
           "FP8 prices its attention's linears only" in text
    assert "FP8: not priced" not in text
