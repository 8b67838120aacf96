"""The runtime under a launch it did not start: an external torchrun (through
``amsp_planner.runtime.torchrun``, which ends with the job's code) and rank processes started
directly with torch.distributed's or SLURM's variables, as srun starts them. Each case asserts
every process's exit code and the one ``error:`` line of the job."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from amsp_planner.runtime.torchrun import job_exit  # noqa: E402

from .mp import env, free_port, make_plan, torchrun_cmd  # noqa: E402

ENTRY = ["-m", "amsp_planner.runtime.launch"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("external")
    return {"dir": tmp, "p2": make_plan(tmp, "p2.json", 2)}


def _errors(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("error:")]


def wrapped(plan, nproc: int, *args, cwd, timeout=120) -> subprocess.CompletedProcess:
    """``python -m amsp_planner.runtime.torchrun`` with torchrun's own arguments."""
    cmd = ([sys.executable, "-m", "amsp_planner.runtime.torchrun"]
           + torchrun_cmd(nproc, free_port())[3:] + ENTRY + [str(plan), *map(str, args)])
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def direct(plan, world: int, *args, cwd, slurm=False, timeout=120
           ) -> list[subprocess.CompletedProcess]:
    """`world` rank processes started directly (no agent): torch.distributed's variables, or
    only SLURM's (srun's tasks) with MASTER_ADDR exported."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        e = env()
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            e.pop(k, None)
        if slurm:
            e.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank),
                     SLURM_NTASKS_PER_NODE=f"{world}(x1)", SLURM_NODEID="0", MASTER_PORT=port)
        else:
            e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                     MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, *ENTRY, str(plan), *map(str, args)],
                                      cwd=cwd, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    finally:
        for p in procs:
            p.kill()
    return out


# ----- the job's code from torchrun's failure records (single process) -----------------------
def test_job_exit_from_the_failed_workers_codes():
    term = -signal.SIGTERM  # stopped by the agent once another worker had failed
    assert job_exit({0: 2, 1: term}) == (2, None)
    assert job_exit({1: 2, 0: 2}) == (2, None)
    assert job_exit({0: 4, 1: term}) == (4, None)
    assert job_exit({0: 4, 1: 9}) == (4, "rank 1: the process exited with code 9 without an "
                                          "error")
    assert job_exit({3: -9, 2: term}) == (4, "rank 3: the process was killed by signal 9 "
                                             "without an error")
    assert job_exit({0: 5, 1: 5}) == (5, None)
    assert job_exit({0: 1}) == (4, "rank 0: the process exited with code 1 without an error")
    assert job_exit({0: term, 1: term}) == (4, None)


# ----- an external torchrun ------------------------------------------------------------------
@pytest.mark.multiprocess
def test_a_killed_rank_under_torchrun_ends_with_4_and_names_it(plans):
    r = wrapped(plans["p2"], 2, "--steps", 3, "--fail-at-step", 2, "--fail-rank", 1,
                "--timeout", 20, cwd=plans["dir"])
    assert r.returncode == 4, r.stderr[-3000:]
    assert _errors(r.stderr) == ["error: rank 1: the process exited with code 9 without an "
                                 "error"], r.stderr[-3000:]


# ----- rank processes started directly (srun) ------------------------------------------------
@pytest.mark.multiprocess
def test_direct_ranks_refuse_alike_before_any_process_group(plans):
    """A report path equal to the plan: every rank refuses before the rendezvous (which, with
    a rank missing, would otherwise wait), exit 2, one line (rank 0's)."""
    plan = plans["p2"]
    rs = direct(plan, 2, "--report", plan, cwd=plans["dir"])
    assert [r.returncode for r in rs] == [2, 2], [r.stderr[-2000:] for r in rs]
    assert [_errors(r.stderr) for r in rs] == [
        [f"error: --report {plan}: is an input of this run (the plan or the data): give "
         "another path"], []]
    rs = direct(plan, 1, cwd=plans["dir"])  # one process of a 2-rank plan: no peer to wait for
    assert rs[0].returncode == 2
    assert _errors(rs[0].stderr) == [
        "error: plan is for 2 GPUs but the job has 1 processes: launch 2 (e.g. torchrun "
        "--nproc-per-node=2 --nnodes=1) or re-plan with --gpus 1"]


@pytest.mark.multiprocess
def test_srun_tasks_exit_with_the_fixed_codes(plans):
    """SLURM's variables only: a missing MASTER_ADDR is refused on every task (exit 2); a
    non-finite step ends every task with 4 and one line, rank 0's."""
    tmp = plans["dir"]
    e = env()
    e.pop("MASTER_ADDR")
    e.update(SLURM_PROCID="0", SLURM_NTASKS="2")
    r = subprocess.run([sys.executable, *ENTRY, str(plans["p2"])], cwd=tmp, env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and _errors(r.stderr) == [
        "error: SLURM launch: MASTER_ADDR is not set: export the first node's host name as "
        "MASTER_ADDR before srun"], r.stderr[-2000:]
    rs = direct(plans["p2"], 2, "--steps", 3, "--fail-at-step", 2, "--fail-rank", 1,
                "--fail-mode", "nan", "--timeout", 20, cwd=tmp, slurm=True)
    assert [r.returncode for r in rs] == [4, 4], [r.stderr[-2000:] for r in rs]
    errs = [_errors(r.stderr) for r in rs]
    assert len(errs[0]) == 1 and errs[1] == [], errs
    assert errs[0][0].startswith("error: rank 0, step 2: non-finite training (loss ")
    assert errs[0][0].endswith("grad-norm nan): stopped before saving (--on-nonfinite skip "
                               "skips such steps instead)")
