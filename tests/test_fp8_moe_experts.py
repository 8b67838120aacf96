"""FP8 experts of a mixture of experts: Megatron-Core runs its grouped expert linears and shared
experts in FP8 under --fp8 (Transformer Engine), so an FP8 Megatron MoE job prices them in FP8
with their casts and caches their FP8 weights; torchao engines keep them bf16 (their Float8
conversion swaps nn.Linear only). cost/moe_compute.py, cost/fp8_bytes.py ``fp8_experts``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_moe_solver import tiny_moe
from test_solver import check_against_brute_force

from amsp_planner.cost.compute import _rates
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.fp8_bytes import te_weight_cache_bytes
from amsp_planner.cost.job import Job
from amsp_planner.cost.moe_compute import moe_layer_mlp_s
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

GPUS = 64


def _job(model, engine, precision, gpus=GPUS, cluster="dgx-h100-ndr", **extra):
    t = TrainingSpec(seq_len=4096, global_batch_seqs=gpus * 4, precision=precision, **extra)
    m = load_model(model) if isinstance(model, str) else model
    return Job.create(m, load_cluster(cluster), t, gpus, engine)


def _experts_s(job, tokens, ep):
    """One MoE layer's MLP-part matmul seconds (its router's part is bf16 in both precisions,
    on every engine)."""
    return moe_layer_mlp_s(job, _rates(job), tokens, ep)


def test_megatron_runs_large_experts_in_fp8_at_most_the_fp8_peak_ratio_faster():
    # Mixtral's experts (4096 x 14336) at ep=8: 8,192 rows per expert per micro-batch of 4,096
    # tokens, compute-bound. The H100's FP8 dense peak is 2x its bf16 peak (1,979 against 989
    # TFLOP/s, NVIDIA's data sheet): the experts get faster by well over half of that and by
    # less than all of it (the casts and the GEMMs' lower FP8 efficiency take their share)
    bf16, fp8 = (_job("mixtral-8x7b", "megatron", p) for p in ("bf16", "fp8"))
    ratio = _experts_s(bf16, 4096, 8) / _experts_s(fp8, 4096, 8)
    assert 1.5 < ratio < 2.0
    # the step follows: the experts are most of Mixtral's FLOPs
    s = Strategy.parse("ep=8,p=1,g=1,os=64,ep.p=1,ep.g=1,ep.os=8,mb=1")
    gain = evaluate(bf16, s).time.compute_s / evaluate(fp8, s).time.compute_s
    assert gain > 1.3


@pytest.mark.parametrize("engine", ["torchtitan", "fsdp2"])
def test_torchao_engines_keep_the_experts_in_bf16(engine):
    bf16, fp8 = (_job("mixtral-8x7b", engine, p) for p in ("bf16", "fp8"))
    assert _experts_s(fp8, 4096, 8) == pytest.approx(_experts_s(bf16, 4096, 8))
    assert te_weight_cache_bytes(fp8, Strategy.parse("ep=8,p=1,g=1,os=64,ep.p=1,ep.g=1,"
                                                     "ep.os=8,mb=1")) == 0


def test_megatron_caches_the_fp8_weights_of_its_local_experts():
    # Transformer Engine keeps each FP8 weight and its transpose for the step (2 bytes per
    # element, delayed scaling, no block scales). Qwen3-30B-A3B: 48 MoE layers of 128 experts
    # of 3 matrices 2048 x 768; a rank holds E/ep experts, so ep=8 caches 112 experts fewer per
    # layer than ep=1, the attention's cache unchanged
    job = _job("qwen3-30b-a3b", "megatron", "fp8")
    one, eight = (te_weight_cache_bytes(job, Strategy.parse(
        f"ep={e},p=1,g=1,os=64,ep.p=1,ep.g=1,ep.os={64 // e},mb=1")) for e in (1, 8))
    assert one - eight == 2 * 48 * (128 - 16) * 3 * 2048 * 768
    # bf16: no cache at all
    assert te_weight_cache_bytes(_job("qwen3-30b-a3b", "megatron", "bf16"),
                                 Strategy.parse("p=1,g=1,os=64,mb=1")) == 0


def test_the_notes_say_megatron_prices_the_experts_in_fp8():
    from amsp_planner.cost.fp8_notes import priced_note

    assert "shared and routed experts' matmuls" in priced_note("megatron", moe=True)
    assert "experts' grouped GEMMs and gathers stay bf16" in priced_note("torchtitan", moe=True)


instances = st.fixed_dictionaries({
    "experts": st.sampled_from([2, 4, 8]),
    "shared": st.sampled_from([0, 256]),
    "per_node": st.sampled_from([2, 4]),
    "nodes": st.sampled_from([1, 2]),
    "limit_frac": st.floats(min_value=0.05, max_value=1.2),
    "objective": st.sampled_from(["time", "comm"]),
})


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_ilp_equals_brute_force_with_fp8_experts(p):
    # the expert FP8 cache depends on the expert-parallel degree (E/ep experts per rank): the
    # ILP's fixed memory per space must price it as the brute force's evaluation does
    gpus = p["per_node"] * p["nodes"]
    c = load_cluster("dgx-h100-ndr", {"gpus_per_node": p["per_node"]})
    t = TrainingSpec(seq_len=512, global_batch_seqs=gpus, precision="fp8")
    job = Job.create(tiny_moe(1, p["experts"], shared=p["shared"]), c, t, gpus, "megatron")
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * p["limit_frac"], False, p["objective"], None)
