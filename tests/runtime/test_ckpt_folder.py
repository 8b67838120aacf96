"""The checkpoint folder across a run: a resume without the `latest` pointer takes the newest
complete checkpoint (it started over at step 0 and rotated the checkpoints away), a pointer to
a missing step is refused naming the complete ones, and a folder removed or replaced during
the run ends the job at its next save in one line (rank 0 recreated it without its lock)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time

import pytest

from amsp_planner.runtime.ckpt_lock import (
    LOCK_ID_ENV,
    LOCK_NAME,
    folder_problem,
    lock_folder,
    lock_id,
    release,
)

pytest.importorskip("torch")

from .mp import AMSP, amsp, env, make_plan, one_error_line  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-rank run of 6 steps saving every 2: step_4 and step_6 kept, latest = step_6."""
    tmp = tmp_path_factory.mktemp("ckfolder")
    plan = make_plan(tmp, "p4.json", 4)
    r = amsp("train", plan, "--steps", 6, "--checkpoint-dir", tmp / "ck", "--checkpoint-every",
             2, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, plan


@pytest.mark.multiprocess
def test_resume_without_latest_takes_the_newest_complete_checkpoint(saved):
    tmp, plan = saved
    ck = tmp / "ck_nolatest"
    shutil.copytree(tmp / "ck", ck)
    (ck / "latest").unlink()
    r = amsp("train", plan, "--steps", 8, "--checkpoint-dir", ck, "--checkpoint-every", 2,
             "--resume", "--report", "nolatest.json", cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp / "nolatest.json").read_text())
    assert rep["start_step"] == 6 and len(rep["loss"]) == 2
    assert "resumed from step 6" in r.stdout


@pytest.mark.multiprocess
def test_latest_at_a_missing_step_is_refused_naming_the_complete_ones(saved):
    tmp, plan = saved
    ck = tmp / "ck_badptr"
    shutil.copytree(tmp / "ck", ck)
    (ck / "latest").write_text("step_10\n")
    r = amsp("train", plan, "--steps", 12, "--checkpoint-dir", ck, "--resume", cwd=tmp)
    one_error_line(r, f"--resume: {ck / 'latest'} points at step_10, which is not there "
                      "(complete ones: 4, 6): resume one with --resume-from 6")


def test_folder_problem_names_a_removed_or_replaced_folder(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    fd = lock_folder(ck, create=True)
    try:
        monkeypatch.setenv(LOCK_ID_ENV, lock_id(fd))
        assert folder_problem(ck) is None
        os.unlink(ck / LOCK_NAME)  # another job's folder in its place: a lock of its own
        (ck / LOCK_NAME).write_text("")
        assert "was replaced during the run" in folder_problem(ck)
        shutil.rmtree(ck)
        assert "was removed during the run" in folder_problem(ck)
        monkeypatch.delenv(LOCK_ID_ENV)  # no lock taken: the runtime called directly
        assert folder_problem(ck) is None
    finally:
        release(fd)


@pytest.mark.multiprocess
def test_a_folder_removed_during_the_run_ends_it_at_the_next_save(saved):
    tmp, plan = saved
    ck = tmp / "ck_removed"
    p = subprocess.Popen([*AMSP, "train", str(plan), "--steps", "400", "--checkpoint-dir",
                          str(ck), "--checkpoint-every", "50", "--timeout", "30"], cwd=tmp,
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ck / "latest").exists():  # the first save is done
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
            time.sleep(0.05)
        shutil.rmtree(ck)
        _, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
    r = subprocess.CompletedProcess(p.args, p.returncode, "", err)
    line = one_error_line(r, "rank 0, step ", code=4)
    assert "was removed during the run" in line, line
    assert not ck.exists()  # not recreated without its lock


@pytest.mark.multiprocess
def test_a_report_that_cannot_be_written_after_the_steps_is_a_fault(saved):
    """The report's folder fills up while the job runs (it was writable when checked): the
    training ran, so it is a fault, exit 4, named as one (it exited 2, 'refused input')."""
    from amsp_testlib import tmpfs

    tmp, plan = saved
    with tmpfs(tmp / "small", "64k") as small:
        with open(small / "fill", "wb") as f:  # full, but an empty file can still be made
            with contextlib.suppress(OSError):
                f.write(b"\0" * (1 << 20))
        r = amsp("train", plan, "--steps", 3, "--report", small / "r.json", cwd=tmp)
    line = one_error_line(r, "rank 0, step 3: --report ", code=4)
    assert "no space left on device" in line and "(after every step ran)" in line, line


@pytest.mark.multiprocess
def test_a_failed_save_on_sigterm_is_named_in_the_stop_line(saved):
    """SIGTERM with --save-on-sigterm, the save failing on a full disk: the stop line says the
    save failed and why (it read as a plain stop, every step lost without a word)."""
    import signal

    from amsp_testlib import tmpfs

    tmp, plan = saved
    with tmpfs(tmp / "tiny_disk", "512k") as small:
        code, lines = _signalled_after_a_step(tmp, plan, small / "ck", signal.SIGTERM)
    assert code == 143 and len(lines) == 1, lines
    assert lines[0].startswith("interrupted: SIGTERM: the save --save-on-sigterm asked for "
                               "failed (rank "), lines[0]
    assert "no space left on device" in lines[0], lines[0]


@pytest.mark.multiprocess
def test_ctrl_c_under_save_on_sigterm_stops_without_a_save(saved):
    """Only a first SIGTERM asks for the save (docs/runtime.md): Ctrl-C stops the job at once
    (the ranks took the launcher's SIGTERM for a save request and saved the step)."""
    import signal

    tmp, plan = saved
    ck = tmp / "ck_ctrl_c"
    code, lines = _signalled_after_a_step(tmp, plan, ck, signal.SIGINT)
    assert code == 130 and lines == [
        "interrupted: SIGINT (Ctrl-C): the job is stopped, every rank ended"], lines
    assert not list(ck.glob("step_*"))


def _signalled_after_a_step(tmp, plan, ck, sig) -> tuple[int, list[str]]:
    """`amsp train --save-on-sigterm` (no periodic save before step 1000) given `sig` once its
    first step is done (a save has something to save); (exit code, stderr's lines)."""
    p = subprocess.Popen([*AMSP, "train", str(plan), "--steps", "2000", "--checkpoint-dir",
                          str(ck), "--checkpoint-every", "1000", "--save-on-sigterm",
                          "--timeout", "30"], cwd=tmp, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        for out_line in p.stdout:
            if out_line.lstrip().startswith("step"):
                break
        p.send_signal(sig)
        _, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, [x for x in err.splitlines() if x.strip()]


@pytest.mark.multiprocess
def test_a_fresh_run_into_a_folder_of_checkpoints_is_refused(saved):
    """Without --resume a run starts at step 0 and its saves take the earlier run's names: it
    replaced them without a word; junk where a save goes is refused before any step too."""
    tmp, plan = saved
    before = sorted(p.name for p in (tmp / "ck").iterdir())
    r = amsp("train", plan, "--steps", 4, "--checkpoint-dir", tmp / "ck", "--checkpoint-every",
             2, cwd=tmp)
    one_error_line(r, f"--checkpoint-dir {tmp / 'ck'}: holds checkpoints of an earlier run "
                      "(step 4, 6): give --resume")
    assert sorted(p.name for p in (tmp / "ck").iterdir()) == before
    (tmp / "junk" / "latest").mkdir(parents=True)
    r = amsp("train", plan, "--steps", 4, "--checkpoint-dir", tmp / "junk",
             "--checkpoint-every", 2, cwd=tmp)
    one_error_line(r, f"--checkpoint-dir {tmp / 'junk'}: {tmp / 'junk' / 'latest'} is not a file")
