"""Transformer Engine's FP8 memory (Megatron): the linears' inputs saved in FP8 and the cached
FP8 weights, by hand; torchao engines and bf16 jobs unchanged; the ILP's memory row agrees."""

from __future__ import annotations

import pytest
from amsp_testlib import run_cli

from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import memory
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import parse_strategy_or_baseline

H, F, KV, L = 4096, 14336, 1024, 32  # llama3-8b: hidden, FFN, K/V width, blocks
SEQ = 4096


def _mem(engine: str, precision: str, strategy: str = "tp=2,p=1,g=1,os=8,mb=1", **kw):
    t = TrainingSpec(seq_len=SEQ, global_batch_seqs=64, precision=precision, **kw)
    job = Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"), t, 16, engine=engine)
    return memory(job, parse_strategy_or_baseline(strategy, 16, 8))


@pytest.mark.parametrize("profile", [None, "fused"])
def test_te_saves_fp8_linear_inputs_and_caches_fp8_weights(profile):
    bf16 = _mem("megatron", "bf16", activation_profile=profile)
    fp8 = _mem("megatron", "fp8", activation_profile=profile, fp8_recipe="delayed")
    # saved inputs of linear_qkv (h), linear_proj (q = h), linear_fc1 (h), linear_fc2 (f): 1 B
    # instead of 2, per token of the micro-batch, 1/tp each (sequence parallel), every block;
    # delayed scaling adds one 4-byte scale per saved tensor
    saved = (H + H + H + F) * (2 - 1) * SEQ * L / 2 - 4 * 4 * L / 2
    assert bf16.activations - fp8.activations == pytest.approx(saved)
    # the cached FP8 weights: row-wise + column-wise, 2 B per element of the FP8 linears' 1/tp
    # shards: linear_qkv h x (h + 2 kv), linear_proj h x h, linear_fc1 h x 2f, linear_fc2 f x h
    cache = 2 * (H * (H + 2 * KV) + H * H + H * 2 * F + F * H) / 2 * L
    assert fp8.fp8_weight_cache == cache and bf16.fp8_weight_cache == 0
    assert fp8.to_dict()["fp8_weight_cache"] == cache and "fp8_weight_cache" not in bf16.to_dict()
    frag = load_cluster("dgx-h100-ndr").gpu.fragmentation_fraction
    assert fp8.total - bf16.total == pytest.approx((cache - saved) * (1 + frag))


def test_fp8_primary_weights_add_no_cache():
    """--fp8-all-gather on (Megatron's --fp8-param-gather): the FP8 parameter and its transpose
    take the 2 bytes the bf16 parameter took."""
    m = _mem("megatron", "fp8", fp8_recipe="tensorwise", fp8_all_gather="on")
    assert m.fp8_weight_cache == 0


def test_torchao_keeps_bf16_inputs_and_no_weight_copy():
    bf16 = _mem("torchtitan", "bf16", strategy="zero3,mb=1")
    fp8 = _mem("torchtitan", "fp8", strategy="zero3,mb=1", fp8_recipe="rowwise")
    assert fp8.activations == bf16.activations and fp8.fp8_weight_cache == 0


def test_plan_prices_the_cache_in_the_ilp(tmp_path):
    """amsp plan on Megatron with FP8: the solver's memory row and the cost model agree (solve
    asserts it) and the plan's memory carries the cache."""
    import json

    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--model", "llama3-8b", "--gpus", "16", "--engine",
                            "megatron", "--precision", "fp8", "--fp8-recipe", "delayed",
                            "--cluster", "dgx-h100-ndr", "--output", str(out)])
    assert code == 0, err
    plan = json.loads(out.read_text())
    mem, tp = plan["predictions"]["memory"], plan["decision"]["tp"]
    assert mem["fp8_weight_cache"] == 2 * (H * (H + 2 * KV) + H * H + H * 2 * F + F * H) * L / tp
