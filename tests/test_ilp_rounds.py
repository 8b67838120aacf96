"""How the ILP's solves run: one HiGHS instance kept per model across its re-solves, and the
models' independent solves of one round in threads. Both must decide exactly as the plain
serial loop of freshly built solves does (the rule's correctness against the brute force is in
tests/test_solver.py and tests/test_preference.py)."""

from __future__ import annotations

import math

import pytest

import amsp_planner.solver.ilp as ilp
from amsp_planner.cost.job import Job
from amsp_planner.solver import SearchSpace, choice, rounds, session, solve
from amsp_planner.solver.space import MEMORY, Preference
from amsp_planner.specs import TrainingSpec, load_cluster, load_model

JOBS = [
    # four tensor-parallel degrees, quantized fastest, lossless chosen by the band
    ("llama-7b", "dgx-a100-hdr", 1024, 1024),
    ("llama2-70b", "dgx-h100-ndr", 512, 512),
    ("tiny", "cpu-local", 8, 32),
]


def _job(model, cluster, gpus, seqs):
    seq_len = 128 if model == "tiny" else 4096
    return Job.create(load_model(model), load_cluster(cluster),
                      TrainingSpec(seq_len=seq_len, global_batch_seqs=seqs), gpus)


def _decided(job, monkeypatch, threads):
    monkeypatch.setattr(rounds, "_threads", lambda models: min(len(models), threads))
    r = solve(job, runners_up=3, preference=Preference.default())
    return (str(r.best.strategy), r.best.time.step_s, r.best.memory.total,
            [str(e.strategy) for e in r.runners_up],
            str(r.fastest.strategy) if r.fastest else None,
            str(r.fastest_lossless.strategy) if r.fastest_lossless else None,
            r.stats.solves)


@pytest.mark.parametrize("case", JOBS, ids=lambda c: f"{c[0]}-{c[2]}")
def test_threaded_rounds_decide_as_the_serial_loop(case, monkeypatch):
    job = _job(*case)
    assert len(SearchSpace.for_job(job).by_tp()) > 1  # more than one model: rounds to share
    serial = _decided(job, monkeypatch, 1)
    assert _decided(job, monkeypatch, 4) == serial  # the same choice, references, solve count


def _steps(m):
    """A sequence of re-solves touching everything a kept HiGHS model must follow: the
    objective changed, bounds fixed and released, a cap set, rows (no-good cuts) added."""
    out = []
    m.snapshot, m.cuts = None, 0
    fastest = m._fastest()
    out.append(("fastest", fastest.objective, str(fastest.strategy)))
    m._fix_lossless(True)
    lossless = m._fastest()
    out.append(("lossless", lossless.objective, str(lossless.strategy)))
    least = m._tie_break(MEMORY, (m.cap, lossless.objective / m.T.time_unit * 1.1,
                                  choice.PHASE2_RTOLS))
    out.append(("memory under the cap", least, None))
    m._release()
    sol = fastest
    for i in range(3):
        sol = m._next_runner_up(sol)
        out.append((f"runner-up {i + 1}", sol.objective, str(sol.strategy)))
    return out


def test_a_kept_highs_model_solves_as_one_rebuilt_for_each_solve():
    job = _job("llama-7b", "dgx-a100-hdr", 1024, 1024)
    sp = SearchSpace.for_job(job).by_tp()[0]
    limit = Preference.default().usable(job.cluster.memory_bytes)
    kept = ilp.StrategyIlp(job, sp, limit)
    rebuilt = ilp.StrategyIlp(job, sp, limit)
    # PuLP's own path: the whole HiGHS model built from Python at every solve
    rebuilt._run_highs = lambda: rebuilt.prob.solve(rebuilt._solver())
    got, want = _steps(kept), _steps(rebuilt)
    assert kept._api is not None and rebuilt._api is None
    assert [s[0] for s in got] == [s[0] for s in want]
    for g, w in zip(got, want, strict=True):
        assert math.isclose(g[1], w[1], rel_tol=1e-9, abs_tol=1e-12), (g, w)
    # the cuts made the kept model's rows grow as the rebuilt one's constraints did
    assert kept.prob.solverModel.getNumRow() == rebuilt.prob.numConstraints()


def _root_gap(job, sp):
    """(optimum in seconds, relative gap of the LP relaxation's bound below it)."""
    import pulp

    m = ilp.StrategyIlp(job, sp, Preference.default().usable(job.cluster.memory_bytes))
    opt = m._fastest().objective
    for v in m.prob.variables():
        v.cat = pulp.LpContinuous
    with session.quiet_stdout():
        m.prob.solve(pulp.HiGHS(msg=False))
    bound = pulp.value(m.prob.objective) * m.T.time_unit
    return opt, (opt - bound) / opt


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_micro_batch_cuts_keep_the_optimum_and_tighten_the_root(tp, monkeypatch):
    """With several micro-batch sizes (llama-7b on 1024 GPUs: 1, 2, 4 or 8 sequences per
    data-parallel rank) the cuts of ``_add_micro_batch_cuts`` leave the optimum as it is (they
    are valid) and bring the LP relaxation's bound within 2 % of it; without them the big-M
    rows leave it more than 5 % below."""
    job = _job("llama-7b", "dgx-a100-hdr", 1024, 1024)
    sp = next(s for s in SearchSpace.for_job(job).by_tp() if s.tp == tp)
    assert len(set(sp.micro_batches)) > 1
    opt, gap = _root_gap(job, sp)
    monkeypatch.setattr(ilp.StrategyIlp, "_add_micro_batch_cuts", lambda self, *a: None)
    opt_plain, gap_plain = _root_gap(job, sp)
    assert math.isclose(opt, opt_plain, rel_tol=1e-9)
    assert 0 <= gap < 0.02
    assert gap_plain > 0.05


def test_idle_work_runs_once_beside_a_round_and_changes_nothing(monkeypatch):
    """``solve(idle=...)``: the caller's next work runs once, in the calling thread, while a
    later round of solves runs; the decision and solve count are those of a
    run without it, and an error in it does not reach the solve."""
    import threading

    job = _job("llama-7b", "dgx-a100-hdr", 1024, 1024)
    monkeypatch.setattr(rounds, "_threads", lambda models: min(len(models), 2))
    plain = solve(job, runners_up=3)
    calls = []

    def idle():
        calls.append(threading.current_thread() is threading.main_thread())
        raise RuntimeError("an output import that failed")

    r = solve(job, runners_up=3, idle=idle)
    assert calls == [True]
    assert (str(r.best.strategy), [str(e.strategy) for e in r.runners_up], r.stats.solves) == (
        str(plain.best.strategy), [str(e.strategy) for e in plain.runners_up], plain.stats.solves)
