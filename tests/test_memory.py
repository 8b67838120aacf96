"""Memory terms of issue 11, by hand: the eager activation profile, the loss peak, and the NCCL
communicators of the groups a strategy uses (the saved-tensor measurements are in
test_saved_tensors.py)."""

from __future__ import annotations

import pytest
from amsp_testlib import make_job, run_cli

from amsp_planner.cost.activations import (
    block_bytes_per_token,
    loss_peak_bytes,
    rope_table_bytes,
    saved_bytes_per_token,
)
from amsp_planner.cost.communicators import (
    A2A_NET_BYTES,
    A2A_NVLINK_PEER_BYTES,
    COMMUNICATOR_BYTES,
    communicator_bytes,
    used_kinds,
)
from amsp_planner.cost.memory import memory
from amsp_planner.cost.schedule import build_schedule
from amsp_planner.solver.space import SearchSpace
from amsp_planner.strategy import Strategy, baseline


def test_eager_activation_bytes_by_hand():
    job = make_job(8)
    # small_model: h = 128, d_kv = 128 (4 heads of 32), f = 256, a = 4, V = 512, bf16 (2 B).
    # RMSNorm: fp32 input copy 4h = 512, fp32 1/rms 4, normalized + weighted 2 x 128 x 2 = 512
    #   -> 1,028, twice per block = 2,056
    # attention: QKV output (128 + 256) x 2 = 768, rotated Q, K (128 + 128) x 2 = 512,
    #   output and head-merged copy 2 x 128 x 2 = 512, log-sum-exp 4 x 4 = 16 -> 1,808
    # SwiGLU: gate/up 2f, SiLU f, product f = 4 x 256 x 2 = 2,048
    assert block_bytes_per_token(job) == 2_056 + 1_808 + 2_048 == 5_912
    # head: final norm 1,028 + fp32 log-probabilities 4 x 512 + int64 targets and tokens 16
    head = 1_028 + 2_048 + 16
    assert saved_bytes_per_token(job, ckpt=False) == 2 * 5_912 + head
    # checkpointing: the two block inputs (128 x 2 each), one block recomputed, the head
    assert saved_bytes_per_token(job, ckpt=True) == 2 * 256 + 5_912 + head
    # RoPE cos + sin: seq 128 x head_dim 32 x 2 B per micro-batch; loss peak 8V per token
    assert rope_table_bytes(job) == 128 * 32 * 2
    assert loss_peak_bytes(job, 2) == 8 * 512 * 2 * 128


def test_eager_counts_more_than_fused_and_the_loss_peak_only_in_eager():
    eager, fused = make_job(8), make_job(8, activation_profile="fused")
    s = Strategy(micro_batch=2)
    me, mf = memory(eager, s), memory(fused, s)
    assert me.activations > mf.activations
    assert me.loss_peak > 0 == mf.loss_peak
    assert me.total - mf.total == pytest.approx(
        (me.activations + me.loss_peak - mf.activations) * 1.05)


def test_used_group_kinds_are_the_schedule_groups():
    job = make_job(64)
    space = SearchSpace.for_job(job)
    for s in space.candidates(job):
        sched = {e.group: (e.group_size, e.stride) for e in build_schedule(job, s, n_micro=1)}
        assert used_kinds(s, 64, 8) == sched, s


@pytest.mark.parametrize("name,kinds,count", [
    # ZeRO-3: P, G and world are the same 64 ranks: one communicator
    ("zero3", {"P", "G", "world"}, 1),
    # DDP: the replica all-reduce runs on the world group
    ("ddp", {"OS_replica", "world"}, 1),
    # ZeRO-1 over all 64: the same
    ("zero1", {"OS_shard", "P_update", "world"}, 1),
    # ZeRO++: P = world (64, 1); hpZ and qgZ's first hop are the node (8, 1); the second hop
    # (8 nodes, stride 8): three communicators
    ("zeropp", {"P", "hpZ", "G_intra", "G_inter", "world"}, 3),
])
def test_communicators_by_hand(name, kinds, count):
    job = make_job(64)
    s = baseline(name, 64, 8)
    assert set(used_kinds(s, 64, 8)) == kinds
    a2a = 7 * A2A_NVLINK_PEER_BYTES + A2A_NET_BYTES if s.qgz else 0
    assert communicator_bytes(job, s) == count * COMMUNICATOR_BYTES + a2a


def test_amsp_point_has_three_communicators_and_gloo_none():
    # p=1, g=1, os=8 on 64: OS_shard and P_update are both the node (8, 1); OS_replica (8, 8);
    # world (64, 1)
    s = Strategy(s_os=8)
    assert communicator_bytes(make_job(64), s) == 3 * COMMUNICATOR_BYTES
    assert communicator_bytes(make_job(4, cluster="cpu-local"), Strategy(s_os=4)) == 0
    assert communicator_bytes(make_job(1), Strategy()) == 0  # one GPU: no group at all


def test_activation_profile_option(tmp_path):
    code, out_e, _ = run_cli(["compare", "-m", "llama-7b", "-n", "64", "--json"])
    code_f, out_f, _ = run_cli(["compare", "-m", "llama-7b", "-n", "64", "--json",
                                "--activation-profile", "fused"])
    assert code == code_f == 0
    assert out_e != out_f
    code, _, err = run_cli(["compare", "-m", "llama-7b", "-n", "64",
                            "--activation-profile", "jitted"])
    assert code == 2 and "activation-profile" in err


def test_deepspeed_buffers_are_the_counted_ones():
    pytest.importorskip("deepspeed")
    import json

    from amsp_planner.exports import deepspeed as ds
    from amsp_planner.specs import load_model

    job = make_job(64, model=load_model("llama-7b"), seq_len=2048)
    # LLaMA-7B block: 4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096 = 202,383,360 elements, padded
    # to a multiple of 64 x 256 = 16,384: 12,353 x 16,384 = 202,391,552 = U (the largest unit;
    # the 32,000 x 4,096 embedding is 131,072,000)
    u = 202_391_552
    s = baseline("zero3", 64, 8)
    cfg = json.loads(ds.export(job, s).text)
    zero = cfg["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_max_live_parameters"], zero["stage3_param_persistence_threshold"]) == (
        u, u, 2 * u, 0)
    # DeepSpeed's own classes read them back
    assert ds.parse_with_deepspeed(cfg, 64)["buffers"] == {
        "reduce_bucket_size": u, "stage3_prefetch_bucket_size": u,
        "stage3_max_live_parameters": 2 * u, "stage3_param_persistence_threshold": 0}
    # and they are the memory model's buffers: two gathered units, two gradient buckets (bf16)
    m = memory(job, s)
    assert m.gather_buffers == zero["stage3_max_live_parameters"] * 2
    assert m.grad_buffers == 2 * zero["reduce_bucket_size"] * 2
    z2 = json.loads(ds.export(job, baseline("zero2", 64, 8)).text)["zero_optimization"]
    assert z2["allgather_bucket_size"] == z2["reduce_bucket_size"] == u
    assert "stage3_max_live_parameters" not in z2
