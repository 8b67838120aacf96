"""Fault injection: `amsp train` under broken checkpoints, full and read-only folders, killed
and out-of-memory ranks, non-finite gradients, wrong plans and bad outputs. Each case asserts
the one line that names the cause, the exit code (2 refused, 4 a rank failed), and that the
last good checkpoint still resumes to the losses of the uninterrupted run.

Two ranks (tiny model, ZeRO-3, 4 steps, a checkpoint every 2): a launch costs seconds on a
2-core machine, so the uninterrupted run is made once and the folders are copied.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

from .mp import amsp, error_lines, make_plan, one_error_line  # noqa: E402

STEPS = 4
LOG = r" \(full log: \S+/log\.txt\)"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The uninterrupted run: its losses, its checkpoint folder (step_2 and step_4)."""
    tmp = tmp_path_factory.mktemp("faults")
    plan = make_plan(tmp, "p2.json", 2)
    ck = tmp / "base"
    r = amsp("train", plan, "--steps", STEPS, "--checkpoint-dir", ck, "--checkpoint-every", 2,
             "--report", "base.json", cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = json.loads((tmp / "base.json").read_text())["loss"]
    return {"dir": tmp, "plan": plan, "ck": ck, "loss": losses}


def _copy(base, name: str) -> Path:
    dst = base["dir"] / name
    shutil.copytree(base["ck"], dst)
    return dst


def resumes_to_the_same_losses(base, ck: Path, *extra, start: int = 2) -> subprocess.CompletedProcess:
    """Resume `ck` (its latest, or --resume-from) to the end; the losses are the base run's."""
    rep = base["dir"] / f"resumed_{ck.name}.json"
    r = amsp("train", base["plan"], "--steps", STEPS, "--checkpoint-dir", ck, "--resume",
             *extra, "--report", rep, cwd=base["dir"])
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(rep.read_text())
    assert doc["start_step"] == start and doc["loss"] == base["loss"][start:]
    return r


def _latest_verifies(ck: Path, step: int) -> None:
    from amsp_planner.runtime.checkpoint import latest_step, verify

    assert latest_step(ck) == step
    verify(ck / f"step_{step}")  # raises on any difference from what was saved


# ----- corrupted checkpoints: refused before any rank starts, naming the file ----------------
def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 16] = bytes(x ^ 0xFF for x in b[mid:mid + 16])  # sixteen flipped bytes
    p.write_bytes(bytes(b))


CORRUPT = {"truncated": _truncate, "deleted": Path.unlink, "altered": _flip}


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", sorted(CORRUPT))
@pytest.mark.parametrize("name,kind", [("__1_0.distcp", "shard"), (".metadata", "metadata")])
def test_corrupted_checkpoint_is_refused_naming_the_file(base, how, name, kind):
    ck = _copy(base, f"ck_{how}_{kind}")
    f = ck / "step_4" / name
    size = f.stat().st_size
    CORRUPT[how](f)
    r = amsp("train", base["plan"], "--steps", 6, "--checkpoint-dir", ck, "--resume",
             cwd=base["dir"])
    detail = {"truncated": f" ({size // 2:,} of {size:,} bytes)", "deleted": "",
              "altered": " (checksum mismatch)"}[how]
    line = one_error_line(r, "--resume: checkpoint step_4:")
    assert line == (f"error: --resume: checkpoint step_4: {kind} {name} {how}{detail}: resume "
                    f"an earlier one with --resume-from 2, or remove {ck}/step_4")


@pytest.mark.multiprocess
def test_the_earlier_checkpoint_of_a_corrupted_folder_resumes(base):
    ck = _copy(base, "ck_flipped_resume")
    _flip(ck / "step_4" / "__0_0.distcp")
    r = resumes_to_the_same_losses(base, ck, "--resume-from", 2)
    assert r.stderr == ""  # no warning either


# ----- killed ranks --------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode,step,rank", [("save", 4, 1), ("step", 3, 0)])
def test_rank_killed_keeps_the_last_checkpoint(base, mode, step, rank):
    ck = base["dir"] / f"ck_kill_{mode}"
    r = amsp("train", base["plan"], "--steps", STEPS, "--checkpoint-dir", ck,
             "--checkpoint-every", 2, "--fail-at-step", step, "--fail-rank", rank,
             "--fail-mode", mode, "--timeout", 30, cwd=base["dir"])
    line = one_error_line(r, f"rank {rank}, step {step}:", code=4)
    assert re.fullmatch(rf"error: rank {rank}, step {step}: the process exited with code 9 "
                        rf"without an error; last complete checkpoint: {ck}/step_2{LOG}", line)
    _latest_verifies(ck, 2)
    if mode == "save":
        assert (ck / "step_4.tmp").is_dir()  # the crash's half-written save
    (ck / "step_1.tmp").mkdir()  # and an older crash's
    r = resumes_to_the_same_losses(base, ck, "--checkpoint-every", 2)
    assert not list(ck.glob("*.tmp")), "stale .tmp folders are removed at the next save"
    assert r.stderr == ""
    _latest_verifies(ck, 4)


# ----- full and read-only checkpoint folders (a small tmpfs) ---------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not root'})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount_ro(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


@pytest.mark.multiprocess
def test_full_checkpoint_folder(base, tmpfs):
    ck = tmpfs / "ck"
    r = amsp("train", base["plan"], "--steps", STEPS, "--checkpoint-dir", ck,
             "--checkpoint-every", 2, cwd=base["dir"])
    line = one_error_line(r, "rank ", code=4)
    assert re.fullmatch(rf"error: rank [01], step 4: no space left on device while saving "
                        rf"checkpoint step_4 in {ck} \([\d.,]+ (B|[KM]iB) free, this rank writes "
                        rf"[\d.]+ [KM]iB\); last complete checkpoint: {ck}/step_2{LOG}", line), line
    _latest_verifies(ck, 2)
    resumes_to_the_same_losses(base, ck)


@pytest.mark.multiprocess
def test_read_only_folders_are_refused_before_launch_and_still_resume(base, tmpfs):
    shutil.copytree(base["ck"] / "step_2", tmpfs / "ck" / "step_2")
    (tmpfs / "ck" / "latest").write_text("step_2\n")
    _remount_ro(tmpfs)
    ck = tmpfs / "ck"
    r = amsp("train", base["plan"], "--steps", STEPS, "--checkpoint-dir", ck, "--resume",
             "--checkpoint-every", 2, cwd=base["dir"])
    assert one_error_line(r, "--checkpoint-dir") == (
        f"error: --checkpoint-dir {ck}: read-only file system (in {ck}): choose a writable "
        "folder")
    report = tmpfs / "run.json"
    r = amsp("train", base["plan"], "--report", report, cwd=base["dir"])
    assert one_error_line(r, "--report") == (
        f"error: --report {report}: read-only file system (in {tmpfs}): choose a writable folder")
    resumes_to_the_same_losses(base, ck)  # reading alone needs no write access


# ----- an out-of-memory rank, non-finite gradients --------------------------------------------
@pytest.mark.multiprocess
def test_out_of_memory_rank(base):
    tmp = base["dir"]
    plan = make_plan(tmp, "p2_seq256.json", 2, seq=256)  # activations large enough to map
    ck = tmp / "ck_oom"
    r = amsp("train", plan, "--steps", STEPS, "--checkpoint-dir", ck, "--checkpoint-every", 2,
             "--fail-at-step", 3, "--fail-rank", 1, "--fail-mode", "oom", cwd=tmp)
    line = one_error_line(r, "rank 1, step ", code=4)
    assert re.fullmatch(r"error: rank 1, step [34]: out of memory while (running the (forward|"
                        r"backward) of unit \d|saving checkpoint step_4 in \S+)( \(an allocation "
                        rf"of [\d.]+ [KMG]iB failed\))?; last complete checkpoint: {ck}/step_2"
                        + LOG, line), line
    _latest_verifies(ck, 2)


@pytest.mark.multiprocess
def test_nonfinite_gradients_stop_keeping_the_checkpoint(base):
    ck = base["dir"] / "ck_nan"
    r = amsp("train", base["plan"], "--steps", STEPS, "--checkpoint-dir", ck,
             "--checkpoint-every", 2, "--fail-at-step", 4, "--fail-rank", 1, "--fail-mode", "nan",
             cwd=base["dir"])
    line = one_error_line(r, "rank 0, step 4:", code=4)
    assert re.fullmatch(rf"error: rank 0, step 4: non-finite training \(loss "
                        rf"{base['loss'][3]:.4g}, grad-norm nan\): stopped before saving "
                        rf"\(--on-nonfinite skip skips such steps instead\); last complete "
                        rf"checkpoint: {ck}/step_2{LOG}", line), line
    _latest_verifies(ck, 2)  # byte for byte what a resume test resumes


@pytest.mark.multiprocess
def test_skipped_nonfinite_step_and_an_asked_substitution(base):
    """--on-nonfinite skip: no update at that step, the others run and are accounted; the
    reduce-scatter -> all-reduce substitution asked for is named by the verdict, exit 0."""
    tmp = base["dir"]
    r = amsp("train", base["plan"], "--steps", STEPS, "--fail-at-step", 2, "--fail-rank", 0,
             "--fail-mode", "nan", "--on-nonfinite", "skip", "--report", "skip.json", cwd=tmp,
             extra_env={"AMSP_GLOO_RS_AS_ALL_REDUCE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step     2/4  skipped: non-finite loss or gradients" in r.stdout
    rep = json.loads((tmp / "skip.json").read_text())
    assert rep["skipped_steps"] == [2] and rep["loss"][1] is None
    assert rep["loss"][0] == base["loss"][0] and all(x is not None for x in rep["loss"][2:])
    assert r.stdout.splitlines()[-1] == (
        "verdict: the schedule matches the plan except the substitution asked for with "
        "AMSP_GLOO_RS_AS_ALL_REDUCE=1: backward/reduce_scatter/G as all_reduce")


# ----- refused before launch: another cluster, outputs, small ones ----------------------------
def _no_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the device check passes")


@pytest.mark.multiprocess
def test_a_plan_for_another_cluster_is_refused(base):
    _no_cuda()
    tmp = base["dir"]
    plan = make_plan(tmp, "dgx.json", 8, model="llama-7b", cluster="dgx-a100-hdr")
    r = amsp("train", plan, cwd=tmp)
    assert one_error_line(r, "the plan is for") == (
        "error: the plan is for dgx-a100-hdr (A100-SXM4-80GB GPUs) but this host runs CPU "
        "processes (no CUDA device): plan for this host (--cluster cpu-local, or a spec from "
        "amsp calibrate); or --force to run anyway")


@pytest.mark.multiprocess
def test_more_memory_than_the_host_has_is_refused(base):
    from amsp_planner.plan import load_plan

    tmp = base["dir"]
    plan = make_plan(tmp, "big.json", 4, model="llama-7b")
    per = load_plan(plan).evaluation.memory.total
    r = amsp("train", plan, cwd=tmp)
    line = one_error_line(r, "the plan needs")
    assert re.fullmatch(rf"error: the plan needs {per / 2**30:.2f} GiB per rank, "
                        rf"{4 * per / 2**30:.2f} GiB for the 4 ranks on this host, but "
                        r"[\d.]+ GiB is available: re-plan a smaller job or a sharded strategy; "
                        r"or --force to run anyway", line), line


@pytest.mark.multiprocess
def test_force_runs_a_plan_for_another_cluster_and_says_so(base):
    _no_cuda()
    tmp = base["dir"]
    plan = make_plan(tmp, "tiny_dgx.json", 2, cluster="dgx-a100-hdr")
    r = amsp("train", plan, "--steps", 1, "--force", cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0].startswith(
        "warning: --force: running although the plan is for dgx-a100-hdr")


@pytest.mark.multiprocess
def test_report_path_equal_to_the_plan_is_refused_and_the_plan_kept(base):
    before = base["plan"].read_bytes()
    r = amsp("train", base["plan"], "--report", base["plan"], cwd=base["dir"])
    assert one_error_line(r, "--report") == (
        f"error: --report {base['plan']}: is an input of this run (the plan or the data): "
        "give another path")
    assert base["plan"].read_bytes() == before


@pytest.mark.multiprocess
@pytest.mark.parametrize("args,line", [
    (["--checkpoint-every", 2], "--checkpoint-every 2: needs --checkpoint-dir DIR, the folder "
                                "to save to: add it or drop --checkpoint-every"),
    (["--steps", 4, "--checkpoint-dir", "{ck}", "--resume"],
     "--steps 4: the checkpoint in {ck} is at step 4 already, so there is nothing to run: give "
     "--steps above 4"),
    (["--steps", 3, "--checkpoint-dir", "{ck}", "--resume"],
     "--steps 3: the checkpoint in {ck} is at step 4 already, so there is nothing to run: give "
     "--steps above 4"),
    (["--checkpoint-dir", "{ck}", "--resume", "--resume-from", 3, "--steps", 6],
     "--resume-from 3: {ck} has no checkpoint step_3 (complete ones: 2, 4): give one of those"),
])
def test_options_that_cannot_apply_are_refused(base, args, line):
    args = [str(a).format(ck=base["ck"]) for a in args]
    r = amsp("train", base["plan"], *args, cwd=base["dir"])
    assert error_lines(r) == ["error: " + line.format(ck=base["ck"])] and r.returncode == 2
