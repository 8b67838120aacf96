"""Profiles of past engine releases (amsp_planner/engine_versions.py): their values against the
release's code, the rule they change priced by hand, ILP == brute force with them, and the
validation rows that name the release they ran."""

from __future__ import annotations

import dataclasses

import pytest
from amsp_testlib import make_job
from hypothesis import HealthCheck, given, settings
from test_solver import check_engine_instance, engine_instances

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.schedule import unit_elements
from amsp_planner.engines import ENGINES, PROFILES, VERSIONED, Execution
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy
from amsp_planner.validation import check_rows, pricing_engine

OLD = "deepspeed@0.3.14"


# ----- the values against their sources -------------------------------------------------------
def test_versioned_profiles_are_priced_only_for_published_runs():
    # the others: tests/test_nemo_rows.py, tests/test_bridge_rows.py, tests/test_dgxc_rows.py
    assert VERSIONED == (OLD, "nemo@24.07", *(f"megatron-bridge@{v}" for v in (
        "0.2.0", "0.3.0", "0.3.1", "0.4.0", "0.4.1", "0.5.0")), "torchtitan@0.1.0",
        "fsdp@1.13.1", "fsdp@2.0.0", "nemo@24.03.01", "nemo@24.12")
    from amsp_planner.validation import load_rows

    named = {f"{r['engine']}@{r['engine_version']}" for r in load_rows()["rows"]
             if r.get("engine_version") and r.get("scope") == "in"}
    assert named == set(VERSIONED)  # each priced row's release has its profile, and back
    assert not set(VERSIONED) & set(ENGINES)  # never a choice of --engine: the planner prices the current one
    old, new = PROFILES[OLD], PROFILES["deepspeed"]
    assert old.engine == new.engine == "deepspeed" and old.name == OLD
    assert old.title == "DeepSpeed 0.3.14"
    # ZeRO++ (2023) and the 2022 coalesced reduce-scatter did not exist; fp16 gradients were
    # reduced in the parameters' dtype (engine.py refuses fp32_allreduce with ZeRO)
    assert not (old.hpz or old.qwz or old.qgz) and old.reduce_dtype == "param"
    assert old.execution.reduce_host_us == 0.0 and new.execution.reduce_host_us > 0
    # stage 3 only: (N, N, N)
    assert old.triples(64, 8, None) == ((64, 64, 64),)


def test_v0_3_14_values_are_that_releases_defaults():
    # deepspeed/runtime/zero/constants.py at v0.3.14 (0cd9abf2): prefetch bucket 5e7,
    # persistence 1e5, max live 1e9, reduce bucket 5e8; stage 3's contiguous_gradients False,
    # so reduce_ipg_grads all-reduces each flattened bucket (buffered_reduce_fallback)
    ex = PROFILES[OLD].execution
    assert (ex.prefetch_bucket, ex.persistence_threshold, ex.max_live_params,
            ex.reduce_bucket) == (50_000_000, 100_000, 1_000_000_000, 500_000_000)
    assert ex.gather_grouping == "parameter" and ex.sharded_reduce == "all_reduce"
    assert PROFILES["deepspeed"].execution.sharded_reduce == "reduce_scatter"
    base = Execution()
    for f in dataclasses.fields(Execution):
        if f.name != "sources" and getattr(ex, f.name) != getattr(base, f.name):
            assert "v0.3.14" in ex.source(f.name), f.name


def test_the_values_the_current_release_shares_are_still_its_defaults():
    # the four sizes did not change between v0.3.14 and the installed release; stage 3's
    # contiguous_gradients did (False then, True now: now reduce-scattered)
    zc = pytest.importorskip("deepspeed.runtime.zero.config")
    ex, now = PROFILES[OLD].execution, zc.DeepSpeedZeroConfig(stage=3)
    assert (ex.prefetch_bucket, ex.persistence_threshold, ex.max_live_params,
            ex.reduce_bucket) == (now.prefetch_bucket_size, now.param_persistence_threshold,
                                  now.max_live_parameters, now.reduce_bucket_size)
    assert now.contiguous_gradients is True


# ----- the changed rule, by hand --------------------------------------------------------------
def test_zero3_gradients_all_reduced_in_buckets_with_two_copies():
    # LLaMA-7B on 16 GPUs (2 nodes), ZeRO-3, one micro-batch. v0.3.14 all-reduces each
    # micro-batch's gradients: twice a reduce-scatter's bytes per rank. Every unit (block
    # 2.02e8, embedding and head 1.31e8) is under the 5e8-element bucket: each is charged
    # u / 5e8 of one all-reduce of a full bucket. On the compute stream: the bucket flattened
    # in and copied back (2 x read + write of the unit's gradient), no per-rank host time.
    n = 16
    s = Strategy(s_p=n, s_g=n, s_os=n)
    base = make_job(n, model=load_model("llama-7b"), batch_seqs=n)
    old = evaluate(base.for_engine(OLD), s)
    new = evaluate(base.for_engine("deepspeed"), s)
    (g_old,) = [e for e in old.schedule if e.group == "G"]
    (g_new,) = [e for e in new.schedule if e.group == "G"]
    assert (g_old.op, g_new.op) == ("all_reduce", "reduce_scatter")
    assert g_old.bytes_per_rank_per_step == pytest.approx(2 * g_new.bytes_per_rank_per_step)
    topo, gb, bucket = base.topology, base.training.grad_bytes, 500_000_000
    units = unit_elements(base)
    counts = (1, base.model.num_layers, 1)
    full = topo.collective_time("all_reduce", n, 1, bucket * gb)
    assert g_old.time_s == pytest.approx(sum(c * u / bucket * full
                                             for c, u in zip(counts, units, strict=True)))
    hbm = base.cluster.gpu.hbm_gbyte_per_s * 1e9
    assert g_old.unit_kernel_s == pytest.approx(tuple(4 * u * gb / hbm for u in units))


def test_gathers_of_one_prefetch_batch_wait_for_each_other(monkeypatch):
    # v0.3.14 gathers parameter by parameter, each after torch.cuda.synchronize(); a prefetch
    # takes the next parameters until they reach 5e7 elements. LLaMA-7B block: norms kept
    # whole (4096 < 1e5); q, k, v, o 16.8M each, gate, up, down 45.1M each: seven calls (the
    # current release coalesces them into five). Batches: [q, k, v] (50.3M), [o, gate]
    # (61.9M), [up, down] (90.2M): q, k, o and up wait with nothing computing, v, gate and
    # down are prefetched. With a bucket of one element each call is its own batch. (The
    # batching rule prices where the prefetch overlaps, prefetch_overlap on, set here as a
    # run's setting: the profile waits for every gather, measured at scale.)
    from amsp_planner import engines
    from amsp_planner.cost.schedule import call_groups, on_demand

    n = 16
    on = (("prefetch_overlap", True),)
    job = make_job(n, model=load_model("llama-7b"), seq_len=2048,
                   batch_seqs=4 * n).for_engine(OLD)
    job = dataclasses.replace(job, settings=on)
    u = unit_elements(job)[1]
    scale = u / job.model.block_params()
    a, f = 4096 * 4096, 4096 * 11008
    assert [x for _, x in call_groups(job, "gather", 1, u)] == pytest.approx(
        [w * scale / u for w in (a, a, a, a, f, f, f)])
    assert len(call_groups(job.for_engine("deepspeed"), "gather", 1, u)) == 5
    assert on_demand(job, 1, u) == (True, True, False, True, False, True, False)
    s = Strategy(s_p=n, s_g=n, s_os=n)
    before = evaluate(job, s)
    one = dataclasses.replace(PROFILES[OLD], execution=dataclasses.replace(
        PROFILES[OLD].execution, prefetch_bucket=1))
    monkeypatch.setitem(engines.PROFILES, OLD, one)
    after = evaluate(dataclasses.replace(job.for_engine("amsp").for_engine(OLD), settings=on), s)
    ga = {(e.phase, e.group): e for e in before.schedule}[("forward", "P")]
    gb = {(e.phase, e.group): e for e in after.schedule}[("forward", "P")]
    topo, pb = job.topology, job.training.param_bytes
    late = sum(topo.collective_time("all_gather", n, 1, x * scale * pb) for x in (a, a, a, f))
    assert ga.unit_kernel_s[1] - gb.unit_kernel_s[1] == pytest.approx(late, rel=1e-6)
    assert gb.unit_time_s[1] - ga.unit_time_s[1] == pytest.approx(late, rel=1e-6)
    assert before.step_s > after.step_s  # compute-bound: the waits add to the step


# ----- ILP == brute force with the old release's profile --------------------------------------
@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(engine_instances)
def test_ilp_equals_brute_force_with_the_v0_3_14_profile(p):
    check_engine_instance(p, OLD)


# ----- validation rows naming their release ---------------------------------------------------
def test_a_row_is_priced_with_the_release_it_names():
    assert pricing_engine("deepspeed", "0.3.14") == (OLD, "")
    assert pricing_engine("deepspeed") == ("deepspeed", "")
    engine, why = pricing_engine("deepspeed", "0.5.0")
    assert engine == "deepspeed" and "0.5.0 has no profile" in why
    doc = {"sources": {"s": "x"}, "rows": [{"id": "r", "source": "s", "engine": "deepspeed",
                                            "gpus": 8, "metric": "tps_per_gpu", "value": 1,
                                            "scope": "x", "engine_version": 0.3}]}
    with pytest.raises(ValueError, match="engine_version"):
        check_rows(doc)


def test_v0_3_14_pays_its_host_time_per_rank_and_gathered_parameter_by_hand():
    # _allgather_param: a Python loop over the ranks and one copy per rank for every gathered
    # parameter. A GPT-3 175B block gathers q, k, v, o, fc1 and fc2 (weights; its biases and
    # norms are under the 1e5 persistence threshold and kept whole): 6 calls, so each block's
    # forward gather adds 6 x n x gather_host_us to its compute on n ranks
    from amsp_planner.engine_versions import GATHER_HOST_US_0_3_14

    n = 64
    job = make_job(n, model=load_model("gpt3-175b"), seq_len=2048, batch_seqs=n).for_engine(OLD)
    s = Strategy(s_p=n, s_g=n, s_os=n)
    with_host = {(e.phase, e.group): e for e in evaluate(job, s).schedule}[("forward", "P")]
    plain = dataclasses.replace(job, settings=(("gather_host_us", 0.0),))
    without = {(e.phase, e.group): e for e in evaluate(plain, s).schedule}[("forward", "P")]
    want = 6 * n * GATHER_HOST_US_0_3_14 * 1e-6
    assert with_host.unit_kernel_s[1] - without.unit_kernel_s[1] == pytest.approx(want, rel=1e-9)
    assert with_host.time_s == pytest.approx(without.time_s)  # the bytes' seconds unchanged
