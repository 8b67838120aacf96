"""Engine execution profiles (engines.Execution): each value against its source, and each rule
of how the step model prices a plan as the engine executes it, derived by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
from amsp_testlib import make_job

from amsp_planner import engines
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.cost.schedule import call_groups
from amsp_planner.cost.unit_tensors import unit_tensors
from amsp_planner.engines import ENGINES, PROFILES, Execution
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy


# ----- the values against their sources -------------------------------------------------------
def test_deepspeed_values_are_its_own_config_defaults():
    zc = pytest.importorskip("deepspeed.runtime.zero.config")
    ex = PROFILES["deepspeed"].execution
    stage1 = zc.DeepSpeedZeroConfig(stage=1)
    stage3 = zc.DeepSpeedZeroConfig(stage=3)
    assert ex.reduce_bucket == stage1.reduce_bucket_size
    assert ex.update_bucket == stage1.allgather_bucket_size
    assert ex.prefetch_bucket == stage3.prefetch_bucket_size
    assert ex.persistence_threshold == stage3.param_persistence_threshold
    assert ex.max_live_params == stage3.max_live_parameters
    assert ex.max_reuse_distance == stage3.max_reuse_distance
    # stages 1-2 all-reduce the bucket (multi-rank bucket all-reduce), on the current stream
    assert stage1.use_multi_rank_bucket_allreduce and ex.replicated_reduce == "all_reduce"
    # overlap_comm defaults off for stages 1-2, but the export writes it on: ZeRO-1's
    # reduction runs in the boundary micro-batch's hooks (tests/test_deepspeed_zero1.py);
    # stage 0 all-reduces after backward (engine.py buffered_allreduce_fallback)
    assert stage1.overlap_comm is False and ex.replicated_overlap is True
    assert ex.sync_overlap is False
    assert stage3.overlap_comm is True  # stage 3 overlaps: no once-per-step sync exists there


def test_fsdp2_reduces_on_its_own_streams():
    pytest.importorskip("torch")
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    src = open(pg.__file__).read()
    assert "reduce_scatter_stream" in src and "all_gather_stream" in src
    for name in ("fsdp2", "torchtitan"):
        ex = PROFILES[name].execution
        assert ex.gather_grouping == "unit" and ex.sync_overlap and ex.reduce_bucket is None


def test_megatron_bucket_is_its_documented_default():
    # distributed_data_parallel_config.py: bucket_size default max(40000000, 1000000 * dp_size)
    ex = PROFILES["megatron"].execution
    assert ex.reduce_elements(8) == 40_000_000
    assert ex.reduce_elements(1024) == 1_024_000_000
    assert ex.sync_overlap is False and ex.update_overlap is False  # both opt-in flags
    assert PROFILES["megatron"].reduce_dtype == "fp32"  # bf16 forces fp32 accumulation
    assert PROFILES["megatron"].triples(64, 8, None) == tuple((1, 1, s) for s in
                                                              (1, 2, 4, 8, 16, 32, 64))


def test_internevo_values_are_its_config_defaults():
    ex = PROFILES["internevo"].execution
    assert ex.reduce_bucket == 512 * 1024 * 1024  # hybrid_zero_optimizer.reduce_bucket_size
    assert ex.sync_overlap and not ex.update_overlap  # overlap_sync_grad, overlap_sync_param
    assert ex.replicated_reduce == "all_reduce"  # reduce_tensor(dst_rank=None)


def test_every_value_that_is_not_the_default_has_a_source():
    base = Execution()
    for name in ENGINES:
        ex = PROFILES[name].execution
        for f in dataclasses.fields(Execution):
            if f.name != "sources" and getattr(ex, f.name) != getattr(base, f.name):
                assert ex.source(f.name), (name, f.name)
        assert all(src for _, src in ex.sources)


# ----- the rules, by hand ---------------------------------------------------------------------
def test_unit_tensors_sum_to_the_units():
    for name in ("llama-7b", "llama3-8b", "gpt3-175b"):
        m = load_model(name)
        emb, block, head = unit_tensors(m)
        assert (sum(emb), sum(block), sum(head)) == (m.embedding_params(), m.block_params(),
                                                     m.head_params())


def test_module_grouping_coalesces_modules_up_to_the_prefetch_bucket():
    # LLaMA-7B block: norm 4096 (kept whole: under 1e5), q, k, v, o 4096^2 = 16.8M each, norm,
    # gate, up, down 4096 x 11008 = 45.1M each. In calls of at most 5e7: [q, k], [v, o],
    # [gate], [up], [down]: five calls per block, the two norms never gathered.
    job = make_job(16, model=load_model("llama-7b")).for_engine("deepspeed")
    u = job.units[1]
    got = call_groups(job, "gather", 1, u)
    scale = u / job.model.block_params()
    a, f = 4096 * 4096, 4096 * 11008
    want = [2 * a, 2 * a, f, f, f]
    assert [k for k, _ in got] == [1] * 5
    assert [x for _, x in got] == pytest.approx([w * scale / u for w in want])
    assert call_groups(job.for_engine("fsdp2"), "gather", 1, u) == ((1, 1.0),)


def test_a_bucket_larger_than_a_unit_charges_each_unit_its_share():
    # Megatron's bucket on 64 data-parallel ranks: max(4e7, 6.4e7) = 6.4e7 elements; a block of
    # LLaMA-7B (2.02e8) takes ceil(2.02e8 / 6.4e7) = 4 calls of a quarter; the embedding
    # (1.31e8) 3 calls; a 10x smaller unit a share 1/x of one bucket call
    job = make_job(64, model=load_model("llama-7b")).for_engine("megatron")
    u = job.units[1]
    assert call_groups(job, "reduce", 1, u) == ((4, 0.25),)
    k, frac = call_groups(job, "reduce", 1, 6_400_000)[0]
    assert (k, frac) == (pytest.approx(0.1), pytest.approx(10.0))


def test_zero1_on_deepspeed_all_reduces_the_reduction_during_backward():
    # DeepSpeed ZeRO-1 (1, 1, N), one micro-batch: the gradient reduction is an all-reduce of
    # the whole gradient (twice a reduce-scatter's bytes), run in the boundary micro-batch's
    # backward hooks (overlap_comm, tests/test_deepspeed_zero1.py): part of it hides under
    # backward, as amsp's reduce-scatter does
    n = 16
    s = Strategy(s_p=1, s_g=1, s_os=n)
    base = make_job(n, model=load_model("llama-7b"), batch_seqs=n)
    ds, am = evaluate(base.for_engine("deepspeed"), s), evaluate(base, s)
    (e_ds,) = [e for e in ds.schedule if e.group == "OS_shard"]
    (e_am,) = [e for e in am.schedule if e.group == "OS_shard"]
    assert (e_ds.op, e_am.op) == ("all_reduce", "reduce_scatter")
    assert e_ds.bytes_per_rank_per_step == pytest.approx(2 * e_am.bytes_per_rank_per_step)
    # every unit is under DeepSpeed's 5e8-element bucket: each is charged u / 5e8 of one
    # all-reduce of a full bucket
    topo, gb, bucket = base.topology, base.training.grad_bytes, 500_000_000
    full = topo.collective_time("all_reduce", n, 1, bucket * gb)
    assert e_ds.time_s == pytest.approx(sum(u / bucket * full for u in base.units))
    assert ds.time.exposed_backward_s < e_ds.time_s  # overlapped with the backward
    assert am.time.exposed_backward_s < e_am.time_s  # overlapped with the backward


def test_megatron_sync_after_backward_equals_a_sync_overlap_false_amsp(monkeypatch):
    # the rule is data: amsp with sync_overlap off prices ZeRO-1 exactly as the step with its
    # whole sync added after backward (one micro-batch: nothing else in flight in backward)
    n = 16
    s = Strategy(s_p=1, s_g=1, s_os=n)
    job = make_job(n, model=load_model("llama-7b"), batch_seqs=n)
    on = evaluate(job, s)
    amsp = PROFILES["amsp"]
    off = dataclasses.replace(amsp, execution=dataclasses.replace(amsp.execution,
                                                                  sync_overlap=False))
    monkeypatch.setitem(engines.PROFILES, "amsp", off)
    got = evaluate(job, s)
    sync = sum(e.time_s for e in got.schedule if e.phase == "grad_sync")
    assert got.time.exposed_backward_s == pytest.approx(sync)
    assert got.step_s == pytest.approx(on.step_s - on.time.exposed_backward_s
                                       - on.time.contention_s + got.time.contention_s + sync)


def test_launch_overhead_adds_per_call(monkeypatch):
    n = 16
    s = Strategy(s_p=n, s_g=n, s_os=n)
    job = make_job(n, model=load_model("llama-7b"), batch_seqs=n)
    before = evaluate(job, s)
    amsp = PROFILES["amsp"]
    slow = dataclasses.replace(amsp, execution=dataclasses.replace(amsp.execution,
                                                                   launch_us=100.0))
    monkeypatch.setitem(engines.PROFILES, "amsp", slow)
    after = evaluate(job, s)
    for a, b in zip(before.schedule, after.schedule, strict=True):
        if b.group == "world" or b.group_size <= 1:
            assert a.time_s == b.time_s
        else:  # one call per unit and micro-batch: units x n_micro calls, 100 us each
            assert b.time_s - a.time_s == pytest.approx(b.calls_per_step * 100e-6)


def test_deepspeed_and_fsdp2_differ_where_they_execute_differently():
    job = make_job(64, model=load_model("llama-7b"), seq_len=4096, batch_seqs=256)
    z3 = Strategy(s_p=64, s_g=64, s_os=64)
    ds, fs = evaluate(job.for_engine("deepspeed"), z3), evaluate(job.for_engine("fsdp2"), z3)
    # ZeRO-3's per-module gathers: more calls, more latency than FSDP2's one call per unit
    gather = [(a, b) for a, b in zip(ds.schedule, fs.schedule, strict=True)
              if a.op == "all_gather" and a.group == "P"]
    assert gather and all(a.time_s > b.time_s for a, b in gather)
    assert ds.step_s > fs.step_s
    assert not math.isclose(ds.step_s, fs.step_s, rel_tol=1e-3)


def test_internevo_broadcasts_each_ranks_shard():
    # ZeRO-1 over 16 ranks on InternEvo: the updated parameters reach the others as 16
    # broadcasts, one per rank, each of that rank's 1/16 of the whole model (bf16); each unit
    # is charged its share. NCCL's ring broadcast: algorithm bandwidth = bus bandwidth.
    n = 16
    job = make_job(n, model=load_model("llama-7b"), batch_seqs=n).for_engine("internevo")
    s = Strategy(s_p=1, s_g=1, s_os=n)
    (upd,) = [e for e in evaluate(job, s).schedule if e.group == "P_update"]
    whole = job.phi * job.training.param_bytes
    want = n * job.topology.collective_time("broadcast", n, 1, whole / n)
    assert upd.time_s == pytest.approx(want)
    assert upd.unit_time_s[0] == pytest.approx(job.units[0] / job.phi * want)


def test_ring_broadcast_by_hand():
    from amsp_planner.collectives import Fabric, best

    # 16 ranks on 2 nodes, 1 GiB: ring/Simple, m = 16 steps, 2 of them across nodes:
    # 8.4 + 14 x max(3.4, 3 x 1) + 2 x 14 = 84 us; algorithm bandwidth = bus = 20 GB/s
    f = Fabric(ranks=16, nodes=2, per_node=8, bus_bw=20e9, intra_bw=240e9, net_bw=20e9)
    c = best("broadcast", f, 2**30)
    assert (c.algorithm, c.protocol) == ("ring", "Simple")
    assert c.seconds == pytest.approx(84e-6 + 2**30 / 20e9)


def test_deepspeed_reduce_scatter_host_time_grows_with_ranks_and_tensors():
    # DeepSpeed's stage-3 reduce-scatter interleaves every tensor's per-rank chunks in Python:
    # per call, reduce_host_us x members x tensors of the unit on the backward's critical path
    # (its compute stream), besides the copy-in. A LLaMA block has 9 tensors (q, k, v, o,
    # gate, up, down, 2 norms).
    from amsp_planner.cost.unit_tensors import unit_tensor_counts

    m = load_model("llama-7b")
    assert unit_tensor_counts(m) == (1, 9, 2)
    us = PROFILES["deepspeed"].execution.reduce_host_us
    for n in (16, 64):
        job = make_job(n, model=m, batch_seqs=n)
        s = Strategy(s_p=n, s_g=n, s_os=n)
        ds = {e.group: e for e in evaluate(job.for_engine("deepspeed"), s).schedule}["G"]
        am = {e.group: e for e in evaluate(job, s).schedule}["G"]
        assert ds.unit_kernel_s[1] - am.unit_kernel_s[1] == pytest.approx(us * 1e-6 * n * 9)


def test_compare_at_1024_gpus_prices_each_engine_as_it_executes():
    import json

    from amsp_testlib import run_cli

    args = ["compare", "--model", "llama-7b", "--gpus", "1024", "--json"]
    rows = {}
    for engine in ("deepspeed", "fsdp2"):
        # FSDP2 runs no ZeRO-1 (its shards are P = G = OS): not among its baselines; priced
        # as a given strategy, named so, for the comparison of how each engine reduces
        code, out, err = run_cli([*args, "--engine", engine, "-s", "p=1,g=1,os=1024,mb=1"])
        assert code == 0, err
        doc = json.loads(out)
        assert doc["engine"] == engine
        rows[engine] = {r["name"]: r for r in doc["rows"]}
    ds, fs = rows["deepspeed"], rows["fsdp2"]
    assert "zero1" not in fs and "given" in ds
    fs["zero1"] = fs.pop("given, not run by fsdp2")
    # ZeRO-3: DeepSpeed's per-module gathers and per-rank interleave vs FSDP2's per-unit calls
    assert ds["zero3"]["time"]["step_s"] > 1.5 * fs["zero3"]["time"]["step_s"]
    # ZeRO-1: both reduce during the last backward (DeepSpeed with the export's overlap_comm),
    # DeepSpeed all-reducing twice FSDP2's reduce-scatter bytes: the reduction costs it more
    # (exposed + contention); its update all-gather in 5e8-element buckets costs it less
    def red(r):
        return r["time"]["exposed_backward_s"] + r["time"]["contention_s"]
    assert red(ds["zero1"]) > red(fs["zero1"])
    assert ds["zero1"]["time"]["exposed_update_s"] < fs["zero1"]["time"]["exposed_update_s"]
    # the same sharding, the same bytes where the collectives are the same
    assert ds["zero3"]["inter_bytes_per_rank_per_step"] == fs["zero3"]["inter_bytes_per_rank_per_step"]


def test_execution_differences_name_each_separating_value():
    from amsp_planner.engines import execution_differences

    got = execution_differences(PROFILES["fsdp2"], PROFILES["deepspeed"])
    assert "gather_grouping unit -> module" in got
    assert "reduce_bucket per unit -> 500,000,000" in got
    assert "replicated_reduce reduce_scatter -> all_reduce" in got
    assert "sync_overlap on -> off" in got
    assert execution_differences(PROFILES["fsdp2"], PROFILES["torchtitan"]) == []
    # every listed difference is a value with a source in the target's profile
    for line in got:
        assert PROFILES["deepspeed"].execution.source(line.split()[0])


def test_deepspeed_fetches_on_demand_after_a_module_over_max_live_parameters():
    # A GPT block of width 20480 (the 530B model's): norms kept whole (2 x 20480 < 1e5), then
    # q, k, v, o 20480^2 + bias = 419M each, fc1 and fc2 4 x 20480^2 (+ bias) = 1.68e9 each:
    # six calls (each over the 5e7 prefetch bucket). DeepSpeed prefetches nothing while it
    # holds 1e9 elements or more (stage3_max_live_parameters): the call after fc1 (fc2) and the
    # one after the previous block's fc2 (q) are fetched on demand.
    from amsp_planner.cost.schedule import on_demand, unit_elements
    from amsp_planner.specs.model import ModelSpec

    gpt = ModelSpec(name="gpt-20480", num_layers=2, hidden_size=20480, num_heads=128,
                    ffn_hidden_size=81920, ffn_type="gelu", vocab_size=51200, max_seq_len=2048,
                    norm_type="layernorm", position_embedding="learned", attention_bias="all",
                    mlp_bias=True)
    n = 16
    # the rule decides what the coordinator prefetches; it prices where the prefetch overlaps
    # the compute (prefetch_overlap on: DeepSpeed's profile waits for every gather instead,
    # tests/test_deepspeed_azure_rows.py), set here as a run's own setting
    job = make_job(n, model=gpt, seq_len=2048, batch_seqs=n).for_engine("deepspeed")
    job = dataclasses.replace(job, settings=(("prefetch_overlap", True),))
    u = unit_elements(job)[1]
    assert [x for _, x in call_groups(job, "gather", 1, u)] == pytest.approx(
        [w / gpt.block_params() for w in [20480**2 + 20480] * 4 + [4 * 20480**2 + 81920,
                                                                  4 * 20480**2 + 20480]])
    assert on_demand(job, 1, u) == (True, False, False, False, False, True)
    # those two calls' seconds move from the overlapped gather to the compute stream
    s = Strategy(s_p=n, s_g=n, s_os=n)
    a = evaluate(job, s)
    b = evaluate(dataclasses.replace(job, settings=(("prefetch_overlap", True),
                                                    ("max_live_params", None))), s)
    ga = {(e.phase, e.group): e for e in a.schedule}[("forward", "P")]
    gb = {(e.phase, e.group): e for e in b.schedule}[("forward", "P")]
    topo, pb = job.topology, job.training.param_bytes
    late = sum(topo.collective_time("all_gather", n, 1, x * pb)
               for x in (20480**2 + 20480, 4 * 20480**2 + 20480))
    assert ga.unit_kernel_s[1] - gb.unit_kernel_s[1] == pytest.approx(late, rel=1e-3)
    assert gb.unit_time_s[1] - ga.unit_time_s[1] == pytest.approx(late, rel=1e-3)
    assert ga.time_s == pytest.approx(gb.time_s)  # the same collectives, charged elsewhere
    assert a.step_s > b.step_s


def test_max_live_parameters_changes_nothing_for_small_modules():
    # LLaMA-7B's largest module has 45M elements: every call is prefetched
    from amsp_planner.cost.schedule import on_demand, unit_elements

    job = make_job(16, model=load_model("llama-7b")).for_engine("deepspeed")
    job = dataclasses.replace(job, settings=(("prefetch_overlap", True),))  # as above
    assert not any(any(on_demand(job, c, u)) for c, u in enumerate(unit_elements(job)))


# The named baselines each engine does not run, from its documented shapes (engines.py): FSDP2
# and torchtitan shard P, G and OS alike (no ZeRO-1/2) and run no qwZ/qgZ; Megatron-Core's
# distributed optimizer shards OS only; DeepSpeed runs ZeRO's stages over all ranks (no
# partial P like HSDP or MiCS); InternEvo OS only or all three alike (no ZeRO-2, no ZeRO++).
NOT_RUN = {"amsp": set(), "torchtitan": {"zero1", "zero2", "zeropp"},
           "fsdp2": {"zero1", "zero2", "zeropp"}, "deepspeed": {"hsdp", "mics"},
           "megatron": {"zero2", "zero3", "hsdp", "mics", "zeropp"},
           "internevo": {"zero2", "zeropp"}}


@pytest.mark.parametrize("engine", sorted(NOT_RUN))
def test_the_named_baselines_are_those_the_engine_runs(engine):
    """A plan is never slower than a fitting named baseline by more than the band, and the
    baselines are strategies the engine runs: a baseline it cannot run (torchtitan's ZeRO-1
    was shown 7.8 % faster than the plan, beyond a 2 % band) is named as not run, unpriced."""
    from amsp_planner.cost.evaluate import job_baselines
    from amsp_planner.solver import SearchSpace, solve
    from amsp_planner.specs import TrainingSpec, load_cluster

    job = Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"),
                     TrainingSpec(seq_len=8192, global_batch_seqs=128), 64, engine)
    runs, why = job_baselines(job)
    assert set(why) == NOT_RUN[engine], why
    space = SearchSpace.for_job(job, tp=1)
    for name, s in runs.items():  # each in the engine's own search space
        assert space.triples is None or (s.s_p, s.s_g, s.s_os) in space.triples, name
        assert (s.qwz in space.qwz and s.qgz in space.qgz and s.hpz in space.hpz), name
    r = solve(job, tp=1)
    assert set(r.baselines) == set(runs)
    for name, b in r.baselines.items():
        if b.fits and b.memory.total <= r.preference.usable(job.cluster.memory_bytes):
            assert r.best.step_s <= b.step_s * (1 + r.preference.band) + 1e-9, name


def test_plan_and_compare_name_the_baselines_the_engine_does_not_run():
    from amsp_testlib import run_cli

    args = ["--model", "llama3-8b", "--gpus", "64", "--cluster", "dgx-h100-ndr", "--engine",
            "torchtitan"]
    for cmd in (["plan", *args, "-o", "-", "--format", "table"], ["compare", *args]):
        code, out, err = run_cli(cmd)
        assert code == 0, err
        assert ("named baselines not run by torchtitan, so not priced: zero1 (its shards are P = G = OS); "
                "zero2 (its shards are P = G = OS); zeropp (no qwz, hpz, qgz)") in out + err, cmd


def test_explain_on_another_engine_names_the_alternatives_it_does_not_run(tmp_path):
    """`amsp explain --engine megatron` of an amsp plan: the baselines Megatron-Core does not
    run (it shards OS only) are named as not run, not priced as if it could."""
    from amsp_testlib import run_cli

    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan), "--engine", "megatron", "--no-sensitivity"])
    assert code == 0, err
    for name in ("zero2", "zero3", "hsdp", "mics", "zeropp"):
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert line.endswith("not run by megatron (its shards are OS only (P = G = 1))"), line
    zero1 = next(x for x in out.splitlines() if x.strip().startswith("zero1 "))
    assert "step time" in zero1
