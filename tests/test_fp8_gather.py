"""The FP8 parameter all-gather (``fp8ag``): its bytes by hand, the search between bf16
gathers, qwZ and FP8 gathers against a brute force, and FP8 never chosen without
``--precision fp8`` (docs/fp8.md, "FP8 weight all-gather")."""

from __future__ import annotations

import functools

import pytest
from amsp_testlib import assert_user_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.schedule import build_schedule
from amsp_planner.errors import AmspUserError
from amsp_planner.solver import SearchSpace
from amsp_planner.solver import solve as _solve
from amsp_planner.solver.space import FASTEST
from amsp_planner.strategy import Strategy
from tests.test_solver import check_against_brute_force, make_job

solve = functools.partial(_solve, preference=FASTEST)


def _entries(job, s):
    return {(e.phase, e.op, e.group): e for e in build_schedule(job, s)}


def test_bundled_runtime_gathers_one_byte_per_element_and_one_amax_per_unit():
    # amsp: every element of every unit in FP8 under one scale per unit (runtime/fp8.py)
    job = make_job("llama-7b", "dgx-a100-hdr", 16, precision="fp8")
    s = Strategy(s_p=8, s_g=8, s_os=8, fp8ag=True)
    n = job.n_micro(s)
    e = _entries(job, s)
    units = sum(job.units)  # padded elements of the embedding, every block and the head
    fwd = e["forward", "all_gather", "P"]
    assert fwd.dtype == "fp8" and fwd.full_bytes_per_step == n * units
    assert e["backward", "all_gather", "P"].full_bytes_per_step == n * units
    amax = e["update", "all_reduce", "P"]
    assert (amax.calls_per_step, amax.full_bytes_per_step) == (job.num_units, 4 * job.num_units)
    # half the bf16 gather's bytes; gradients stay bf16
    bf = _entries(job, Strategy(s_p=8, s_g=8, s_os=8))
    assert bf["forward", "all_gather", "P"].full_bytes_per_step == 2 * n * units
    assert (e["backward", "reduce_scatter", "G"].full_bytes_per_step
            == bf["backward", "reduce_scatter", "G"].full_bytes_per_step)
    assert e["backward", "reduce_scatter", "G"].dtype == "bf16"


def test_torchao_gathers_the_block_linears_in_fp8_and_the_rest_in_bf16():
    # torchtitan tensorwise: wq, wk, wv, wo, w1, w3, w2 of a block in FP8 (1 B), norms and
    # padding in bf16 (2 B); the embedding and the head bf16; 7 amaxes per block per step, in
    # one all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp stacks them)
    job = make_job("llama3-8b", "dgx-h100-ndr", 64, engine="torchtitan", precision="fp8",
                   fp8_recipe="tensorwise")
    s = Strategy(s_p=64, s_g=64, s_os=64, fp8ag=True)
    n, L = job.n_micro(s), 32
    h, f, kv = 4096, 14336, 1024  # Llama-3-8B: hidden, FFN, 8 KV heads x 128
    lin = 2 * h * h + 2 * h * kv + 3 * h * f
    emb, block, head = job.units[0], job.units[1], job.units[-1]
    want = n * (2 * emb + L * (lin + 2 * (block - lin)) + 2 * head)
    e = _entries(job, s)
    assert e["forward", "all_gather", "P"].full_bytes_per_step == want
    amax = e["update", "all_reduce", "P"]
    assert (amax.calls_per_step, amax.full_bytes_per_step) == (1, L * 7 * 4)
    # the FP8 units replace the two gathered bf16 ones in memory, sized by the largest
    # gathered unit in bytes: Llama-2-13B's block (1 B per linear element) is then smaller
    # than its bf16 head (vocabulary 32,000 x 5,120, padded)
    job = make_job("llama-13b", "dgx-h100-ndr", 16, engine="fsdp2", precision="fp8",
                   fp8_recipe="tensorwise")
    h, f = 5120, 13824
    lin = 4 * h * h + 3 * h * f
    block, head = job.units[1], job.units[-1]
    s = Strategy(s_p=16, s_g=16, s_os=16)
    mem = [evaluate(job, x, float("inf")).memory.gather_buffers
           for x in (s, s.with_(fp8ag=True))]
    assert mem == [2 * 2 * block, 2 * max(2 * head, lin + 2 * (block - lin))]


def test_fp8_never_without_precision_fp8():
    job = make_job("llama-7b", "dgx-a100-hdr", 16)
    space = SearchSpace.for_job(job)
    assert not any(sp.fp8ag for sp in space.by_tp())
    assert not any(s.fp8ag for s in space.candidates(job))
    with pytest.raises(AmspUserError, match="--precision fp8"):
        evaluate(job, Strategy(s_p=8, s_g=8, s_os=8, fp8ag=True), float("inf"))
    # nor with --fp8-all-gather off, nor with a recipe that gathers bf16 (torchao rowwise)
    off = make_job("llama-7b", "dgx-a100-hdr", 16, precision="fp8", fp8_all_gather="off")
    assert not any(s.fp8ag for s in SearchSpace.for_job(off).candidates(off))
    row = make_job("llama3-8b", "dgx-h100-ndr", 16, engine="fsdp2", precision="fp8",
                   fp8_recipe="rowwise")
    assert not any(sp.fp8ag for sp in SearchSpace.for_job(row).by_tp())
    # with fp8 and auto both kinds are searched; with on, FP8 gathers only
    on = make_job("llama-7b", "dgx-a100-hdr", 16, precision="fp8", fp8_all_gather="on")
    cands = list(SearchSpace.for_job(on).candidates(on))
    assert all(s.fp8ag or s.s_p == 1 for s in cands) and not any(s.qwz for s in cands)


def test_fp8_all_gather_not_qwz_is_the_optimum():
    # the bundled runtime in fp8 on two 8-GPU nodes joined by 100 Gbit/s Ethernet, 40 GiB per
    # GPU: parameters sharded across the nodes, gathers exposed; FP8 gathers move 1 byte per
    # element, qwZ 1 + 4/256 with the same (de)quantization kernels, and the search takes
    # the FP8 all-gather (docs/fp8.md); without it (--fp8-all-gather off) qwZ, slower
    limit = 40 * 1024**3
    job = make_job("llama-13b", "eth-100g", 16, precision="fp8")
    got = solve(job, limit, tp=1, runners_up=0).best
    assert got.strategy.fp8ag and not got.strategy.qwz and got.strategy.s_p == 16, got.strategy
    off = make_job("llama-13b", "eth-100g", 16, precision="fp8", fp8_all_gather="off")
    q = solve(off, limit, tp=1, runners_up=0).best
    assert q.strategy.qwz and not q.strategy.fp8ag, q.strategy
    assert got.time.step_s < q.time.step_s
    # the same strategy with qwZ in place of the FP8 gathers is slower too
    same = evaluate(job, got.strategy.with_(fp8ag=False, qwz=True), limit)
    assert got.time.step_s < same.time.step_s


instances = st.fixed_dictionaries({
    "setup": st.sampled_from([("amsp", "dgx-a100-hdr", None), ("amsp", "eth-100g", None),
                              ("fsdp2", "dgx-h100-ndr", "tensorwise"),
                              ("torchtitan", "dgx-h100-ndr", "tensorwise"),
                              ("torchtitan", "dgx-h100-ndr", "rowwise"),
                              # Transformer Engine: its FP8 weight cache in every strategy's memory
                              ("megatron", "dgx-h100-ndr", "delayed")]),
    "model": st.sampled_from(["llama-7b", "tiny", "llama3-8b"]),
    "gpus_per_node": st.sampled_from([4, 8]),
    "nodes": st.sampled_from([1, 2, 4]),
    "limit_frac": st.floats(min_value=0.05, max_value=1.2),
    "mode": st.sampled_from(["auto", "auto", "on"]),
    "objective": st.sampled_from(["time", "time", "comm"]),
    "layers": st.sampled_from([1, 2, 3]),
    "tp": st.sampled_from([1, 1, None]),
})


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_ilp_equals_brute_force_with_fp8_gathers(p):
    engine, cluster, recipe = p["setup"]
    gpus = p["gpus_per_node"] * p["nodes"]
    extra = {"fp8_recipe": recipe} if recipe else {}
    if p["mode"] == "on" and recipe == "rowwise":
        extra["fp8_recipe"] = "tensorwise"
    job = make_job(p["model"], cluster, gpus, 2, 1024, gpus_per_node=p["gpus_per_node"],
                   engine=engine, layers=p["layers"], precision="fp8",
                   fp8_all_gather=p["mode"], **extra)
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * p["limit_frac"], True, p["objective"], p["tp"])


def test_train_runs_amsp_fp8_plans_and_refuses_other_engines_fp8(tmp_path):
    # `amsp train` refuses an FP8 plan whose FP8 matmuls it would not run, in one line
    from amsp_testlib import assert_user_error, run_cli

    plan = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--model", "tiny", "--gpus", "8", "--cluster",
                            "dgx-h100-ndr", "--engine", "fsdp2", "--precision", "fp8",
                            "--fp8-recipe", "tensorwise", "-o", str(plan)])
    assert code == 0, err
    assert_user_error(*run_cli(["train", str(plan), "--steps", "1"]), "--engine fsdp2",
                      "--engine amsp --precision fp8")
    # a strategy with fp8ag in a bf16 job: one line naming the fix
    assert_user_error(*run_cli(["plan", "--model", "tiny", "--gpus", "8", "--strategy",
                                "p=8,g=8,os=8,fp8ag", "-o", str(plan)]), "fp8ag",
                      "--precision fp8")


def test_fp8_all_gather_on_gathers_every_strategy_in_fp8():
    # --fp8-all-gather on: a strategy written without fp8ag (a named baseline) gathers FP8 too
    job = make_job("llama-7b", "dgx-a100-hdr", 16, precision="fp8", fp8_all_gather="on")
    plain, tagged = (_entries(job, Strategy(s_p=16, s_g=16, s_os=16, fp8ag=f))
                     for f in (False, True))
    assert plain == tagged and plain["forward", "all_gather", "P"].dtype == "fp8"


def test_fp8_all_gather_on_refuses_qwz_and_the_zeropp_baseline_drops_it():
    """--fp8-all-gather on gathers every sharded parameter in FP8: a strategy that also asks
    for qwZ's INT8 gathers is refused in one line (it was accepted, its plan holding both),
    and the zeropp baseline is priced and named without qwz (hpZ and qgZ kept)."""
    from amsp_planner.cost.evaluate import evaluate_baselines

    base = ["plan", "--model", "llama3-8b", "--gpus", "64", "--cluster", "dgx-h100-ndr",
            "--engine", "torchtitan", "--precision", "fp8", "--fp8-recipe", "tensorwise"]
    assert_user_error(*run_cli(base + ["--fp8-all-gather", "on", "-s",
                                       "p=64,g=64,os=64,qwz,mb=1", "-o", "-"]),
                      "qwz with --fp8-all-gather on", "--fp8-all-gather auto")
    code, _, err = run_cli(base + ["--fp8-all-gather", "auto", "-s", "p=64,g=64,os=64,qwz,mb=1",
                                   "-o", "-"])
    assert code == 0, err  # auto: qwZ is one of the choices
    job = make_job("llama-7b", "dgx-a100-hdr", 16, precision="fp8", fp8_all_gather="on")
    zpp = evaluate_baselines(job)["zeropp"].strategy
    assert not zpp.qwz and zpp.qgz and zpp.hpz > 1


def test_notes_of_a_refused_job_are_not_printed():
    """A refused plan prints its one error line alone: the notes about the job it would have
    planned (a split into smaller nodes, a --seq-len past the model's) are dropped."""
    assert_user_error(*run_cli(["plan", "--model", "tiny", "--cluster", "cpu-local", "--gpus",
                                "6", "--seq-len", "128", "--global-batch-seqs", "32", "-o", "-"]),
                      "--global-batch-seqs 32")
    assert_user_error(*run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "--seq-len",
                                "1048576", "-o", "-"]), "global batch")
    code, _, err = run_cli(["plan", "--model", "tiny", "--cluster", "cpu-local", "--gpus", "6",
                            "--seq-len", "128", "--global-batch-seqs", "36", "-o", "-"])
    assert code == 0 and err.startswith("note: --gpus 6 is not a whole number"), err
