"""The training job's life cycle on 4 ranks (gloo): Ctrl-C, SIGTERM to the launcher and
SIGKILL to the torchrun agent each end every process of the job within 10 s, keep the last
complete checkpoint (and no partial one), and the checkpoints the interrupted jobs leave
resume bit-exact: a job stopped by Ctrl-C and its resumption stopped by SIGTERM save the same
shard bytes (their SHA-256) at the same step as one uninterrupted run. A second job on the folder of a live
job is refused in one line naming the folder and the holder.

Every process of a job carries a tag in its environment, so the check for leftovers scans
/proc for it (orphans re-parented to init included).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

from .mp import AMSP, amsp, env, make_plan, one_error_line  # noqa: E402

TAG = "AMSP_TEST_LIFECYCLE"
STEPS = 1000  # more than any job here runs: each is stopped from outside
LEFT_S = 10.0


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries `tag` (zombies have none)."""
    out = []
    needle = f"{TAG}={tag}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d))
        except OSError:
            continue
    return out


def _start(plan: Path, ck: Path, tag: str, *extra) -> subprocess.Popen:
    """`amsp train` in a process group of its own (as a shell's foreground job)."""
    args = [*AMSP, "train", str(plan), "--steps", str(STEPS), "--checkpoint-dir", str(ck),
            "--checkpoint-every", "1", "--timeout", "30", *map(str, extra)]
    return subprocess.Popen(args, cwd=plan.parent, env={**env(), TAG: tag},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _latest(ck: Path) -> int | None:
    from amsp_planner.runtime.ckpt_files import latest_step

    try:
        return latest_step(ck)
    except Exception:  # noqa: BLE001 - replaced while read
        return None


def _wait_for_checkpoint(job: subprocess.Popen, ck: Path, after: int, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        k = _latest(ck)
        if k is not None and k > after:
            return k
        assert job.poll() is None, job.communicate()[1][-3000:]
        time.sleep(0.2)
    job.kill()
    raise AssertionError(f"no checkpoint after step {after} within {timeout} s")


def _ended(job: subprocess.Popen, tag: str) -> tuple[int, str]:
    """The job's exit code and stderr (its stdout kept in ``job.out``); no process of it is
    left LEFT_S after the signal."""
    t0 = time.monotonic()
    try:
        job.out, err = job.communicate(timeout=LEFT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        raise AssertionError("the launcher did not exit within 10 s") from None
    while _tagged(tag) and time.monotonic() - t0 < LEFT_S:
        time.sleep(0.2)
    left = _tagged(tag)
    for p in left:  # never leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes left {LEFT_S} s after the signal: {left}"
    return job.returncode, err


def _sound(ck: Path) -> int:
    """The latest checkpoint verifies against its checksums; no partial one is left."""
    from amsp_planner.runtime.ckpt_files import verify

    k = _latest(ck)
    verify(ck / f"step_{k}")
    assert not list(ck.glob("*.tmp")), list(ck.glob("*"))
    return k


def _agent_of(pid: int) -> int:
    from amsp_planner.runtime.lifecycle import children

    for c in children(pid):
        if b"amsp_planner.runtime.agent" in Path(f"/proc/{c}/cmdline").read_bytes():
            return c
    raise AssertionError("no torchrun agent under the launcher")


def _shards(step_dir: Path) -> dict:
    sums = json.loads((step_dir / "checksums.json").read_text())
    return {k: v for k, v in sums.items() if k.endswith(".distcp")}


@pytest.mark.multiprocess
def test_ctrl_c_sigterm_and_a_killed_agent_end_every_process_and_keep_the_checkpoint(
        tmp_path):
    plan = make_plan(tmp_path, "p4.json", 4)
    ck = tmp_path / "ck"
    tag = uuid.uuid4().hex

    # Ctrl-C: SIGINT to the foreground process group
    job = _start(plan, ck, tag)
    k1 = _wait_for_checkpoint(job, ck, 0)
    second = amsp("train", plan, "--steps", STEPS, "--checkpoint-dir", ck, "--resume",
                  cwd=tmp_path, timeout=60)
    line = one_error_line(second, f"--checkpoint-dir {ck}: in use by another job")
    assert re.fullmatch(rf"error: --checkpoint-dir {ck}: in use by another job \(pid {job.pid} "
                        r"on \S+, .*train .*, since [\d-]+ [\d:]+ UTC\): wait for "
                        r"it to end or stop it, or give another folder", line), line
    os.killpg(job.pid, signal.SIGINT)
    code, err = _ended(job, tag)
    k1 = _sound(ck)
    assert code == 130 and err.splitlines() == [
        f"interrupted: SIGINT (Ctrl-C): the job is stopped, every rank ended; last complete "
        f"checkpoint: {ck}/step_{k1}"], err[-3000:]
    out = job.out
    assert "note: the predicted step time" in out and "not calibrated for cpu-local" in out
    assert not [x for x in out.splitlines() if x.startswith("step ") and "predicted" in x]

    # SIGTERM to the launcher alone (a batch scheduler preempting the job), resuming the
    # folder, --save-on-sigterm: the ranks save the step they run and stop
    job = _start(plan, ck, tag, "--resume", "--save-on-sigterm")
    seen = _wait_for_checkpoint(job, ck, k1)
    job.send_signal(signal.SIGTERM)
    code, err = _ended(job, tag)
    k2 = _sound(ck)
    assert code == 143 and k2 > seen and err.splitlines() == [
        f"interrupted: SIGTERM: the job stopped after saving checkpoint {ck}/step_{k2} "
        "(--save-on-sigterm)"], err[-3000:]

    # the chain (a job stopped by Ctrl-C, resumed, stopped by SIGTERM) saved at step k2 what
    # one uninterrupted run saves there: made while the next job runs
    saved = _shards(ck / f"step_{k2}")
    ref = tmp_path / "ref"
    reference = subprocess.Popen([*AMSP, "train", str(plan), "--steps", str(k2),
                                  "--checkpoint-dir", str(ref), "--checkpoint-every", str(k2)],
                                 cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)

    # SIGKILL to the torchrun agent: its ranks die with it, the launcher ends the job
    job = _start(plan, ck, tag, "--resume")
    _wait_for_checkpoint(job, ck, k2)
    os.kill(_agent_of(job.pid), signal.SIGKILL)
    code, err = _ended(job, tag)
    k3 = _sound(ck)
    assert code == 4 and len(err.splitlines()) == 1 and err.startswith(
        "error: the torchrun agent was killed by signal 9, its ranks with it; last complete "
        f"checkpoint: {ck}/step_{k3}"), err[-3000:]

    _, err = reference.communicate(timeout=180)
    assert reference.returncode == 0, err[-3000:]
    assert saved == _shards(ref / f"step_{k2}")


# ----- single-process checks of the same machinery --------------------------------------------
def _sleeper(new_session: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=new_session)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130),
                                      (signal.SIGHUP, 129)])
def test_a_signal_to_the_launcher_stops_every_agent(tmp_path, capsys, sig, code):
    from amsp_planner.runtime import launch, lifecycle

    agents = [_sleeper(), _sleeper()]
    t0 = time.monotonic()
    with lifecycle.Signals() as got:
        os.kill(os.getpid(), sig)
        launch.wait_all(agents, grace_s=2, signals=got, run=tmp_path)
        assert got.received == [sig]
    assert all(a.poll() is not None for a in agents) and time.monotonic() - t0 < 5
    (tmp_path / "ck" / "step_3.tmp").mkdir(parents=True)  # a save the stop cut short
    assert launch._interrupted(tmp_path, sig, {"checkpoint_dir": str(tmp_path / "ck")}) == code
    assert capsys.readouterr().err.startswith(f"interrupted: {signal.Signals(sig).name}")
    assert not (tmp_path / "ck" / "step_3.tmp").exists()


def test_a_failed_agent_stops_the_others():
    from amsp_planner.runtime import launch

    failed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); exit(3)"])
    others = [_sleeper(), _sleeper()]
    t0 = time.monotonic()
    assert launch.wait_all([others[0], failed, others[1]], grace_s=2) == 3
    assert all(a.poll() is not None for a in others) and time.monotonic() - t0 < 10


def test_a_process_following_its_parent_dies_with_it(tmp_path):
    """SIGKILL of a parent (the launcher, the agent) ends a child that set the parent-death
    signal (lifecycle.follow_parent), which is what agents and ranks do."""
    pidfile = tmp_path / "child.pid"
    code = ("import os, signal, subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import os, signal, time; "
            "from amsp_planner.runtime import lifecycle; "
            "lifecycle.follow_parent(signal.SIGKILL, \"PARENT\"); "
            f"open(\"{pidfile}\", \"w\").write(str(os.getpid())); time.sleep(120)'],"
            " env={**os.environ, 'PARENT': str(os.getpid())})\n"
            "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], env=env())
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.1)
    child = int(pidfile.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and b"Z" not in _state(child):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.1)


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1][:3]
    except OSError:
        return b"Z"



_SLOW_PLAN = """
import sys, time
import amsp_planner.plan as P
def held(*a, **k):
    print("reading the plan", flush=True)
    time.sleep(60)
P.load_plan = held
from amsp_planner.cli.main import main
main(["train", sys.argv[1], "--steps", "1"])
"""


@pytest.mark.parametrize("sig,code,name", [(signal.SIGTERM, 143, "SIGTERM"),
                                           (signal.SIGHUP, 129, "SIGHUP"),
                                           (signal.SIGINT, 130, "SIGINT (Ctrl-C)")])
def test_a_signal_before_any_rank_starts_ends_the_launcher_in_one_line(tmp_path, sig, code,
                                                                       name):
    """The launcher's checks (reading the plan, preflight, with --resume the checkpoint's
    SHA-256) run before its job's handlers: a plan read held for a minute stands for a slow
    one. A stop signal there used to end it with no line (SIGTERM, SIGHUP) or a bare
    "aborted" (Ctrl-C)."""
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    p = subprocess.Popen([sys.executable, "-c", _SLOW_PLAN, str(plan)], cwd=tmp_path,
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "reading the plan", p.stderr.read()
        os.kill(p.pid, sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    lines = [x for x in err.splitlines() if x.strip()]
    assert p.returncode == code, (p.returncode, err)
    assert lines == [f"interrupted: {name}: the launcher stopped while no rank was running "
                     "(checkpoints untouched)"], err
