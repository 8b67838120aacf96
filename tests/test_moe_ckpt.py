"""``ckpt=moe``: each MoE layer recomputes only its MoE MLP part (router, dispatch, experts,
combine) in backward, the attention part's activations and the MLP's input kept (docs/moe.md;
Megatron-Core's ``--recompute-modules moe``)."""

from __future__ import annotations

import pytest
from test_moe_solver import moe_job, tiny_moe

from amsp_planner.cost.activations import phase_bytes, saved_bytes
from amsp_planner.cost.compute import block_compute, recompute_s
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.moe_schedule import a2a_entries
from amsp_planner.errors import AmspUserError, InfeasibleError
from amsp_planner.strategy import Strategy

GIB = 1024**3
S = 512  # tokens per sequence (moe_job's default)


def test_token_parses_and_prints():
    s = Strategy.parse("ep=2,p=2,g=2,os=2,ep.p=1,ep.g=1,ep.os=1,mb=1,ckpt=moe")
    assert s.ckpt_value == "moe" and s.ckpt_moe and not s.ckpt and not s.ckpt_op
    assert str(s).endswith("ckpt=moe")
    assert Strategy.parse(str(s)) == s
    assert s.with_(ckpt=True, ckpt_moe=False).ckpt_value is True


def test_activation_bytes_by_hand():
    # 4 MoE layers, h = 256, E = 4 experts of width 128, top-2, bf16, eager. One MoE layer's
    # MLP part saves per token: the router's fp32 probabilities 4 E = 16 bytes, and per routed
    # copy the permuted input (256), the SwiGLU's 4 f_e (512) and the expert output (256)
    # elements, 1024 x 2 bytes = 2048, twice (k = 2): 4112 bytes. ckpt=moe drops all four
    # layers' and saves one again while it is recomputed: 3 x 4112 per token fewer.
    job = moe_job(tiny_moe(layers=4), "dgx-h100-ndr", 2, 2, activation_profile="eager")
    none, moe = saved_bytes(job, 1, False), saved_bytes(job, 1, "moe")
    assert none - moe == 3 * 4112 * S
    assert phase_bytes(job, 1, "moe")[1] == 4112 * S
    assert phase_bytes(job, 1, False)[1] == 0
    # more than full checkpointing keeps (the attention parts stay)
    assert moe > saved_bytes(job, 1, True)


def test_activation_bytes_with_a_dense_layer_and_a_shared_expert():
    # layer 0 dense (kept whole), layers 1-2 MoE; shared expert of width 256: 4 x 256 x 2 =
    # 2048 more bytes per token in each MoE layer's MLP part: 4112 + 2048 = 6160, one layer's
    # worth dropped (2 MoE layers, one recomputed at a time)
    job = moe_job(tiny_moe(layers=3, shared=256, dense=(0,)), "dgx-h100-ndr", 2, 2,
                  activation_profile="eager")
    assert saved_bytes(job, 1, False) - saved_bytes(job, 1, "moe") == 6160 * S
    assert phase_bytes(job, 1, "moe")[1] == 6160 * S


def test_recompute_all_to_alls_two_per_moe_layer():
    # e = 2 on 2 GPUs, 2 sequences per GPU at mb = 1: 2 micro-batches; layer 0 dense, 2 MoE
    # layers: 2 calls x 2 layers x 2 micro-batches in recompute, each b s h k x 2 bytes
    # = 512 x 256 x 2 x 2 = 524,288 bytes, the same entry as full checkpointing's
    job = moe_job(tiny_moe(layers=3, dense=(0,)), "dgx-h100-ndr", 2, 2, seqs_per_gpu=2)
    base = "ep=2,p=2,g=2,os=2,ep.p=1,ep.g=1,ep.os=1,mb=1"

    def rec(ck):
        s = Strategy.parse(base + ck)
        return [e for e in a2a_entries(job, s, 2) if e.phase == "recompute"]

    (moe,) = rec(",ckpt=moe")
    assert (moe.calls_per_step, moe.full_bytes_per_step) == (8, 8 * 524_288)
    assert rec(",ckpt=moe") == rec(",ckpt")
    assert rec("") == [] and len(rec(",ckpt=1")) == 0  # block 0 is the dense layer


def test_recompute_time_is_the_moe_mlps_forward():
    # every layer MoE: what ckpt=moe does not recompute (forward less its recompute) is the
    # attention part, the same for any expert shape; less than full checkpointing's
    def attention_part(fe, k):
        job = moe_job(tiny_moe(layers=2, k=k, fe=fe), "dgx-h100-ndr", 2, 2)
        plain, moe = block_compute(job, 1, False), block_compute(job, 1, "moe")
        rec = moe.backward - plain.backward
        assert 0 < rec < block_compute(job, 1, True).backward - plain.backward
        assert 0 < recompute_s(job, 1, "moe") < recompute_s(job, 1, True)
        return plain.forward - rec

    a = attention_part(128, 2)
    assert a > 0
    for fe, k in ((512, 2), (128, 1), (1024, 1)):
        assert attention_part(fe, k) == pytest.approx(a, rel=1e-9)


def test_dense_model_refuses_it():
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import load_cluster, load_model
    from amsp_planner.specs.training import TrainingSpec

    job = Job.create(load_model("llama-7b"), load_cluster("dgx-h100-ndr"),
                     TrainingSpec(seq_len=4096), 8)
    with pytest.raises(AmspUserError, match="ckpt=moe"):
        evaluate(job, Strategy.parse("p=8,g=8,os=8,mb=1,ckpt=moe"), float("inf"))


def test_ckpt_moe_is_the_optimum_for_qwen3_30b_a3b_at_45_gib():
    # Qwen3-30B-A3B on 64 A100s (8 per node), 45 GiB per GPU: without checkpointing nothing
    # fits; recomputing only the MoE MLPs fits and is faster than every full or partial
    # block checkpointing, and the brute force over the same space agrees
    from amsp_planner.cost.job import Job
    from amsp_planner.solver import solve
    from amsp_planner.specs import load_cluster, load_model
    from amsp_planner.specs.training import TrainingSpec

    job = Job.create(load_model("qwen3-30b-a3b"), load_cluster("dgx-a100-hdr"),
                     TrainingSpec(seq_len=4096), 64)
    limit = 45 * GIB
    best = solve(job, limit).best
    assert best.strategy.ckpt_value == "moe" and best.fits
    assert not evaluate(job, best.strategy.with_(ckpt_moe=False), limit).fits
    full = evaluate(job, best.strategy.with_(ckpt_moe=False, ckpt=True), limit)
    assert full.fits and best.step_s < full.step_s
    with pytest.raises(InfeasibleError, match="nothing fits"):  # none without checkpointing
        solve(job, limit, ckpt=False)


def test_megatron_export_and_the_plan_version():
    # Megatron-Core runs it as --recompute-granularity selective --recompute-modules moe; a
    # plan holding it is version 4, and reads back
    from amsp_planner.cost.job import Job
    from amsp_planner.exports import export, megatron
    from amsp_planner.plan_decision import plan_version
    from amsp_planner.specs import load_cluster, load_model
    from amsp_planner.specs.training import TrainingSpec

    job = Job.create(load_model("qwen3-30b-a3b"), load_cluster("dgx-h100-ndr"),
                     TrainingSpec(seq_len=4096, global_batch_seqs=512), 16)
    s = Strategy.parse("ep=8,p=1,g=1,os=16,ep.p=1,ep.g=1,ep.os=2,mb=4,ckpt=moe")
    r = export("megatron", job.for_engine("megatron"), s)
    assert r.exact and "--recompute-modules moe" in r.text
    got = megatron.check(r.text, 16, 512)
    assert (got["recompute_layers"], got["recompute_modules"]) == (0, "moe")
    assert plan_version({"ckpt": "moe"}) == 4 and plan_version({"ckpt": 3}) == 2
    assert job.profile.runs_ckpt("moe", 48) and not job.for_engine("deepspeed").profile.runs_ckpt(
        "moe", 48)
