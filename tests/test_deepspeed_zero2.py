"""DeepSpeed ZeRO-2's gradient reduction (engines.Execution.zero2_reduce): the value against
DeepSpeed's own config and code, the bytes and seconds of the bucketed all-reduce derived by
hand, and ILP == brute force with it (the solver tabulates it on the pair P = 1)."""

from __future__ import annotations

import pytest
from amsp_testlib import make_job, source_has
from hypothesis import HealthCheck, given, settings
from test_solver import check_against_brute_force, check_engine_instance, engine_instances
from test_solver import make_job as solver_job

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.schedule import unit_elements
from amsp_planner.engines import PROFILES
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy


# ----- the value against DeepSpeed's config and code ------------------------------------------
def test_stage_2_all_reduces_its_buckets_in_deepspeeds_code():
    zc = pytest.importorskip("deepspeed.runtime.zero.config")
    s12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage2 = zc.DeepSpeedZeroConfig(stage=2)
    ex = PROFILES["deepspeed"].execution
    # the defaults: reduce-scatter mode on, multi-rank bucket all-reduce on, 5e8-element buckets
    assert stage2.reduce_scatter and stage2.use_multi_rank_bucket_allreduce
    assert ex.reduce_bucket == stage2.reduce_bucket_size == 500_000_000
    assert ex.zero2_reduce == "all_reduce"
    opt = s12.DeepSpeedZeroOptimizer
    # with use_multi_rank_bucket_allreduce every slice goes to the ('allreduce', group) bucket,
    # which allreduce_and_scatter reduces in reduce_bucket_size pieces
    source_has(opt.average_tensor, 'bucket_key = ("allreduce", process_group)',
               "self.allreduce_and_scatter(", "numel_per_bucket=self.reduce_bucket_size")
    # ... each piece flattened and all-reduced (rank None: no dist.reduce to one rank)
    source_has(opt.allreduce_bucket, "self.flatten(bucket)", "dist.all_reduce(tensor_to_allreduce")
    # only its own slices copied back
    source_has(opt.allreduce_and_copy_with_multiple_ranks, "allreduce_bucket(",
               "copy_to_local_rank")
    # ZeRO-3 keeps its reduce-scatter (stage3.py), the current profile's sharded_reduce
    assert ex.sharded_reduce == "reduce_scatter"
    assert ex.source("zero2_reduce").startswith("deepspeed/runtime/zero/stage_1_and_2.py")


# ----- the rule by hand -----------------------------------------------------------------------
def test_zero2_bucket_all_reduce_bytes_seconds_and_copies_by_hand():
    # LLaMA-7B on 16 GPUs (two DGX A100 nodes), ZeRO-2 (1, 16, 16), one micro-batch. DeepSpeed
    # all-reduces each micro-batch's gradients in 5e8-element buckets: a ring all-reduce sends
    # 2 (n - 1) / n of the buffer per rank, a reduce-scatter (n - 1) / n: twice the bytes.
    # Every unit (embedding and head 1.31e8, block 2.02e8 elements) is under the bucket: each
    # is charged u / 5e8 of one all-reduce of a full bucket. On the compute stream: the bucket
    # flattened in (read + write) and this rank's 1/16 copied back (read + write): no per-rank
    # interleave in Python (that is stage 3's reduce_scatter_coalesced).
    n = 16
    s = Strategy(s_p=1, s_g=n, s_os=n)
    base = make_job(n, model=load_model("llama-7b"), batch_seqs=n)
    ds, am = evaluate(base.for_engine("deepspeed"), s), evaluate(base, s)
    (g_ds,) = [e for e in ds.schedule if e.group == "G"]
    (g_am,) = [e for e in am.schedule if e.group == "G"]
    assert (g_ds.op, g_am.op) == ("all_reduce", "reduce_scatter")
    gb = base.training.grad_bytes
    units, counts = unit_elements(base), (1, base.model.num_layers, 1)
    grads = sum(c * u for c, u in zip(counts, units, strict=True)) * gb
    assert g_ds.full_bytes_per_step == grads
    assert g_ds.bytes_per_rank_per_step == pytest.approx(2 * (n - 1) / n * grads)
    assert g_am.bytes_per_rank_per_step == pytest.approx((n - 1) / n * grads)
    bucket = 500_000_000
    full = base.topology.collective_time("all_reduce", n, 1, bucket * gb)
    assert g_ds.time_s == pytest.approx(sum(c * u / bucket * full
                                            for c, u in zip(counts, units, strict=True)))
    hbm = base.cluster.gpu.hbm_gbyte_per_s * 1e9
    assert g_ds.unit_kernel_s == pytest.approx(tuple(2 * (1 + 1 / n) * u * gb / hbm
                                                     for u in units))
    # ZeRO-3 on the same engine keeps the reduce-scatter with its per-rank host time
    (g3,) = [e for e in evaluate(base.for_engine("deepspeed"), Strategy(s_p=n, s_g=n, s_os=n))
             .schedule if e.group == "G"]
    assert g3.op == "reduce_scatter" and g3.unit_kernel_s[1] > g_ds.unit_kernel_s[1]


# ----- ILP == brute force with it -------------------------------------------------------------
@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(engine_instances)
def test_ilp_equals_brute_force_with_deepspeeds_zero2_all_reduce(p):
    check_engine_instance(p, "deepspeed")


def test_the_ilp_chooses_zero2_where_it_is_fastest_and_prices_it_as_evaluated():
    # one DGX A100 node, LLaMA-7B with two blocks, memory no limit: ZeRO-2 (no gathers) is the
    # fastest DeepSpeed stage that shards gradients; the ILP's tables carry its all-reduce
    job = solver_job("llama-7b", "dgx-a100-hdr", 8, 2, 2048, gpus_per_node=8,
                     engine="deepspeed", layers=2)
    got = check_against_brute_force(job, float("inf"), True, "time")
    assert got is not None
    from amsp_planner.solver.space import SearchSpace
    from amsp_planner.solver.tables import tables_for

    t = tables_for(job, SearchSpace.for_job(job, zeropp=True, tp=1))
    assert set(t.rs2) == {f for f in t.rs if f > 1}  # every G factor: all-reduce, not rs
    assert all(t.rs2[f][1] > t.rs[f][1] for f in t.rs2)  # twice the bytes: slower per call
