"""amsp whatif on large grids: refused above a stated size before any work, progress on the
accepted ones, Ctrl-C ends the sweep and its workers with one line and no output file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from amsp_testlib import assert_user_error, run_cli

from amsp_planner import whatif as w
from amsp_planner.whatif_grid import MAX_AXIS_VALUES, MAX_POINTS

ROOT = Path(__file__).resolve().parents[1]


def _list(n: int, start: int = 1) -> str:
    return ",".join(str(i) for i in range(start, start + n))


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the sweep gets as far as checking its values or building its points,
    or if a --set list is parsed value by value."""
    from amsp_planner.specs import loader

    def boom(*_a, **_k):
        raise AssertionError("work done on a grid that should have been refused")

    monkeypatch.setattr(w, "validate", boom)
    monkeypatch.setattr(w.Sweep, "points", boom)
    monkeypatch.setattr(loader, "parse_value", boom)


@pytest.mark.parametrize("argv, needles", [
    # 1,000 x 1,000 x 1,000 x 47 = 4.7e10 points (building them ended in MemoryError)
    (["-n", _list(1000), "--seq-len", _list(1000, 128), "--memory-limit", _list(47),
      "--global-batch-seqs", _list(1000)],
     ["47,000,000,000 points", f"limit of {MAX_POINTS:,}", "--max-points"]),
    (["-n", _list(1000), "--seq-len", _list(1000, 128)],
     ["1,000,000 points", "1,000 --seq-len x 1,000 --gpus", f"limit of {MAX_POINTS:,}"]),
    (["-n", "64", "--seq-len", _list(5000, 128)],
     ["--seq-len: 5,000 values", f"limit of {MAX_AXIS_VALUES:,} per option"]),
    (["-n", "64", "--set", "nic_gbit_per_s=" + _list(15000)],
     ["--set nic_gbit_per_s: 15,000 values", f"limit of {MAX_AXIS_VALUES:,}"]),
])
def test_large_grid_is_refused_before_any_work(no_work, tmp_path, argv, needles):
    csv = tmp_path / "out.csv"
    t0 = time.perf_counter()
    code, out, err = run_cli(["whatif", "-m", "llama-7b", *argv, "--csv", str(csv)])
    assert time.perf_counter() - t0 < 5
    assert_user_error(code, out, err, *needles)
    assert not csv.exists()


def test_max_points_sets_the_limit():
    base = ["whatif", "-m", "tiny", "-n", "8,16,32", "--seq-len", "256", "--format", "csv"]
    code, out, err = run_cli([*base, "--max-points", "2"])
    assert_user_error(code, out, err, "3 points (3 --gpus)", "limit of 2")
    code, out, err = run_cli([*base, "--max-points", "3"])
    assert code == 0, err
    assert len(out.splitlines()) == 4  # header and three rows
    with pytest.raises(Exception, match="limit of 2"):  # the library refuses it as well
        w.run(w.Sweep(models=("tiny",), gpus=(8, 16, 32)), 1, max_points=2)


@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_ctrl_c_ends_the_sweep_and_its_workers(tmp_path, sig, group):
    """SIGINT to the process group, as Ctrl-C sends it, or SIGTERM to the sweep's process
    alone, as a scheduler stops it, while two workers solve: exit 128 + the signal, one line,
    no traceback, no output file, no process of the group left (SIGTERM killed the parent
    silently and left each worker a BrokenPipeError trace)."""
    csv = tmp_path / "sweep.csv"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, "-m", "amsp_planner.cli.main", "whatif", "-m", "llama-7b",
            "-n", ",".join(str(8 * i) for i in range(1, 401)), "--workers", "2", "--progress",
            "--csv", str(csv)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, cwd=tmp_path)
    try:
        first = proc.stderr.readline()  # progress off a terminal, as asked with --progress
        assert first.startswith("solved ") and first.rstrip().endswith(" of 400 points"), first
        os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
        t0 = time.monotonic()
        rest = proc.stderr.read()
        code = proc.wait(timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [ln for ln in rest.splitlines() if not ln.startswith("solved ")]
    assert code == 128 + sig, rest
    assert len(lines) == 1 and lines[0].startswith(f"interrupted: {sig.name}: "), rest
    assert "of 400 points solved; no file written" in lines[0]
    assert not csv.exists() and list(tmp_path.iterdir()) == []
    deadline = time.monotonic() + 10
    while True:  # the pool's workers are in the group: all of them end
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a worker outlived the sweep"
        time.sleep(0.1)


def test_invalid_points_name_the_option_not_the_field():
    # a what-if point's training error names what the user typed (--global-batch), as
    # `amsp plan` does, not TrainingSpec's field (global_batch_tokens)
    p = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", "whatif", "--model",
                        "llama-7b", "--gpus", "64", "--global-batch", "1000", "--format", "csv"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--global-batch 1000" in p.stdout and "global_batch_tokens" not in p.stdout


@pytest.mark.parametrize("argv", [["--memory-limit", "40,1e308"], ["--memory-limit", "nan"],
                                  ["--gpu-hour-price", "inf"], ["--gpu-hour-price", "1e-400"]])
def test_swept_numbers_are_finite_and_in_range(argv):
    p = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", "whatif", "--model",
                        "llama-7b", "--gpus", "64", *argv], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, (argv, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and argv[0] in lines[0] and "Traceback" not in p.stderr


def test_memory_limit_above_the_gpu_is_warned_per_gpu_it_exceeds():
    # dgx-h100-ndr's H100 has 80 GiB, an H200 141 GiB (presets/gpus.yaml): 100 GiB is above the
    # first only, 60 above neither; the points are still planned (as amsp plan does)
    code, out, err = run_cli(["whatif", "--model", "tiny", "--gpus", "8", "--cluster",
                              "dgx-h100-ndr", "--gpu-type", "h100,h200",
                              "--memory-limit", "60,100", "--format", "csv"])
    assert code == 0, err
    warned = [ln for ln in err.splitlines() if ln.startswith("warning: --memory-limit")]
    assert len(warned) == 1, err
    assert "--memory-limit 100 GiB" in warned[0] and "H100" in warned[0]
    assert "H200" not in warned[0] and "(80 GiB)" in warned[0]
    assert len(out.strip().splitlines()) == 1 + 4  # header + 2 GPU types x 2 limits
