"""DeepSpeed's ZeRO-1 reduction as it executes: with ``overlap_comm`` (which the export writes)
stage 1 reduces in the backward hooks of the accumulation-boundary micro-batch, through stage
2's bucketed all-reduce, overlapped with that backward (``Execution.replicated_overlap``):
against DeepSpeed's code, by hand, and ILP == brute force with it."""

from __future__ import annotations

import dataclasses

import pytest
from amsp_testlib import make_job, source_has
from test_solver import check_against_brute_force
from test_solver import make_job as solver_job

from amsp_planner import engines
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.schedule import unit_elements
from amsp_planner.engines import PROFILES
from amsp_planner.exports.deepspeed import config_dict
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy


# ----- the value against DeepSpeed's code and the export ---------------------------------------
def test_stage_1_reduces_in_the_boundary_backward_hooks_in_deepspeeds_code():
    s12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    opt = s12.DeepSpeedZeroOptimizer
    # the hooks exist with overlap_comm (or contiguous_gradients), not only for stage 2
    source_has(opt.__init__, "self.partition_gradients or self.overlap_comm",
               "self.create_gradient_handling_hooks()")
    source_has(opt.process_gradients, "if self.partition_gradients or self.overlap_comm:",
               "self.reduce_ready_partitions_and_remove_grads(param, i)")
    # stage 1 (partition_gradients False) on the boundary micro-batch: the stage-2 path
    source_has(opt.reduce_ready_partitions_and_remove_grads,
               "self.is_gradient_accumulation_boundary()",
               "self.reduce_independent_p_g_buckets_and_remove_grads(param, i)")
    # reduce_gradients (engine.allreduce_gradients, stage 1) reduces again only without
    # overlap_comm; with it, only the pending bucket is drained
    source_has(opt.reduce_gradients, "if not self.overlap_comm:",
               "self.overlapping_partition_gradients_reduce_epilogue()")
    # off the compute stream
    source_has(opt.average_tensor, "self.reduction_stream if self.overlap_comm")


def test_the_export_writes_overlap_comm_for_stage_1_and_the_profile_records_it():
    n = 16
    job = make_job(n, model=load_model("llama-7b"), batch_seqs=n).for_engine("deepspeed")
    zero = config_dict(job, Strategy(s_p=1, s_g=1, s_os=n))["zero_optimization"]
    assert zero["stage"] == 1 and zero["overlap_comm"] is True
    ex = PROFILES["deepspeed"].execution
    assert ex.replicated_overlap is True and ex.replicated_overlaps
    assert ex.sync_overlap is False  # stage 0: engine.py buffered_allreduce_fallback after bwd
    assert "reduce_ready_partitions_and_remove_grads" in ex.source("replicated_overlap")


# ----- the rule by hand -----------------------------------------------------------------------
def _exposed_profile(monkeypatch):
    ds = PROFILES["deepspeed"]
    off = dataclasses.replace(ds, execution=dataclasses.replace(ds.execution,
                                                                replicated_overlap=False))
    monkeypatch.setitem(engines.PROFILES, "deepspeed", off)


def test_zero1_reduction_exposed_before_and_overlapped_after_by_hand(monkeypatch):
    # LLaMA-7B on 16 GPUs (two DGX A100 nodes), ZeRO-1 (1, 1, 16), one micro-batch of one
    # 2,048-token sequence per GPU. The reduction: each unit (embedding and head 1.31e8, block
    # 2.02e8 elements, all under the 5e8-element bucket) charged u / 5e8 of one all-reduce of
    # a full bucket over the 16 ranks, T in all.
    # Before (after backward, exposed): the exposed backward is T, no contention.
    # After (in the backward hooks of the boundary micro-batch): a unit's reduction runs
    # during the next unit's backward (in backward order: head, blocks, embedding). A block's
    # backward (2,048 tokens) outlasts a block's share, so it is slowed by sigma x its share;
    # the embedding computes nothing in backward, so the reduction of the block before it
    # shows whole, and the embedding's own, the last, shows whole: exposed s_B + s_E,
    # contention sigma (T - s_B - s_E), the step shorter by (1 - sigma)(T - s_B - s_E).
    n = 16
    s = Strategy(s_p=1, s_g=1, s_os=n)
    job = make_job(n, model=load_model("llama-7b"), batch_seqs=n, seq_len=2048)
    ds = job.for_engine("deepspeed")
    gb, bucket = job.training.grad_bytes, 500_000_000
    full = job.topology.collective_time("all_reduce", n, 1, bucket * gb)
    units, counts = unit_elements(job), (1, job.model.num_layers, 1)
    T = sum(c * u / bucket * full for c, u in zip(counts, units, strict=True))
    s_e, s_b = units[0] / bucket * full, units[1] / bucket * full
    sigma = job.cluster.gpu.comm_compute_slowdown
    after = evaluate(ds, s)
    (e,) = [x for x in after.schedule if x.group == "OS_shard"]
    assert e.op == "all_reduce" and e.time_s == pytest.approx(T)
    assert after.time.exposed_backward_s == pytest.approx(s_b + s_e)
    assert after.time.contention_s == pytest.approx(sigma * (T - s_b - s_e))
    _exposed_profile(monkeypatch)
    before = evaluate(job.for_engine("deepspeed"), s)
    assert before.time.exposed_backward_s == pytest.approx(T)
    assert before.time.contention_s == pytest.approx(0.0)
    assert before.step_s - after.step_s == pytest.approx((1 - sigma) * (T - s_b - s_e))


def test_ddp_on_deepspeed_stays_exposed():
    # stage 0 (no ZeRO): the engine all-reduces after backward; the new field does not reach it
    n = 16
    job = make_job(n, model=load_model("llama-7b"), batch_seqs=n, seq_len=2048)
    got = evaluate(job.for_engine("deepspeed"), Strategy())
    sync = sum(e.time_s for e in got.schedule if e.phase == "grad_sync")
    assert sync > 0 and got.time.exposed_backward_s == pytest.approx(sync)


# ----- ILP == brute force with it -------------------------------------------------------------
@pytest.mark.parametrize("model,cluster,gpus,gpn,seqs,seq_len,layers", [
    ("llama-7b", "dgx-a100-hdr", 16, 8, 1, 2048, 2),
    ("llama-7b", "eth-100g", 8, 4, 2, 2048, 3),
    ("tiny", "aws-p4d", 8, 2, 4, 512, 1),
    ("llama3-8b", "dgx-a100-hdr", 32, 8, 2, 2048, 2),
])
@pytest.mark.parametrize("limit_frac", [float("inf"), 0.6, 0.3])
def test_ilp_equals_brute_force_with_deepspeeds_overlapped_zero1(model, cluster, gpus, gpn,
                                                                  seqs, seq_len, layers,
                                                                  limit_frac):
    job = solver_job(model, cluster, gpus, seqs, seq_len, gpus_per_node=gpn,
                     engine="deepspeed", layers=layers)
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * limit_frac, True, "time")


def test_the_ilp_prices_deepspeeds_zero1_as_evaluated(monkeypatch):
    # the ILP's tables carry the overlapped ZeRO-1 reduction: solving with the memory limit at
    # ZeRO-1's own footprint on two 8-GPU nodes, whatever wins is priced as evaluate prices it
    # and is no slower than ZeRO-1; ZeRO-1's price fell with the rule (exposed -> overlapped)
    job = solver_job("llama-7b", "dgx-a100-hdr", 16, 1, 2048, gpus_per_node=8,
                     engine="deepspeed", layers=2)
    z1 = Strategy(s_p=1, s_g=1, s_os=16)
    now = evaluate(job, z1, float("inf"))
    got = check_against_brute_force(job, now.memory.total * 1.0000001, True, "time")
    assert got is not None and got.time.step_s <= now.time.step_s * (1 + 1e-6)
    _exposed_profile(monkeypatch)
    was = evaluate(job.for_engine("deepspeed"), z1, float("inf"))
    assert was.time.step_s > now.time.step_s
