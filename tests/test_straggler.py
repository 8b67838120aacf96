"""Waiting on the other ranks (cost/straggler.py): E[max of N standard normals] against its
closed forms and Harter's published table, the jitter term at 1 and N ranks by hand, the
pipeline's N (every rank, not the stage's), the per-(call, rank) sync term by counting calls
by hand, and a cluster without either priced and written as before."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from amsp_testlib import make_job, small_model

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.straggler import expected_max_normal, straggler_seconds
from amsp_planner.specs import load_cluster
from amsp_planner.strategy import Strategy


def test_expected_max_has_the_closed_forms_at_1_2_3():
    # one rank waits for nobody; max of two: 1/sqrt(pi); of three: 3/(2 sqrt(pi))
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-6)


@pytest.mark.parametrize("n, harter", [(4, 1.02938), (10, 1.53875), (100, 2.50759),
                                       (1000, 3.24144)])
def test_expected_max_matches_harter_1961(n, harter):
    # H. L. Harter, "Expected values of normal order statistics", Biometrika 48 (1961), table 1
    assert expected_max_normal(n) == pytest.approx(harter, abs=2e-5)


def test_expected_max_refuses_no_ranks():
    with pytest.raises(ValueError, match="n >= 1"):
        expected_max_normal(0)


def test_straggler_seconds_by_hand():
    # 2 s of compute, cv 2 %: one rank 0; two ranks 0.02 x 2 / sqrt(pi) = 22.57 ms;
    # 1,000 ranks 0.02 x 2 x 3.24144 = 129.66 ms; no jitter: 0
    assert straggler_seconds(2.0, 1, 0.02) == 0.0
    assert straggler_seconds(2.0, 2, 0.02) == pytest.approx(0.0225676, rel=1e-5)
    assert straggler_seconds(2.0, 1000, 0.02) == pytest.approx(0.1296576, rel=1e-5)
    assert straggler_seconds(2.0, 1000, 0.0) == 0.0


def _with_jitter(job, cv):
    return replace(job, cluster=job.cluster.model_copy(update={"rank_jitter": cv}))


def test_step_waits_for_the_slowest_of_n_ranks():
    job = make_job(16)
    s = Strategy.parse("p=16,g=16,os=16,mb=1")
    base = evaluate(job, s).time
    t = evaluate(_with_jitter(job, 0.03), s).time
    # everything else as before; the excess is cv x the rank's compute x e(16) = 1.76599
    assert base.straggler_s == 0.0
    assert t.compute_s == base.compute_s and t.exposed_comm_s == base.exposed_comm_s
    assert t.straggler_s == pytest.approx(0.03 * (base.compute_s + base.kernel_s) * 1.76599,
                                          rel=1e-4)
    assert t.step_s == pytest.approx(base.step_s + t.straggler_s)
    one, s1 = make_job(1), Strategy.parse("p=1,g=1,os=1,mb=1")
    assert evaluate(_with_jitter(one, 0.03), s1).time.step_s == evaluate(one, s1).time.step_s


def test_pipeline_waits_for_every_rank_not_the_stage():
    # 16 GPUs, pp=2: the stage's job has 8 ranks, the step's syncs span all 16 (e(16), not e(8))
    job = make_job(16, model=small_model(num_layers=4), batch_seqs=32)
    t = evaluate(_with_jitter(job, 0.02), Strategy.parse("pp=2,mb=1")).time
    assert t.straggler_s == pytest.approx(0.02 * (t.compute_s + t.kernel_s) * 1.76599, rel=1e-4)


def test_no_jitter_is_the_default_and_is_not_written():
    c = load_cluster("dgx-a100-hdr")
    assert c.rank_jitter == 0.0 and "rank_jitter" not in c.model_dump()
    assert c.collective_rank_us == 0.0 and "collective_rank_us" not in c.model_dump()
    assert "rank_jitter" in c.model_copy(update={"rank_jitter": 0.01}).model_dump()
    t = evaluate(make_job(16), Strategy.parse("p=16,g=16,os=16,mb=1")).time
    assert "straggler_s" not in t.to_dict()


def _with_sync(job, us):
    return replace(job, cluster=job.cluster.model_copy(update={"collective_rank_us": us}))


@pytest.mark.parametrize("strategy, rank_calls", [
    # ZeRO-3 over 16 GPUs, 32 sequences at mb=1: 2 micro-batches; 4 units (embedding, 2 blocks,
    # head), each gathered in forward and backward and reduce-scattered per micro-batch: 24
    # calls of 16 ranks, plus the step's gradient-norm all-reduce over the 16: 25 x 16 = 400
    ("p=16,g=16,os=16,mb=1", 400),
    # DDP: one all-reduce per unit on the last micro-batch (4) and the norm's (1): 5 x 16 = 80
    ("p=1,g=1,os=1,mb=1", 80),
    # HSDP 8 x 2: 24 calls of 8 ranks, 4 replica all-reduces of 2, the norm's of 16: 216
    ("p=8,g=8,os=8,mb=1", 216),
])
def test_sync_is_microseconds_per_rank_of_every_data_parallel_call(strategy, rank_calls):
    job, s = make_job(16), Strategy.parse(strategy)
    base = evaluate(job, s).time
    t = evaluate(_with_sync(job, 2.0), s).time
    assert base.sync_s == 0.0 and "sync_s" not in base.to_dict()
    assert t.sync_s == pytest.approx(2e-6 * rank_calls)
    assert t.step_s == pytest.approx(base.step_s + t.sync_s)


def test_sync_leaves_tensor_parallel_calls_alone():
    # tp=2 x DDP 8: the TP all-reduces are on the critical path already; only the data-parallel
    # ones count, so the term equals DDP-over-8's count: 4 unit all-reduces of 8 on the last
    # micro-batch and the norm's over all 16
    job = make_job(16)
    t = evaluate(_with_sync(job, 1.0), Strategy.parse("tp=2,p=1,g=1,os=1,mb=1")).time
    assert t.tp_comm_s > 0
    assert t.sync_s == pytest.approx(1e-6 * (4 * 8 + 16))


@pytest.mark.parametrize("field,value", [("rank_jitter", 0.05), ("collective_rank_us", 2.0)])
def test_the_search_runs_with_the_terms_set_and_says_it_enumerates(field, value):
    """Both terms are documented cluster fields: a plan, its explain and its export run (they
    once crashed on the ILP's agreement check), the note says the search enumerates (the ILP
    does not carry the terms), the plan records that solver, and its figures include the
    term."""
    import json
    import tempfile
    from pathlib import Path

    from amsp_testlib import run_cli

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "p.json"
        code, _, err = run_cli(["plan", "--model", "tiny", "--gpus", "8", "--cluster",
                                "cpu-local", "--seq-len", "128", "--global-batch-seqs", "32",
                                "--set", f"{field}={value}", "-o", str(out)])
        assert code == 0, err
        assert "the search enumerates (--solver exhaustive, exact)" in err
        doc = json.loads(out.read_text())
        assert doc["solver"]["name"] == "exhaustive"
        t = doc["predictions"]["time"]
        assert t["straggler_s" if field == "rank_jitter" else "sync_s"] > 0
        for argv in (["explain", str(out)], ["export", "--to", "fsdp2", str(out), "-o", "-"]):
            code, _, err = run_cli(argv)
            assert code == 0, (argv, err)


def test_the_step_breakdown_names_both_terms_and_adds_up():
    """`amsp plan` and `amsp explain` list the slowest rank's lag and the per-rank sync in the
    step's sum (they were left out, so the parts no longer added up to the step)."""
    import json
    import re
    import tempfile
    from pathlib import Path

    from amsp_testlib import run_cli

    def parts(line: str) -> float:
        body = line.split(" = ", 1)[1].split(";")[0]
        total = 0.0
        for item in body.split(" + "):
            v, unit = re.search(r"([\d.]+) (ms|s)\b", item).groups()
            total += float(v) * (1e-3 if unit == "ms" else 1.0)
        return total

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "p.json"
        code, stdout, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "512", "--set",
                                     "collective_rank_us=2", "--set", "rank_jitter=0.02",
                                     "-o", str(out), "--format", "table"])
        assert code == 0, err
        t = json.loads(out.read_text())["predictions"]["time"]
        assert t["straggler_s"] > 0 and t["sync_s"] > 0
        code, explained, err = run_cli(["explain", str(out), "--no-sensitivity"])
        assert code == 0, err
        for line in (next(x for x in stdout.splitlines() if x.startswith("step time ")),
                     next(x for x in explained.splitlines() if x.startswith("step "))):
            assert "the slowest rank's lag" in line and "per-rank sync" in line, line
            assert parts(line) == pytest.approx(t["step_s"], abs=2e-3), line
