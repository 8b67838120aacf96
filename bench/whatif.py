"""Benchmark: a 1,000-point `amsp whatif` sweep, end to end through the CLI, and the same
decisions by the ILP on a slice of it, side by side in one run.

    python bench/whatif.py                 # the 1,000-point sweep, all cores, + the ILP slice
    python bench/whatif.py --workers 1     # one process (the serial cost per point)
    python bench/whatif.py --no-ilp        # the sweep only

5 models x 5 GPU counts x 5 NIC speeds per node x 4 memory limits x 2 sequence lengths. Prints
wall time, CPU time (the process and its workers), points per second, the row statuses and the
load average (other work on the machine slows the wall time, not the CPU time). A slice of 80
of its points runs once with `--solver exhaustive` (the sweep's default) and once with
`--solver highs` (the ILP), one process each; every row's decision and figures must agree.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import resource
import subprocess
import sys
import tempfile
import time

ARGS = [
    "--model", "llama-7b,llama-13b,llama-30b,llama-65b,llama2-70b",
    "--gpus", "128,256,512,1024,2048",
    "--set", "node_gbit_per_s=100,200,400,800,1600",
    "--memory-limit", "40,48,64,80",
    "--seq-len", "2048,4096",
    "--global-batch", "16M",
]
SLICE = [  # 80 points of ARGS: two models, two NIC speeds, seq 4096, every limit and count
    "--model", "llama-13b,llama2-70b", "--gpus", "128,256,512,1024,2048",
    "--set", "node_gbit_per_s=100,800", "--memory-limit", "40,48,64,80",
    "--seq-len", "4096", "--global-batch", "16M",
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sweep(args: list[str], workers: int | None, solver: str | None = None
          ) -> tuple[list[dict], float, float]:
    """(rows, wall s, CPU s of the child processes) of one cold `amsp whatif`."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "sweep.csv")
        cmd = [sys.executable, "-m", "amsp_planner.cli.main", "whatif", *args, "--csv", out]
        if workers:
            cmd += ["--workers", str(workers)]
        if solver:
            cmd += ["--solver", solver]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": ROOT}  # this checkout's package
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"amsp whatif failed ({proc.returncode}): {proc.stderr.strip()}")
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(out) as f:
            rows = list(csv.DictReader(f))
    cpu = ru.ru_utime + ru.ru_stime - before.ru_utime - before.ru_stime
    return rows, wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--no-ilp", action="store_true", help="skip the ILP slice")
    a = ap.parse_args()
    load0 = os.getloadavg()
    rows, wall, cpu = sweep(ARGS, a.workers)
    status = collections.Counter(r["status"] for r in rows)
    print(f"points: {len(rows)} ({', '.join(f'{k} {v}' for k, v in sorted(status.items()))})")
    print(f"cores available: {len(os.sched_getaffinity(0))}, workers: {a.workers or 'default'}")
    print(f"wall: {wall:.1f} s ({len(rows) / wall:.1f} points/s)")
    print(f"CPU: {cpu:.1f} s ({cpu / len(rows) * 1000:.0f} ms per point)")
    print(f"load average before / after: {load0[0]:.2f} / {os.getloadavg()[0]:.2f}")
    if a.no_ilp:
        return
    enum, _, cpu_e = sweep(SLICE, 1, "exhaustive")
    ilp, _, cpu_i = sweep(SLICE, 1, "highs")
    keys = ("status", "strategy", "step_s", "memory_gib", "tokens_per_s", "baseline")
    differ = [e["strategy"] + " / " + i["strategy"] for e, i in zip(enum, ilp, strict=True)
              if any(e[k] != i[k] for k in keys)]
    n = len(enum)
    print(f"slice of {n} points, one process each: exhaustive {cpu_e / n * 1000:.0f} ms CPU per "
          f"point, ILP (highs) {cpu_i / n * 1000:.0f} ms: {cpu_i / cpu_e:.1f}x")
    print(f"rows that differ: {len(differ)}" + "".join(f"\n  {d}" for d in differ[:10]))


if __name__ == "__main__":
    main()
