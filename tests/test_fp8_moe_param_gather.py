"""FP8 where the model or the engine changes what runs in FP8: a mixture of experts (its experts
stay bf16: the dense MLP its layers do not have is not priced) and Transformer Engine's FP8
parameter all-gather of the distributed optimizer (Megatron's --fp8-param-gather)."""

from __future__ import annotations

import pytest
from amsp_testlib import assert_user_error, run_cli

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy


def _job(model, engine, gpus=64, **training):
    t = TrainingSpec(seq_len=4096, global_batch_seqs=1024, **training)
    return Job.create(model, load_cluster("dgx-h100-ndr"), t, gpus, engine)


def test_an_all_moe_model_prices_no_dense_mlp_in_fp8():
    # every layer of Qwen3-30B-A3B is a mixture of experts: its ffn_hidden_size (the dense MLP
    # it would have) runs nowhere, so changing it moves neither precision's step
    m = load_model("qwen3-30b-a3b")
    assert m.num_moe_layers == m.num_layers
    big = m.model_copy(update={"ffn_hidden_size": 4 * m.ffn_hidden_size})
    s = Strategy.parse("ep=8,p=64,g=64,os=64,ep.p=4,ep.g=4,ep.os=4,mb=1")
    for training in ({}, {"precision": "fp8", "fp8_recipe": "tensorwise"}):
        a, b = (evaluate(_job(x, "fsdp2", **training), s).step_s for x in (m, big))
        assert a == pytest.approx(b, rel=1e-9), training


@pytest.mark.parametrize("extra,needle", [
    (["--fp8-all-gather", "on"], "--fp8-all-gather on: qwen3-30b-a3b is a mixture of experts"),
    (["-s", "ep=8,p=64,g=64,os=64,ep.p=4,ep.g=4,ep.os=4,fp8ag,mb=1"],
     "fp8ag: qwen3-30b-a3b is a mixture of experts"),
])
def test_fp8_gathers_of_a_mixture_of_experts_are_refused(tmp_path, extra, needle):
    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--cluster", "dgx-h100-ndr",
            "--engine", "fsdp2", "--precision", "fp8", "--fp8-recipe", "tensorwise",
            "-o", str(tmp_path / "p.json"), *extra]
    assert_user_error(*run_cli(argv), needle)
    assert not (tmp_path / "p.json").exists()


def _p_update(job, s):
    (e,) = [e for e in evaluate(job, s).schedule if e.group == "P_update"]
    return e


def test_te_fp8_param_gather_moves_one_byte_per_fp8_weight():
    # Megatron, Llama-3-8B, tp=2: the distributed optimizer gathers the updated parameters
    # once per step. With --fp8-all-gather on every FP8 linear's weight moves 1 byte instead of
    # 2, so the step's gathered bytes drop by the FP8 weight elements of a rank, by hand:
    # per block and TP rank, linear_qkv 4096 x (4096 + 2 x 1024) / 2, linear_proj 2048 x 4096,
    # linear_fc1 4096 x 2 x 14336 / 2, linear_fc2 7168 x 4096; 32 blocks
    m, s = load_model("llama3-8b"), Strategy.parse("tp=2,p=1,g=1,os=32,mb=2")
    per_block = 4096 * 3072 + 2048 * 4096 + 4096 * 14336 + 7168 * 4096
    fp8 = dict(precision="fp8", fp8_recipe="delayed")
    off = _p_update(_job(m, "megatron", **fp8, fp8_all_gather="off"), s)
    on = _p_update(_job(m, "megatron", **fp8, fp8_all_gather="on"), s)
    assert (off.dtype, on.dtype) == ("bf16", "fp8")
    assert off.full_bytes_per_step - on.full_bytes_per_step == 32 * per_block
    assert on.time_s < off.time_s
    # a bf16 plan, and torchao engines (whose FP8 gather is FSDP's), are unchanged
    bf16 = _p_update(_job(m, "megatron"), s)
    assert bf16.full_bytes_per_step == off.full_bytes_per_step


def test_compare_writes_the_fp8_gather_into_the_baselines_it_changes():
    # --fp8-all-gather on: a sharded baseline gathers FP8 and its strategy says so (fp8ag),
    # ZeRO++ without its qwZ; the string, given back with -s, prices the same step
    argv = ["compare", "--model", "llama3-8b", "--gpus", "64", "--cluster", "dgx-h100-ndr",
            "--precision", "fp8", "--fp8-all-gather", "on", "--json"]
    import json

    code, out, err = run_cli(argv)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    assert "fp8ag" in rows["zero3"]["strategy"] and "qwz" not in rows["zeropp"]["strategy"]
    assert "fp8ag" in rows["zeropp"]["strategy"] and "fp8ag" not in rows["zero1"]["strategy"]
    code, out, err = run_cli(argv[:-1] + ["-s", rows["zero3"]["strategy"], "--json"])
    assert code == 0, err
    given = [r for r in json.loads(out)["rows"] if r["name"] == "given"][0]
    assert given["time"]["step_s"] == rows["zero3"]["time"]["step_s"]


def test_te_weight_cache_of_a_mixture_of_experts_is_its_attention_and_local_experts():
    # Qwen3-30B-A3B under Megatron, delayed scaling: every layer is MoE (no dense MLP), so the
    # cached FP8 weights (row- and column-wise, 2 B per element) are the attention's and the
    # rank's experts' (Megatron's grouped expert linears run FP8), by hand: linear_qkv
    # 2048 x (4096 + 2 x 512), linear_proj 4096 x 2048, and 128 / ep=8 = 16 experts of
    # 3 matrices 2048 x 768; 48 layers
    from amsp_planner.cost.fp8_bytes import te_weight_cache_bytes

    s = Strategy.parse("ep=8,p=1,g=1,os=64,ep.p=1,ep.g=1,ep.os=8,mb=1")
    job = _job(load_model("qwen3-30b-a3b"), "megatron", precision="fp8", fp8_recipe="delayed")
    assert te_weight_cache_bytes(job, s) == 2 * 48 * (2048 * 5120 + 4096 * 2048
                                                      + 16 * 3 * 2048 * 768)


def test_te_weight_cache_stays_without_the_distributed_optimizer():
    # --fp8-all-gather on makes the FP8 weights the parameters only where Megatron runs
    # --fp8-param-gather, which needs the distributed optimizer (s_OS > 1)
    from amsp_planner.cost.fp8_bytes import te_weight_cache_bytes

    m, fp8 = load_model("llama3-8b"), dict(precision="fp8", fp8_recipe="delayed")
    off, on = (_job(m, "megatron", **fp8, fp8_all_gather=g) for g in ("off", "on"))
    ddp, zero1 = Strategy.parse("p=1,g=1,os=1,mb=1"), Strategy.parse("p=1,g=1,os=64,mb=1")
    assert te_weight_cache_bytes(on, ddp) == te_weight_cache_bytes(off, ddp) > 0
    assert te_weight_cache_bytes(on, zero1) == 0 < te_weight_cache_bytes(off, zero1)
