"""Single-process checks of the failure handling: the verdict on hand-built schedules, the
launcher's choice of the root cause from rank records and torchrun's report, the named causes
of known exceptions, the exit codes, and the unit-by-unit initialisation against the draw it
must reproduce bit for bit."""

from __future__ import annotations

import errno
import json
import math

import pytest

torch = pytest.importorskip("torch")

from amsp_planner.runtime import faults  # noqa: E402
from amsp_planner.runtime.verdict import verdict  # noqa: E402


def _row(x):
    return None if x is None else {"calls_per_step": x[0], "full_bytes_per_step": x[1]}


def _entry(phase, op, group, planned, measured):
    as_row = _row
    return {"phase": phase, "op": op, "group": group, "planned": as_row(planned),
            "measured": as_row(measured)}


def test_verdict_matches_when_every_entry_is_equal():
    rows = [_entry("forward", "all_gather", "P", (4, 1000), (4, 1000)),
            _entry("update", "all_reduce", "world", (1, 8), (1, 8))]
    assert verdict(rows) == (True, "verdict: all 2 schedule entries match the plan (calls and "
                                   "bytes per step)")


def test_verdict_names_the_entries_that_differ(monkeypatch):
    monkeypatch.delenv("AMSP_GLOO_RS_AS_ALL_REDUCE", raising=False)
    rows = [_entry("forward", "all_gather", "P", (4, 1000), (4, 1000)),
            _entry("backward", "reduce_scatter", "G", (8, 2048), None),
            _entry("backward", "all_reduce", "G", None, (8, 2048))]
    ok, line = verdict(rows)
    assert not ok
    assert line == ("verdict: 2 of 3 schedule entries differ from the plan: backward/"
                    "reduce_scatter/G planned 8 calls, 2,048 B, measured none; backward/"
                    "all_reduce/G planned none, measured 8 calls, 2,048 B")
    monkeypatch.setenv("AMSP_GLOO_RS_AS_ALL_REDUCE", "1")  # asked for: named, not a failure
    assert verdict(rows) == (True, "verdict: the schedule matches the plan except the "
                                   "substitution asked for with AMSP_GLOO_RS_AS_ALL_REDUCE=1: "
                                   "backward/reduce_scatter/G as all_reduce")
    rows[2] = _entry("backward", "all_reduce", "G", None, (8, 4096))  # not the same tensor
    assert not verdict(rows)[0]


def test_a_byte_difference_alone_fails_the_verdict():
    rows = [_entry("forward", "all_gather", "P", (4, 1000), (4, 1002))]
    ok, line = verdict(rows)
    assert not ok and "forward/all_gather/P planned 4 calls, 1,000 B, measured 4 calls, 1,002 B" in line


def _write(run, rank, **kw):
    (run / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **kw}))


TORCHRUN_REPORT = """Failures:
[1]:
  time      : 2026-12-01_11:21:33
  host      : h
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 16249)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 4 (pid: 16248)
"""


def test_summary_prefers_a_primary_cause_over_peer_losses(tmp_path):
    _write(tmp_path, 0, step=7, cause="lost a peer while running the forward of unit 2 (...)",
           primary=False, type="RuntimeError")
    _write(tmp_path, 3, step=7, cause="out of memory while running the backward of unit 5",
           primary=True, type="RuntimeError")
    assert faults.summary(tmp_path, 4, "", 1) == (
        "rank 3, step 7: out of memory while running the backward of unit 5")


def test_summary_names_the_silent_rank_with_torchruns_exit_code_and_its_step(tmp_path):
    _write(tmp_path, 0, step=12, cause="lost a peer", primary=False, type="RuntimeError")
    (tmp_path / "rank1.step").write_text("12")
    assert faults.summary(tmp_path, 2, TORCHRUN_REPORT, 1) == (
        "rank 1, step 12: the process was killed by signal 9 without an error")


def test_summary_names_a_hung_rank_as_such(tmp_path):
    """Rank 1 stops (SIGSTOP): rank 0 times out waiting for it, torchrun kills it with SIGKILL.
    Not 'killed by signal 9 without an error': nobody killed it from outside."""
    _write(tmp_path, 0, step=14, primary=False, type="RuntimeError",
           cause="lost a peer while running the forward of unit 1 ([../third_party/gloo/gloo/"
                 "transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv)")
    (tmp_path / "rank1.step").write_text("14")
    assert faults.summary(tmp_path, 2, TORCHRUN_REPORT, 1) == (
        "rank 1, step 14: the process stopped responding: the other ranks timed out waiting "
        "for it (--timeout), then it was killed")


def test_summary_names_the_rank_that_died_not_those_the_agent_ended(tmp_path):
    """Rank 2 kills itself at step 3; on a loaded host the survivors, blocked in a collective,
    are ended by torchrun's SIGTERM before they record anything: rank 2 is the cause, not
    rank 0 (seen in the full suite)."""
    report = "".join(f"[{i}]:\n  rank      : {k} (local_rank: {k})\n  exitcode  : {c} (pid: 1)\n"
                     for i, (k, c) in enumerate([(0, -15), (1, -15), (2, 9), (3, -15)]))
    for k in range(4):
        (tmp_path / f"rank{k}.step").write_text("3")
    assert faults.summary(tmp_path, 4, report, 1) == (
        "rank 2, step 3: the process exited with code 9 without an error")


def test_summary_without_any_record(tmp_path):
    assert faults.summary(tmp_path, 2, "", 1) == (
        "the training job failed (exit code 1) before any rank reported")


def test_summary_of_an_agent_stopped_by_a_signal_after_steps_ran(tmp_path):
    """SIGTERM to the torchrun agent mid-run: named as such, with the step reached (it read
    'failed (exit code 1) before any rank reported' after 16 steps)."""
    (tmp_path / "rank0.step").write_text("16")
    (tmp_path / "rank1.step").write_text("15")
    log = ("torch.distributed.elastic.multiprocessing.api.SignalException: Process 24459 got "
           "signal: 15\n")
    assert faults.summary(tmp_path, 2, log, 1) == (
        "the torchrun agent was stopped by signal 15 (SIGTERM) after step 16, its ranks with it")


def test_named_causes_of_known_exceptions():
    faults.at(step=3, doing="saving checkpoint step_40 in /ck")
    full = OSError(errno.ENOSPC, "No space left on device", "/ck/step_40.tmp/__1_0.distcp")
    assert faults.cause(full) == ("no space left on device while saving checkpoint step_40 in "
                                  "/ck (/ck/step_40.tmp/__1_0.distcp)", True)
    faults.at(doing="running the forward of unit 7")
    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't "
                       "allocate memory: you tried to allocate 2254857830 bytes. Error code 12")
    # 2254857830 B = 2.10 GiB
    assert faults.cause(oom) == ("out of memory while running the forward of unit 7 (an "
                                 "allocation of 2.10 GiB failed)", True)
    peer = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:389")
    assert faults.cause(peer)[1] is False
    assert faults.line(oom, 5) == ("rank 5, step 3: out of memory while running the forward of "
                                   "unit 7 (an allocation of 2.10 GiB failed)")


def test_a_checkpoint_exception_is_named_by_the_rank_failure_inside_it():
    """torch.distributed.checkpoint wraps each rank's failure: a folder turned read-only
    mid-run is named as such (it read 'CheckpointException ranks:dict_keys([0, 1, 2, 3])')."""
    from torch.distributed.checkpoint.api import CheckpointException

    faults.at(step=16, doing="saving checkpoint step_16 in rockpt")
    ro = OSError(errno.EROFS, "Read-only file system", "rockpt/step_16.tmp")
    wrapped = CheckpointException("save failed", {2: (RuntimeError("peer"), None), 0: (ro, None)})
    assert faults.cause(wrapped) == ("read-only file system while saving checkpoint step_16 in "
                                     "rockpt (rockpt/step_16.tmp)", True)


def test_exit_codes_are_fixed():
    assert (faults.EXIT_REFUSED, faults.EXIT_INFEASIBLE, faults.EXIT_RANK_FAILED,
            faults.EXIT_DIFFERS) == (2, 3, 4, 5)


def test_a_failed_verdict_makes_the_launcher_exit_5(tmp_path):
    from amsp_planner.runtime.launch import _outcome

    for ok, code in ((False, 5), (True, 0)):
        run = tmp_path / str(ok)
        run.mkdir()
        (run / "verdict.json").write_text(json.dumps({"ok": ok, "line": "verdict: ..."}))
        assert _outcome(run, 0, "", 2, {}) == code
        assert not run.exists()  # the run folder goes once the job succeeded


def _draw_whole_units(model, index, seed):
    """The initialisation the runtime has always used (its parity oracle and checkpoints
    depend on it): one generator per (seed, unit), each matrix drawn N(0, 1) in order and
    scaled, norms at 1, the unit concatenated."""
    from amsp_planner.runtime.model import INIT_STD, unit_param_specs

    g = torch.Generator().manual_seed(seed * 100003 + index)
    parts = []
    for name, shape in unit_param_specs(model)[index]:
        if len(shape) == 1:
            parts.append(torch.ones(shape))
            continue
        std = INIT_STD / math.sqrt(2 * model.num_layers) if name in ("wo", "w2") else INIT_STD
        parts.append(torch.randn(shape, generator=g) * std)
    return torch.cat([p.reshape(-1) for p in parts])


@pytest.mark.parametrize("seed", [0, 7])
def test_unit_by_unit_initialisation_is_bit_identical(seed):
    from amsp_planner.runtime.model import init_unit
    from amsp_planner.specs.loader import load_model

    spec = load_model("tiny")
    for i, n in enumerate(spec.unit_params()):
        out = torch.full((n + 5,), -1.0)  # padded, as the engine's unit buffer
        init_unit(spec, i, seed, out=out)
        assert torch.equal(out[:n], _draw_whole_units(spec, i, seed))
        assert torch.equal(out[n:], torch.full((5,), -1.0))


def test_host_checks_of_a_gpu_plan_and_of_an_oversubscribed_host():
    import os

    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.cost.job import Job
    from amsp_planner.runtime.preflight import MAX_RANKS_PER_CORE, host_problems
    from amsp_planner.specs.loader import load_cluster, load_model
    from amsp_planner.specs.training import TrainingSpec
    from amsp_planner.strategy import baseline

    cores = os.cpu_count()
    world = 4 * (MAX_RANKS_PER_CORE * cores // 4 + 1)  # just over 4 ranks per core
    t = TrainingSpec(seq_len=32, global_batch_seqs=2 * world, precision="fp32")
    job = Job.create(load_model("tiny"), load_cluster("cpu-local"), t, world)
    ev = evaluate(job, baseline("zero3", world, job.gpus_per_node))
    assert host_problems(job, ev, cuda=False, ranks_here=world) == [
        f"{world} ranks on this host's {cores} cores (at most {MAX_RANKS_PER_CORE} per core): "
        "re-plan with fewer --gpus"]
    assert host_problems(job, ev, cuda=False, ranks_here=4) == []
    assert host_problems(job, ev, cuda=True, ranks_here=4)[0].startswith(
        "the plan is for CPU processes (cpu-local) but CUDA is available")


def test_cuda_check_agrees_with_torch():
    from amsp_planner.runtime.preflight import cuda_available

    assert cuda_available() == torch.cuda.is_available()


def test_a_refused_train_imports_no_torch(tmp_path):
    """The launcher's refusals come before any torch import (seconds of a core each)."""
    import subprocess
    import sys

    from amsp_testlib import run_cli

    plan = tmp_path / "p2.json"
    code, _, err = run_cli(["plan", "--model", "tiny", "--gpus", "2", "--cluster", "cpu-local",
                            "--strategy", "zero3", "--seq-len", "32", "--global-batch-seqs", "4",
                            "-o", str(plan)])
    assert code == 0, err
    probe = ("import sys\nfrom amsp_planner.cli.main import main\ntry:\n    main(sys.argv[1:])\n"
             "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    for args in (["--report", str(plan)], ["--checkpoint-every", "2"],
                 ["--checkpoint-dir", str(tmp_path / "none"), "--resume", "--resume-from", "2"]):
        r = subprocess.run([sys.executable, "-c", probe, "train", str(plan), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.split() == ["2", "False"], (args, r.stdout, r.stderr)
        assert r.stderr.startswith("error: --") and len(r.stderr.splitlines()) == 1, r.stderr


def test_data_faults_during_the_run_name_the_file(tmp_path):
    """Token ids past the vocabulary beyond the 2**22 tokens checked before the run, and a
    token file cut short while mapped: each a fault naming --data (an IndexError in the
    forward, and a SIGBUS that killed the rank without a word)."""
    import numpy as np

    from amsp_planner.runtime.data import TokenSource

    bad = tmp_path / "late_bad.bin"
    a = np.full(2**23, 7, dtype=np.uint16)
    a[2**22:] = 60000  # past the first 2**22 tokens
    a.tofile(bad)
    src = TokenSource(str(bad), vocab_size=256, seq_len=32, batch_seqs=8)
    with pytest.raises(faults.RunFault, match=r"--data .*late_bad.bin: token id 60000 .* is "
                                              r"not below the model's vocab_size 256"):
        for step in range(20):
            src.batch(step)
    good = tmp_path / "cut.bin"
    np.full(4096, 7, dtype=np.uint16).tofile(good)
    src = TokenSource(str(good), vocab_size=256, seq_len=32, batch_seqs=8)
    assert src.batch(0).shape == (8, 33)
    with open(good, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(faults.RunFault, match=r"cut.bin changed during the run: 8,192 bytes "
                                              r"when it started, now 1,000 bytes"):
        src.batch(1)
