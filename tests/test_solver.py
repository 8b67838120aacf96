"""The ILP against a brute-force oracle, and the planner's choices in known regimes, under the
fastest-candidate rule (``FASTEST``; the planner's default rule: tests/test_preference.py).
The regimes are data parallel only (``tp=1``; the equivalence test also searches every
tensor-parallel degree; the TP regimes are in tests/test_tp.py)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.engines import ENGINES
from amsp_planner.errors import InfeasibleError
from amsp_planner.solver import SearchSpace
from amsp_planner.solver import solve as _solve
from amsp_planner.solver.brute import brute_force
from amsp_planner.solver.space import FASTEST
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

GIB = 1024**3
solve = functools.partial(_solve, preference=FASTEST, tp=1)


def make_job(model, cluster, gpus, seqs_per_gpu=1, seq_len=4096, gpus_per_node=None,
             overlap=None, engine="amsp", layers=None, **train):
    overrides = {"gpus_per_node": gpus_per_node} if gpus_per_node else {}
    if overlap is not None:
        overrides["overlap_efficiency"] = overlap
    c = load_cluster(cluster, overrides or None)
    t = TrainingSpec(seq_len=seq_len, global_batch_seqs=gpus * seqs_per_gpu, **train)
    spec = load_model(model)
    if layers is not None:  # the model's shapes with fewer blocks (a small checkpointing space)
        spec = spec.model_copy(update={"num_layers": layers})
    return Job.create(spec, c, t, gpus, engine)


def check_against_brute_force(job, limit, zeropp=True, objective="time", tp=1):
    """`tp`: the tensor-parallel degree pinned, or None for every degree the job admits (one
    ILP per degree, the rule across them, against the brute force over their union)."""
    space = SearchSpace.for_job(job, zeropp=zeropp, tp=tp)
    oracle = brute_force(job, space, limit, objective, top=10**9)
    if not oracle:
        for solver in ("highs", "exhaustive"):
            with pytest.raises(InfeasibleError):
                solve(job, limit, zeropp=zeropp, objective=objective, runners_up=0,
                      solver=solver, tp=tp)
        return None
    key = (lambda e: e.time.step_s) if objective == "time" else (lambda e: e.time.comm_total_s)
    best = key(oracle[0])
    # among the candidates that tie with the optimum (well inside both tie windows of 1e-7)
    ties = [e for e in oracle if key(e) <= best * (1 + 1e-8)]
    least = min(e.memory.total for e in ties)
    for solver in ("highs", "exhaustive"):  # the ILP, and the enumeration over its tables
        got = solve(job, limit, zeropp=zeropp, objective=objective, runners_up=0,
                    solver=solver, tp=tp).best
        assert got.fits
        # the same optimum, and no more memory than the least of its ties
        assert math.isclose(key(got), best, rel_tol=1e-6), (solver, got.strategy,
                                                            oracle[0].strategy)
        assert got.memory.total <= least * (1 + 1e-6), (
            solver, got.strategy, min(ties, key=lambda e: e.memory.total).strategy)
    return got


instances = st.fixed_dictionaries({
    "model": st.sampled_from(["llama-7b", "llama-13b", "mistral-7b", "tiny", "llama3-8b"]),
    "cluster": st.sampled_from(["dgx-a100-hdr", "a800-hdr", "eth-100g", "aws-p4d", "v100-ib"]),
    "gpus_per_node": st.sampled_from([2, 4, 8]),
    "nodes": st.sampled_from([1, 2, 4, 8]),
    "seqs_per_gpu": st.sampled_from([1, 2, 4]),
    "seq_len": st.sampled_from([512, 2048, 4096]),
    "limit_frac": st.floats(min_value=0.02, max_value=1.2),
    "zeropp": st.booleans(),
    "objective": st.sampled_from(["time", "time", "comm"]),
    "overlap": st.sampled_from([1.0, 1.0, 0.5, 0.0]),
    "profile": st.sampled_from(["eager", "fused"]),
    # the engine restricts the space (SearchSpace.triples, ZeRO++ switches, checkpointing
    # kinds) and the gradient dtype it runs; amsp, the unrestricted space, twice as often
    "engine": st.sampled_from(["amsp", "amsp", *ENGINES[1:]]),
    "grad_dtype": st.sampled_from(["bf16", "bf16", "fp32"]),
    "layers": st.sampled_from([1, 2, 3, 4]),
    # tensor parallelism: every degree the job admits searched together (one ILP per degree)
    # in a third of the instances, data parallel only in the rest (to keep the test's time)
    "tp": st.sampled_from([1, 1, None]),
})


engine_instances = st.fixed_dictionaries({
    "model": st.sampled_from(["llama-7b", "tiny", "llama3-8b"]),
    "cluster": st.sampled_from(["dgx-a100-hdr", "eth-100g", "aws-p4d"]),
    "gpus_per_node": st.sampled_from([2, 4, 8]),
    "nodes": st.sampled_from([1, 2, 4]),
    "seqs_per_gpu": st.sampled_from([1, 2, 4]),
    "seq_len": st.sampled_from([512, 2048]),
    "limit_frac": st.floats(min_value=0.02, max_value=1.2),
    "objective": st.sampled_from(["time", "time", "comm"]),
    "overlap": st.sampled_from([1.0, 0.5, 0.0]),
    "layers": st.sampled_from([1, 2, 3]),
})
"""Instances for ILP == brute force under one engine's profile (test_deepspeed_zero2.py,
test_engine_versions.py): ``check_engine_instance``."""


def check_engine_instance(p: dict, engine: str) -> None:
    """ILP == brute force on instance `p` of ``engine_instances``, priced by `engine`, under a
    memory limit of ``limit_frac`` of DDP's."""
    gpus = p["gpus_per_node"] * p["nodes"]
    job = make_job(p["model"], p["cluster"], gpus, p["seqs_per_gpu"], p["seq_len"],
                   gpus_per_node=p["gpus_per_node"], overlap=p["overlap"], engine=engine,
                   layers=p["layers"])
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * p["limit_frac"], True, p["objective"])

@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_ilp_equals_brute_force(p):
    gpus = p["gpus_per_node"] * p["nodes"]
    job = make_job(p["model"], p["cluster"], gpus, p["seqs_per_gpu"], p["seq_len"],
                   gpus_per_node=p["gpus_per_node"], overlap=p["overlap"],
                   activation_profile=p["profile"], engine=p["engine"],
                   grad_accum_dtype=p["grad_dtype"], layers=p["layers"])
    # every checkpointing kind the engine runs is in the space: none, K of L blocks, all, op
    L = job.model.num_layers
    want = tuple(c for c in (*range(L + 1), "op") if job.profile.runs_ckpt(c, L))
    assert SearchSpace.for_job(job).ckpt == want
    # memory limits from "nothing fits" to "everything fits" relative to DDP's need
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * p["limit_frac"], p["zeropp"], p["objective"], p["tp"])


def test_tight_memory_rediscovers_zero3():
    # 13B on 64 GPUs with 12.5 GiB: only sharding everything over all GPUs (ZeRO-3) with
    # checkpointing fits; the brute force confirms no other point does.
    job = make_job("llama-13b", "dgx-a100-hdr", 64, seqs_per_gpu=1)
    got = solve(job, 12.5 * GIB, zeropp=False).best
    s = got.strategy
    assert (s.s_p, s.s_g, s.s_os, s.ckpt) == (64, 64, 64, True)
    space = SearchSpace.for_job(job, zeropp=False, tp=1)
    fitting = brute_force(job, space, 12.5 * GIB, top=10**6)
    assert {(e.strategy.s_p, e.strategy.s_g, e.strategy.s_os) for e in fitting} == {(64, 64, 64)}


def test_plentiful_memory_keeps_parameters_replicated():
    # LLaMA-7B on 16 nodes of the AMSP paper's A800 cluster (4x HDR), short sequences so that
    # communication cannot hide behind compute, one micro-batch per step, memory for more than
    # sharded OS but not for DDP (16 B/param = 108 GB): parameters stay replicated (no
    # per-micro-batch gathers) and optimizer states are sharded, as in AMSP's 7B point.
    job = make_job("llama-7b", "a800-hdr", 128, seqs_per_gpu=1, seq_len=512)
    best = solve(job, 70 * GIB, zeropp=False).best
    s = best.strategy
    assert best.n_micro == 1
    assert s.s_p == 1 and s.s_os > 1
    assert not evaluate(job, Strategy(), 70 * GIB).fits  # DDP does not fit
    # ZeRO-3 and HSDP, which gather parameters every micro-batch, are slower here
    for name in ("zero3", "hsdp"):
        assert solve(job, 70 * GIB, zeropp=False).baselines[name].step_s > best.step_s


def test_unlimited_memory_takes_the_fastest_point():
    # with no memory limit the planner's step time is the brute-force minimum over the space
    job = make_job("llama-7b", "eth-100g", 32, seqs_per_gpu=2, seq_len=1024)
    best = solve(job, float("inf"), zeropp=False, runners_up=0).best
    oracle = brute_force(job, SearchSpace.for_job(job, zeropp=False, tp=1), float("inf"))[0]
    assert math.isclose(best.step_s, oracle.step_s, rel_tol=1e-6)


def test_binding_and_non_binding_limits():
    job = make_job("llama-7b", "dgx-a100-hdr", 64, seqs_per_gpu=2)
    free = solve(job, float("inf")).best
    loose = solve(job, free.memory.total * 1.01).best
    assert math.isclose(loose.step_s, free.step_s, rel_tol=1e-9)   # not binding
    tight = solve(job, free.memory.total * 0.5).best
    assert tight.memory.total <= free.memory.total * 0.5
    assert tight.step_s >= free.step_s * (1 - 1e-12)                 # binding: no faster


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_infeasible_says_what_fits(solver, monkeypatch):
    if solver == "cbc":  # the least-memory search uses the solver asked for, never HiGHS
        import amsp_planner.solver.ilp as ilp

        monkeypatch.setattr(ilp.StrategyIlp, "_solver", _cbc_only(ilp.StrategyIlp._solver))
    job = make_job("llama-65b", "dgx-a100-hdr", 8)
    with pytest.raises(InfeasibleError) as exc:
        solve(job, solver=solver)
    msg = str(exc.value)
    assert "least memory any strategy needs is" in msg and "GPUs" in msg
    need = float(msg.split("needs is ")[1].split(" GiB")[0])
    # 65B x 16 B/param over 8 GPUs alone is > 120 GiB
    assert need > 65.2e9 * 16 / 8 / GIB


def _cbc_only(real):
    def solver(self):
        assert self.solver_name == "cbc", self.solver_name
        return real(self)
    return solver


def test_highs_and_cbc_agree():
    job = make_job("llama-7b", "a800-hdr", 32, seqs_per_gpu=2)
    a = solve(job, 40 * GIB, solver="highs", runners_up=0).best
    b = solve(job, 40 * GIB, solver="cbc", runners_up=0).best
    assert math.isclose(a.step_s, b.step_s, rel_tol=1e-6)


def test_runners_up_are_ordered_and_distinct():
    job = make_job("llama-7b", "a800-hdr", 64, seqs_per_gpu=2)
    r = solve(job, 60 * GIB, runners_up=3)
    steps = [r.best.step_s] + [e.step_s for e in r.runners_up]
    assert len(r.runners_up) == 3
    assert all(a <= b * (1 + 1e-9) for a, b in zip(steps, steps[1:], strict=False))
    names = [str(r.best.strategy)] + [str(e.strategy) for e in r.runners_up]
    assert len(set(names)) == len(names)


def test_no_overlap_adds_all_communication_to_the_step():
    # eta = 0: step = compute + every collective (plus nothing hidden); eta = 1 hides some
    from amsp_planner.cost.evaluate import evaluate as ev
    serial = make_job("llama-7b", "a800-hdr", 64, seqs_per_gpu=2, overlap=0.0)
    e = ev(serial, Strategy(s_p=64, s_g=64, s_os=64))
    t = e.time
    # with no overlap every collective is exposed exactly once (the copy kernels of the
    # gathers and reductions run on the compute stream in any case)
    assert math.isclose(t.step_s, t.compute_s + t.kernel_s + t.optimizer_s + t.comm_total_s,
                        rel_tol=1e-9)
    assert t.contention_s == 0
    hidden = ev(make_job("llama-7b", "a800-hdr", 64, seqs_per_gpu=2, overlap=1.0),
                Strategy(s_p=64, s_g=64, s_os=64))
    assert hidden.step_s < e.step_s


DATA = Path(__file__).parent / "data"
REPO = Path(__file__).parent.parent


@pytest.mark.parametrize(("batch", "n_micro", "g_options"), [(16, 2, (1,)), (32, 4, (1,))])
def test_rediscovers_the_amsp_point_on_a_calibrated_two_node_cluster(batch, n_micro, g_options):
    # The cluster spec `amsp calibrate` measured on the emulated 2-node x 4-rank cluster of
    # bench/fidelity.py (200 Mbit/s between nodes; run 1 of docs/benchmarks.md), where this
    # plan measured fastest of 13 strategies at 16 sequences per step. Memory is plentiful
    # (DDP fits). With gradient accumulation the planner keeps P and G replicated and shards
    # OS inside the node: AMSP's 7B point.
    c = load_cluster(str(DATA / "emulated-2x4-calibrated.yaml"))
    m = load_model(str(REPO / "bench" / "models" / "fidelity-3m.yaml"))
    job = Job.create(m, c, TrainingSpec(seq_len=32, global_batch_seqs=batch), 8)
    assert evaluate(job, Strategy()).fits  # DDP fits: memory is not what decides
    for zeropp in (False, True):
        best = solve(job, zeropp=zeropp, micro_batch=1).best
        s = best.strategy
        assert best.n_micro == n_micro
        assert (s.s_p, s.s_os) == (1, job.gpus_per_node) and s.s_g in g_options, s
        assert not (s.qwz or s.qgz or s.hpz > 1)


def _default_job(model, gpus, seqs=None):
    t = TrainingSpec(global_batch_seqs=seqs) if seqs else TrainingSpec()
    return Job.create(load_model(model), load_cluster(None), t, gpus)


def test_partial_checkpointing_is_the_optimum():
    # llama3-405b on 16384 GPUs of the default cluster, one sequence per GPU: checkpointing
    # every block fits, none does not; the planner checkpoints only as many blocks as the
    # memory needs: the first K of 126 with K - 1 not fitting, and faster than all 126
    job = _default_job("llama3-405b", 16384, 16384)
    L = job.model.num_layers
    best = solve(job, runners_up=0).best
    s = best.strategy
    k = s.ckpt_blocks
    assert not s.ckpt and not s.ckpt_op and 0 < k < L, s
    fewer = evaluate(job, s.with_(ckpt_blocks=k - 1))
    full = evaluate(job, s.with_(ckpt=True, ckpt_blocks=0))
    assert not fewer.fits and fewer.step_s < best.step_s      # one block less: too big
    assert full.fits and full.step_s > best.step_s            # every block: slower
    # for this sharding the brute force over every K agrees: the smallest K that fits
    fits = [kk for kk in range(L + 1) if evaluate(job, s.with_(ckpt_blocks=kk)).fits]
    assert min(fits) == k
    op = evaluate(job, s.with_(ckpt_blocks=0, ckpt_op=True))
    assert not op.fits or op.step_s > best.step_s


def test_op_level_checkpointing_beats_partial_for_llama_65b():
    # llama-65b on 1024 GPUs: op-level keeps the matmul outputs and recomputes only the
    # memory-bound elementwise kernels, so it is faster than checkpointing the K blocks that
    # would make the same memory fit; without the op-level option the optimum is partial
    import dataclasses

    from amsp_planner.solver.ilp import StrategyIlp

    job = _default_job("llama-65b", 1024)
    best = solve(job, runners_up=0).best
    assert best.strategy.ckpt_op, best.strategy
    space = SearchSpace.for_job(job, tp=1)
    no_op = dataclasses.replace(space, ckpt=tuple(c for c in space.ckpt if c != "op"))
    sols, _, _ = StrategyIlp(job, no_op, job.cluster.memory_bytes).solve(0)
    partial = evaluate(job, sols[0].strategy)
    assert 0 < partial.strategy.ckpt_blocks < job.model.num_layers, partial.strategy
    assert partial.fits and partial.step_s > best.step_s
    assert evaluate(job, partial.strategy.with_(ckpt=True, ckpt_blocks=0)).step_s > partial.step_s


def test_no_checkpointing_is_the_optimum():
    # llama-7b on 1024 GPUs: the activations of one sequence fit without checkpointing, and
    # any recomputation lengthens the step
    job = _default_job("llama-7b", 1024)
    best = solve(job, runners_up=0).best
    s = best.strategy
    assert s.ckpt_value is False, s
    for ck in ({"ckpt_blocks": 1}, {"ckpt_op": True}, {"ckpt": True}):
        assert evaluate(job, s.with_(**ck)).step_s > best.step_s


@pytest.mark.parametrize("limit_frac,objective", [(0.1, "time"), (0.4, "time"), (1.2, "time"),
                                                  (0.4, "comm"), (1.2, "comm")])
def test_ilp_equals_brute_force_with_gathers_fetched_on_demand(monkeypatch, limit_frac,
                                                                 objective):
    # DeepSpeed's max_live_params lowered under LLaMA's module sizes (16.8M-45M elements): the
    # gathers after a large module are fetched on demand (cost/schedule.py on_demand), charged
    # to the compute stream; the ILP's tables and the brute force read the same entries (the
    # 'comm' objective counts those gathers too: tables.py dm)
    import dataclasses

    from amsp_planner import engines
    from amsp_planner.cost.schedule import on_demand, unit_elements

    ds = engines.PROFILES["deepspeed"]
    low = dataclasses.replace(ds, execution=dataclasses.replace(ds.execution,
                                                                max_live_params=20_000_000))
    monkeypatch.setitem(engines.PROFILES, "deepspeed", low)
    job = make_job("llama-7b", "dgx-a100-hdr", 16, 2, 2048, engine="deepspeed", layers=2)
    assert any(on_demand(job, 1, unit_elements(job)[1]))
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * limit_frac, objective=objective)
