"""Engines: the space each one runs, its behaviour in the prediction, and plans made for an
engine exporting to it exactly (its own config parsers accept them)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from amsp_testlib import assert_user_error, make_job, run_cli

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.engines import ENGINES
from amsp_planner.exports import TARGETS, target_module
from amsp_planner.exports import deepspeed as ds
from amsp_planner.exports import torchtitan as tt
from amsp_planner.plan import load_plan
from amsp_planner.solver import SearchSpace, solve
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy

N, R = 16, 8
FACTORS = (1, 2, 4, 8, 16)
GOLDEN = Path(__file__).parent / "golden"


def space_of(engine: str, tp: int | None = 1, **training) -> set[Strategy]:
    """The engine's space at tensor-parallel degree `tp` (None: every degree searched)."""
    job = make_job(N, **training).for_engine(engine)
    return set(SearchSpace.for_job(job, micro_batch=1, ckpt=False, tp=tp).candidates(job))


def triples(space) -> set[tuple[int, int, int]]:
    return {(s.s_p, s.s_g, s.s_os) for s in space}


# ----- the spaces, against hand-written lists -------------------------------------------------
def test_amsp_is_every_valid_strategy():
    # the oracle: every combination Strategy.check accepts (AMSP's rules, nothing more)
    want = set()
    for p, g, o, h, q, qg in itertools.product(FACTORS, FACTORS, FACTORS, (1, 2, 4, 8),
                                               (False, True), (False, True)):
        s = Strategy(s_p=p, s_g=g, s_os=o, hpz=h, qwz=q, qgz=qg)
        try:
            s.check(N, R)
        except ValueError:
            continue
        want.add(s)
    assert space_of("amsp") == want


def test_amsp_searches_every_tp_degree_with_the_rules_over_the_dp_ranks():
    # the oracle: every (tp, p, g, os, hpz, qwz, qgz) Strategy.check accepts, for the degrees
    # dividing the node and the small model's 4 heads (MHA): 1, 2 and 4
    want = set()
    for t, p, g, o, h, q, qg in itertools.product((1, 2, 4, 8), FACTORS, FACTORS, FACTORS,
                                                  (1, 2, 4, 8), (False, True), (False, True)):
        s = Strategy(s_p=p, s_g=g, s_os=o, hpz=h, qwz=q, qgz=qg, tp=t)
        try:
            s.check(N, R)
        except ValueError:
            continue
        if 4 % t == 0:
            want.add(s)
    got = space_of("amsp", tp=None)
    assert got == want and {s.tp for s in got} == {1, 2, 4}
    assert {s.tp for s in space_of("deepspeed", tp=None)} == {1}  # AutoTP has no SP
    # InternEvo: parallel.tensor (mode 'msp') with its zero1 shapes over the N/t DP ranks
    evo = space_of("internevo", tp=2)
    assert evo and {s.tp for s in evo} == {2}
    assert {(s.s_p, s.s_g, s.s_os) for s in evo} == {
        t for f in (1, 2, 4, 8) for t in ((1, 1, f), (f, f, f))}


def test_deepspeed_is_the_four_stages_and_zeropp_on_stage_3():
    got = space_of("deepspeed")
    assert triples(got) == {(1, 1, 1), (1, 1, 16), (1, 16, 16), (16, 16, 16)}
    stage3 = {s for s in got if s.s_p == 16}
    # hpZ 2, 4, 8 (divisors of the node below 16) x qwZ x qgZ, all on stage 3
    assert {(s.hpz, s.qwz, s.qgz) for s in stage3} == set(
        itertools.product((1, 2, 4, 8), (False, True), (False, True)))
    assert all(not (s.qwz or s.qgz or s.hpz > 1) for s in got - stage3)  # qgZ: stage 3 only
    assert len(got) == 3 + 16
    # no stage 0 with bf16 parameters and fp32 gradient accumulation
    assert triples(space_of("deepspeed", grad_accum_dtype="fp32")) == {
        (1, 1, 16), (1, 16, 16), (16, 16, 16)}


def test_fsdp2_torchtitan_internevo_shapes():
    fsdp2 = space_of("fsdp2")
    assert triples(fsdp2) == {(f, f, f) for f in FACTORS}
    assert not any(s.qwz or s.qgz for s in fsdp2)
    # reshard_after_forward=h: 1 < h < s, h | 8, h | s
    assert {(s.s_p, s.hpz) for s in fsdp2 if s.hpz > 1} == {
        (4, 2), (8, 2), (8, 4), (16, 2), (16, 4), (16, 8)}
    titan = space_of("torchtitan")
    assert titan == {Strategy(s_p=f, s_g=f, s_os=f) for f in FACTORS}
    evo = space_of("internevo")
    assert evo == {Strategy(s_os=f) for f in FACTORS} | {Strategy(s_p=f, s_g=f, s_os=f)
                                                         for f in FACTORS}


# ----- behaviour in the prediction ------------------------------------------------------------
def test_torchtitan_prices_fp32_gradient_reduction():
    job = make_job(N)  # bf16 gradients asked
    titan = job.for_engine("torchtitan")
    assert titan.training.grad_accum_dtype == "fp32"
    s = Strategy(s_p=N, s_g=N, s_os=N)
    a, b = evaluate(job, s), evaluate(titan, s)
    # gradient shards and the reduce-scatter's bytes are 4 B per element instead of 2
    assert b.memory.grads == 2 * a.memory.grads == job.phi / N * 4
    rs = [(x, y) for x, y in zip(a.schedule, b.schedule, strict=True)
          if x.op == "reduce_scatter"]
    assert rs and all(y.full_bytes_per_step == 2 * x.full_bytes_per_step for x, y in rs)
    assert b.step_s > a.step_s


def test_internevo_reduces_in_the_parameter_dtype():
    job = make_job(N, grad_accum_dtype="fp32")
    assert job.for_engine("internevo").training.grad_accum_dtype == "bf16"
    assert job.for_engine("fsdp2").training.grad_accum_dtype == "fp32"  # configurable there
    assert make_job(N, precision="fp32").for_engine("internevo").training.grad_bytes == 4


# ----- a plan made for E, exported to E ----------------------------------------------------
@pytest.fixture(scope="module", params=["llama-7b", "small"])
def jobs(request):
    if request.param == "small":
        return {e: make_job(N).for_engine(e) for e in ENGINES}
    base = make_job(64, model=load_model("llama-7b"), seq_len=4096, batch_seqs=1024)
    return {e: base.for_engine(e) for e in ENGINES}


@pytest.mark.parametrize("engine", TARGETS)
def test_plan_for_engine_exports_to_it_exactly(jobs, engine):
    job = jobs[engine]
    r = solve(job, runners_up=3)
    for e in [r.best, *r.runners_up]:
        s = e.strategy.with_(grad_accum=e.n_micro)
        out = target_module(engine).export(job, s)
        assert out.exact and out.closest == s and out.differences == (), (engine, s)
        if engine == "deepspeed":
            back = ds.strategy_from_ds_config(json.loads(out.text), job.num_gpus,
                                              job.gpus_per_node, ckpt=s.ckpt_value)
            assert back == s
        if engine == "torchtitan":
            doc = tt.check(out.text, job.num_gpus)
            assert doc["parallelism"]["data_parallel_shard_degree"] == s.s_p


@pytest.mark.parametrize("engine", TARGETS)
def test_amsp_plan_exported_to_an_engine_prices_the_change(jobs, engine):
    # an engine that cannot run the amsp plan as predicted (another strategy, or another
    # gradient dtype) says what changes and prices it as that engine runs it
    job = jobs["amsp"]
    best = solve(job, runners_up=0).best
    s = best.strategy.with_(grad_accum=best.n_micro)
    out = target_module(engine).export(job, s)
    tjob = job.for_engine(engine)
    assert out.closest in set(target_module(engine).candidates(job, s))
    from amsp_planner.engines import execution_differences

    if out.exact and tjob.training == job.training and not execution_differences(
            job.profile, tjob.profile):
        assert out.differences == ()
    else:
        cost = out.differences[-1]
        after = evaluate(tjob, out.closest)
        assert f"-> {after.step_s:.4f} s" in cost and f"-> {after.memory.total / 2**30:.2f} GiB" \
            in cost


def test_deepspeed_own_config_classes_accept_deepspeed_plans(jobs):
    pytest.importorskip("deepspeed")
    job = jobs["deepspeed"]
    r = solve(job, runners_up=5)
    stages = set()
    for e in [r.best, *r.runners_up]:
        s = e.strategy.with_(grad_accum=e.n_micro)
        cfg = json.loads(ds.export(job, s).text)
        got = ds.parse_with_deepspeed(cfg, job.num_gpus)
        assert got["stage"] == ds.stage_of(s, job.num_gpus)
        assert (got["hpz"], got["qwz"], got["qgz"]) == ((s.hpz, s.qwz, s.qgz) if got["stage"] == 3
                                                         else (1, False, False))
        assert got["micro_batch"] == s.micro_batch and got["grad_accum"] == e.n_micro
        stages.add(got["stage"])
    assert stages


def test_torchtitan_own_parser_accepts_torchtitan_plans(jobs):
    pytest.importorskip("torchtitan")
    job = jobs["torchtitan"]
    best = solve(job, runners_up=0).best
    text = tt.export(job, best.strategy.with_(grad_accum=best.n_micro)).text
    assert tt.check_with_torchtitan(text) == tt.check(text, job.num_gpus)


# ----- CLI and plan files ---------------------------------------------------------------------
def test_cli_engine_end_to_end(tmp_path):
    plan = tmp_path / "ds.json"
    args = ["--model", "llama-7b", "--gpus", "64", "--global-batch-seqs", "1024"]
    code, out, err = run_cli(["plan", *args, "--engine", "deepspeed", "--runners-up", "0",
                              "-o", str(plan)])
    assert code == 0, err
    doc = json.loads(plan.read_text())
    assert doc["inputs"]["engine"] == "deepspeed"
    p = load_plan(plan)
    assert p.job.engine == "deepspeed"
    code, out, err = run_cli(["export", str(plan), "--to", "deepspeed", "-o",
                              str(tmp_path / "ds_config.json")])
    assert code == 0, err
    assert "expresses the plan exactly" in out and "differs" not in out
    # to torchtitan: what changes and what it costs, two lines, not an error
    code, out, err = run_cli(["export", str(plan), "--to", "torchtitan", "-o",
                              str(tmp_path / "tt.args")])
    assert code == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("  differs:")
             or ln.startswith("  costs:")]
    assert [ln.split(":")[0] for ln in lines] == ["  differs", "  costs"]
    assert "gradient dtype bf16 -> fp32" in lines[0]
    code, out, err = run_cli(["explain", str(plan), "--engine", "torchtitan"])
    assert code == 0, err
    assert out.startswith("engine: torchtitan (the plan was made for deepspeed)")


def test_explain_on_another_engine_prices_the_alternatives_on_it_too(tmp_path):
    # a plan made for FSDP2 at ZeRO-3 and explained as DeepSpeed runs it: the zero3 baseline is
    # the plan's own sharding, so on the same engine it is the same step and memory; the plan
    # file's figures for it are FSDP2's, which DeepSpeed prices several times slower
    plan = tmp_path / "fsdp2.json"
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "1024", "--engine",
                              "fsdp2", "--strategy", "zero3", "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan), "--engine", "deepspeed", "--no-sensitivity"])
    assert code == 0, err
    zero3 = next(ln for ln in out.splitlines() if ln.lstrip().startswith("zero3 "))
    assert "+0.00% step time, +0.00 GiB; differs by same sharding" in zero3, zero3


def test_explain_on_an_engine_that_cannot_run_some_alternatives(tmp_path):
    """A tp=2 plan explained as DeepSpeed runs it: DeepSpeed runs no tensor parallelism, so
    the plan is priced at its closest tp=1 strategy and the tp=2 alternatives are listed as
    not run, with the reason (the explanation ended in a refusal naming a --strategy the
    user never gave). A pipeline plan on an engine that does not run its stages is priced at
    the closest data-parallel strategy the engine runs, at that strategy's own accumulation
    (the pipeline's made every candidate invalid, and the explanation was refused)."""
    plan = tmp_path / "tp2.json"
    code, _, err = run_cli(["plan", "--model", "tiny", "--gpus", "8", "--cluster", "cpu-local",
                            "--seq-len", "128", "--global-batch-seqs", "32", "--strategy",
                            "tp=2,p=4,g=4,os=4,mb=1", "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan), "--engine", "deepspeed", "--no-sensitivity"])
    assert code == 0, err
    skipped = [ln for ln in out.splitlines() if "not run by deepspeed" in ln]
    assert skipped and all("does not run tensor parallelism" in ln for ln in skipped)
    pp = tmp_path / "pp.json"
    code, _, err = run_cli(["plan", "--model", "tiny", "--gpus", "8", "--cluster", "cpu-local",
                            "--seq-len", "128", "--global-batch-seqs", "32", "--strategy",
                            "pp=2,p=1,g=1,os=4,mb=1", "-o", str(pp)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(pp), "--engine", "fsdp2", "--no-sensitivity"])
    assert code == 0, err
    head = out.splitlines()[0]
    assert head.startswith("engine: fsdp2 (the plan was made for amsp) runs p=")
    assert "pp=" not in head and "the closest strategy it runs" in head
    assert_user_error(*run_cli(["export", "--to", "fsdp2", str(pp), "-o", "-"]),
                      "--to fsdp2: ")


def test_cli_engine_note_and_bad_value(tmp_path):
    args = ["--model", "llama-7b", "--gpus", "64"]
    code, out, err = run_cli(["compare", *args, "--engine", "torchtitan"])
    assert code == 0, err
    assert "torchtitan 0.3 reduces gradients in float32 only" in err
    for cmd in ("plan", "compare"):
        code, out, err = run_cli([cmd, *args, "--engine", "colossalai"])
        assert_user_error(code, out, err, "--engine", "colossalai", "deepspeed", "megatron")
    code, out, err = run_cli(["explain", str(GOLDEN / "tiny_cpu-local_8.json"), "--engine", "x"])
    assert_user_error(code, out, err, "--engine", "amsp")


def test_older_plan_files_load_as_amsp():
    for path in GOLDEN.glob("*.json"):
        doc = json.loads(path.read_text())
        assert "engine" not in doc["inputs"]
        assert load_plan(path).job.engine == "amsp"


def test_whatif_engine_keeps_every_point_in_its_space():
    code, out, err = run_cli(["whatif", "--model", "llama-7b", "--gpus", "16,64", "--engine",
                              "torchtitan", "-j", "1", "--format", "csv"])
    assert code == 0, err
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 2
    for row in rows:
        s = Strategy.parse(row["strategy"])
        assert s.s_p == s.s_g == s.s_os and s.hpz == 1 and not (s.qwz or s.qgz), row
