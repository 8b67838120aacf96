"""Benchmark: a 1,000-point `amsp whatif` sweep, end to end through the CLI.

    python bench/whatif.py                 # the 1,000-point sweep, all cores
    python bench/whatif.py --workers 1     # one process (the serial cost per point)

5 models x 5 GPU counts x 5 NIC speeds per node x 4 memory limits x 2 sequence lengths. Prints
wall time, CPU time (this process and its workers), points per second, the row statuses and the
load average (other work on the machine slows the wall time, not the CPU time).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "sweep.csv")
        cmd = [sys.executable, "-m", "amsp_planner.cli.main", "whatif", *ARGS, "--csv", out]
        if a.workers:
            cmd += ["--workers", str(a.workers)]
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root}  # this checkout's package
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"amsp whatif failed ({proc.returncode}): {proc.stderr.strip()}")
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(out) as f:
            rows = list(csv.DictReader(f))
    status = collections.Counter(r["status"] for r in rows)
    cpu = ru.ru_utime + ru.ru_stime
    print(f"points: {len(rows)} ({', '.join(f'{k} {v}' for k, v in sorted(status.items()))})")
    print(f"cores available: {len(os.sched_getaffinity(0))}, workers: {a.workers or 'default'}")
    print(f"wall: {wall:.1f} s ({len(rows) / wall:.1f} points/s)")
    print(f"CPU: {cpu:.1f} s ({cpu / len(rows) * 1000:.0f} ms per point)")
    print(f"load average before / after: {load0[0]:.2f} / {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
