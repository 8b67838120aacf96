"""Cold wall time of `amsp compare`, next to a bare Python start-up, as a markdown table.

    python bench/compare.py --runs 7

Each run is a fresh process (nothing cached in memory; the OS file cache is warm after the
first run, as it is for a user who runs the command twice). Reports the median and the spread.
Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

COMMAND = ["compare", "--model", "llama-7b", "--gpus", "1024"]


def wall_times(argv: list[str], runs: int) -> list[float]:
    """Seconds of `runs` fresh processes of argv (one untimed warm-up first)."""
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="timed runs per command (>= 5)")
    args = ap.parse_args()
    runs = max(5, args.runs)
    amsp = shutil.which("amsp")
    if amsp is None:
        sys.exit("amsp is not on PATH: pip install -e . first")
    rows = [
        ("`python -c pass`", [sys.executable, "-c", "pass"]),
        (f"`amsp {' '.join(COMMAND)}`", [amsp, *COMMAND]),
    ]
    print(f"{runs} cold runs each; Python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| command | median (s) | min (s) | max (s) |")
    print("| --- | ---: | ---: | ---: |")
    for name, argv in rows:
        t = wall_times(argv, runs)
        print(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f} | {max(t):.3f} |")


if __name__ == "__main__":
    main()
