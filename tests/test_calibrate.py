"""amsp calibrate on the local CPU "cluster" (gloo over loopback), run as the user runs it.

    python -m pytest tests/test_calibrate.py -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from amsp_testlib import assert_user_error, run_cli

REPO = Path(__file__).resolve().parent.parent
QUICK = ["--min-size", "4K", "--max-size", "256K", "--seconds-per-point", "0.02",
         "--matmul-size", "128", "--timeout", "20", "--passes", "1"]


def _env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    return env


def amsp(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout, env=_env(), **kw)


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))  # temporary files


needs_torch = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("torch") is None,
    reason="torch (the runtime extra) is not installed")


@needs_torch
@pytest.mark.multiprocess
def test_two_nodes_of_two_ranks_give_a_valid_spec_that_plan_accepts(tmp_path):
    from amsp_planner.specs import load_cluster

    out = tmp_path / "cpu.yaml"
    r = amsp("calibrate", "--nproc", "2", "--nnodes", "2", "--out", str(out), *QUICK,
             "--passes", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    # Progress: one line per point, numbered out of the total (2 passes x 2 scopes x 4 ops x
    # 4 sizes), and each pass's matmul and quantizer figures.
    assert "[1/64] all_gather" in r.stderr and "[64/64] all_to_all     inter" in r.stderr
    assert "pass 1/2: matmul" in r.stderr and "pass 2/2: matmul" in r.stderr
    spec = load_cluster(str(out))
    assert spec.gpus_per_node == 2 and spec.name == "cpu-local-calibrated"
    assert {(t.op, t.scope) for t in spec.measured} == {
        (op, scope) for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
        for scope in ("intra", "inter")}
    for t in spec.measured:
        sizes = [p.size_bytes for p in t.points]
        assert len(sizes) == len(set(sizes)) == 4  # one figure per size: the passes' median
        assert sizes[0] <= 4096 and 128 * 1024 <= sizes[-1] <= 256 * 1024
        bws = [p.busbw_gbyte_per_s for p in t.points]
        # Loopback TCP on a shared CPU: well above a modem, well below memory bandwidth.
        assert all(1e-5 < b < 200 for b in bws), (t.op, t.scope, bws)
        assert max(bws) > bws[0], (t.op, t.scope, bws)  # latency dominates the small sizes
    assert 1e-6 < spec.gpu.peak_bf16_tflop_per_s < 100
    # the runtime's AdamW on a shared CPU: measured, not the preset's 2 GB/s placeholder
    assert spec.gpu.optimizer_gbyte_per_s != 2 and 0.01 < spec.gpu.optimizer_gbyte_per_s < 200
    assert "optimizer step" in r.stderr
    assert out.read_text().startswith("# written by amsp calibrate on ")
    assert _leftovers(tmp_path) == []
    plan = amsp("plan", "--model", "tiny", "--gpus", "4", "--cluster", str(out), "--seq-len",
                "32", "--global-batch-seqs", "8", "-o", str(tmp_path / "plan.json"))
    assert plan.returncode == 0, plan.stderr
    assert (tmp_path / "plan.json").exists()


@needs_torch
@pytest.mark.multiprocess
def test_single_node_writes_intra_tables_only_and_says_so(tmp_path):
    from amsp_planner.specs import load_cluster

    out = tmp_path / "one.yaml"
    r = amsp("calibrate", "--nproc", "2", "--out", str(out), "--ops", "all_reduce", "--name",
             "laptop", *QUICK)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "single node: measuring intra-node groups only" in r.stderr
    spec = load_cluster(str(out))
    assert spec.name == "laptop"
    assert [(t.op, t.scope) for t in spec.measured] == [("all_reduce", "intra")]


@needs_torch
@pytest.mark.multiprocess
def test_killed_run_leaves_nothing(tmp_path):
    out = tmp_path / "killed.yaml"
    p = subprocess.Popen([sys.executable, "-m", "amsp_planner.cli.main", "calibrate", "--nproc",
                          "2", "--out", str(out), *QUICK, "--seconds-per-point", "0.2"],
                         stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        for line in p.stderr:  # wait until measuring is under way
            if line.startswith("[2/") or time.monotonic() > deadline:
                break
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=30)
        time.sleep(0.5)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not out.exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_every_rank_in_one_line(tmp_path, sig):
    """Ctrl-C or SIGTERM to `amsp calibrate --nproc` itself: every agent and rank ended, one
    line, exit 128 + the signal, nothing written (SIGTERM killed it silently; a Ctrl-C to the
    group printed a line per rank and torchrun's warnings)."""
    out = tmp_path / "stopped.yaml"
    p = subprocess.Popen([sys.executable, "-m", "amsp_planner.cli.main", "calibrate", "--nproc",
                          "2", "--out", str(out), *QUICK, "--seconds-per-point", "0.2"],
                         stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    try:
        for line in p.stderr:  # measuring is under way
            if line.startswith("[2/"):
                break
        p.send_signal(sig)
        rest = p.stderr.read()
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = [x for x in rest.splitlines() if x.strip() and not x.startswith("[")]
    assert code == 128 + sig and len(lines) == 1, rest[-3000:]
    assert lines[0].startswith(f"interrupted: {sig.name}"), lines
    assert not out.exists()
    deadline = time.monotonic() + 15
    while _running(str(out)) and time.monotonic() < deadline:  # agents and ranks end too
        time.sleep(0.2)
    assert _running(str(out)) == [] and _leftovers(tmp_path) == []


def _running(needle: str) -> list[int]:
    """Processes whose command line holds `needle` (the agents and ranks of one calibration)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and needle in (d / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(d.name))
        except OSError:
            continue
    return out


@needs_torch
@pytest.mark.multiprocess
def test_lost_rank_fails_and_writes_nothing(tmp_path):
    out = tmp_path / "lost.yaml"
    r = amsp("calibrate", "--nproc", "2", "--out", str(out), "--fail-rank", "1", *QUICK)
    assert r.returncode == 1
    assert "nothing written to" in r.stderr.splitlines()[-1]
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("args, message", [
    (["--out", "x.yaml"], "error: not under torchrun (no RANK/WORLD_SIZE): run it with torchrun"),
    (["--nproc", "2", "--ops", "all_gather,bcast"], "error: --ops: unknown collective 'bcast'"),
    (["--nproc", "2", "--max-size", "1K"], "error: --max-size 1K is below --min-size 4K: raise it"),
    (["--nproc", "2", "--min-size", "lots"], "error: --min-size: 'lots' is not a count"),
    (["--nproc", "2", "--cluster", "no-such-cluster"], "error: "),
    (["--nproc", "2", "--out", "/no/such/dir/c.yaml"],
     "error: --out /no/such/dir/c.yaml: folder /no/such/dir does not exist"),
    (["--nproc", "2", "--out", "."], "error: --out .: is a folder: give a file name"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    r = amsp("calibrate", *args, cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


def _table(op, scope, gbyte_per_s):
    return {"op": op, "scope": scope, "points": [{"size_bytes": 1, "busbw_gbyte_per_s": gbyte_per_s}]}


def test_measured_tables_price_groups_by_their_layout():
    """[Note: measured tables] in topology.py: the inter table is one node's link; a group
    spanning nodes runs a ring whose node exits carry the ring bytes of R/k groups at once."""
    from amsp_planner.specs import load_cluster
    from amsp_planner.topology import Topology

    base = load_cluster("cpu-local")  # R = 4
    c = base.model_validate({**base.model_dump(), "measured": [
        _table("all_reduce", "intra", 1.0), _table("all_reduce", "inter", 0.1),
        _table("all_to_all", "inter", 0.1)]})
    topo, full = Topology(c, 8), 8e6
    # In one node: as measured, 2 (m-1)/m * F / busbw.
    assert topo.collective_time("all_reduce", 4, 1, full) == pytest.approx(1.5 * full / 1e9)
    # One rank per node is what the inter table measured, but all 4 local ranks run their own
    # stride-4 group at once: 4 x (2 (2-1)/2 F) / 0.1 GB/s.
    assert topo.collective_time("all_reduce", 2, 4, full) == pytest.approx(4 * full / 0.1e9)
    # The whole world: one ring crosses each node once: 2 (7/8) F / 0.1 GB/s.
    assert topo.collective_time("all_reduce", 8, 1, full) == pytest.approx(1.75 * full / 0.1e9)
    # Direct all-to-all over a stride-4 group: each node sends 4 x (1/2) F out.
    assert topo.collective_time("all_to_all", 2, 4, full) == pytest.approx(2 * full / 0.1e9)
    # No intra table for all-to-all: the spec's in-node bandwidth prices the in-node part.
    assert topo.collective_time("all_to_all", 8, 1, full) == pytest.approx(
        max(4 * 0.5 * full / 0.1e9, 3 / 8 * full / c.intra_bytes_per_s))


def test_each_point_is_the_median_over_passes():
    # Three passes; the second caught a slow spell at 4 KiB and a fast one at 64 KiB.
    from amsp_planner.calibrate import build_spec
    from amsp_planner.specs import load_cluster

    res = {("all_gather", "intra"): [(4096, 1e9), (65536, 5e9), (4096, 0.1e9), (65536, 50e9),
                                     (4096, 2e9), (65536, 6e9)]}
    spec = build_spec(load_cluster("cpu-local"), 4, res, 1e12)
    (table,) = spec.measured
    assert [(p.size_bytes, p.busbw_gbyte_per_s) for p in table.points] == [(4096, 1.0),
                                                                          (65536, 6.0)]


def test_gpu_matmul_curve_fit_recovers_fraction_and_overhead():
    from amsp_planner.calibrate import CURVE_TOKENS, fit_curve

    # synthetic timings of a GPU at 70 % of a 312 TFLOP/s peak with 12 us per kernel
    pts = [(2.0 * t * 4096 * 11008, 2.0 * t * 4096 * 11008 / (312e12 * 0.7) + 12e-6)
           for t in CURVE_TOKENS]
    frac, over = fit_curve(pts, 312e12)
    assert frac == pytest.approx(0.7, rel=1e-6)
    assert over == pytest.approx(12.0, rel=1e-6)


def test_gpu_figures_keep_the_preset_peak():
    from amsp_planner.calibrate import build_spec
    from amsp_planner.specs import load_cluster

    base = load_cluster("dgx-h100-ndr")
    spec = build_spec(base, 8, {}, 5e14, gpu={"achievable_fraction": 0.7,
                                              "kernel_overhead_us": 8.0,
                                              "comm_compute_slowdown": 0.2})
    assert spec.gpu.peak_bf16_tflop_per_s == base.gpu.peak_bf16_tflop_per_s
    assert (spec.gpu.achievable_fraction, spec.gpu.kernel_overhead_us,
            spec.gpu.comm_compute_slowdown) == (0.7, 8.0, 0.2)


def test_nccl_backend_refused_where_it_cannot_run(tmp_path):
    """--backend nccl on a host without NCCL or a GPU: one line before any rank starts (it
    launched the ranks, which failed with torchrun's trace, exit 1)."""
    torch = pytest.importorskip("torch")
    if torch.distributed.is_nccl_available() and torch.cuda.is_available():
        pytest.skip("this host runs NCCL")
    out = tmp_path / "cal.yaml"
    assert_user_error(*run_cli(["calibrate", "--nproc", "2", "--backend", "nccl", "-o",
                                str(out)]), "--backend nccl", "--backend gloo")
    assert not out.exists()
