"""Planner benchmark: cold `amsp plan` wall time and solve time with the ILP (the default) and
with `--solver exhaustive`, and ILP vs enumeration vs brute force (all choosing by the planner's
default rule, docs/planner.md), side by side in one run.

    python bench/planner.py [--runs 5] [--no-brute]
    python bench/planner.py --before /tmp/base [--runs 15] [--case llama-7b]

Prints a markdown table; every figure is the median of --runs runs, all measured in one run.
With `--before DIR` (another checkout of the project, e.g. `git worktree add /tmp/base
<commit>`), the cold `amsp plan` of each case instead, that tree and this one in turn
(`PYTHONPATH` at each checkout, both byte-compiled), interleaved run by run (which goes
first alternating) so that the machine's drift falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [
    ("llama-7b, 1024 GPUs", ["--model", "llama-7b", "--gpus", "1024"]),
    ("llama2-70b, 4096 GPUs", ["--model", "llama2-70b", "--gpus", "4096",
                               "--global-batch-seqs", "4096"]),
    ("llama3-405b, 16384 GPUs", ["--model", "llama3-405b", "--gpus", "16384",
                                 "--global-batch-seqs", "16384"]),
    # DeepSpeed's re-gathers of recomputed blocks (docs/cost-model.md): rows per option and
    # backward gather choice in the ILP
    ("gpt3-175b deepspeed, 1024 GPUs", ["--model", "gpt3-175b", "--gpus", "1024",
                                        "--engine", "deepspeed"]),
    # mixtures of experts (docs/moe.md): one ILP per expert-parallel degree and placement
    ("qwen3-30b-a3b, 64 GPUs", ["--model", "qwen3-30b-a3b", "--gpus", "64"]),
    ("deepseek-v3, 2048 GPUs, 2048 seqs", ["--model", "deepseek-v3", "--gpus", "2048",
                                           "--cluster", "dgx-h100-ndr",
                                           "--global-batch-seqs", "2048"]),
    # the default global batch (4M tokens: 1,024 sequences) cannot cover 2,048 GPUs: refused
    # in one line (exit 2) that names the batch that would
    ("deepseek-v3, 2048 GPUs, default batch (refused)",
     ["--model", "deepseek-v3", "--gpus", "2048", "--cluster", "dgx-h100-ndr"]),
    # pipeline stages (solver/pipeline_search.py): the stage's space enumerated, not the ILP
    ("llama3-70b, 512 GPUs, --pp 4", ["--model", "llama3-70b", "--gpus", "512", "--pp", "4"]),
    ("llama3-405b, 16384 GPUs, --pp 16", ["--model", "llama3-405b", "--gpus", "16384",
                                          "--cluster", "dgx-h100-ndr", "--pp", "16"]),
    ("gpt-oss-120b, 64 GPUs, --pp 4 --ep 8", ["--model", "gpt-oss-120b", "--gpus", "64",
                                              "--cluster", "dgx-h100-ndr", "--pp", "4",
                                              "--ep", "8"]),
]


def here() -> Path:
    """The checkout this script's package is imported from."""
    import amsp_planner

    return Path(amsp_planner.__file__).parent.parent


def compile_package(root: Path | None = None) -> None:
    """Byte-compile the package first, as an installed one is (pip compiles at install): an
    editable install under PYTHONDONTWRITEBYTECODE=1 (as on the CI machines) would otherwise
    compile every module again in every run (about 0.2 s)."""
    import compileall

    compileall.compile_dir((root or here()) / "amsp_planner", quiet=1)


def plan_once(args: list[str], out: Path, root: Path | None = None) -> tuple[float, float]:
    """(wall, solve) seconds of one cold `amsp plan`, from checkout `root` (None: as this
    process finds the package)."""
    env = None if root is None else {**os.environ, "PYTHONPATH": str(root)}
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    # run from the checkout: `python -m` puts the working directory first on sys.path
    run = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", "plan", *args,
                          "-o", str(out)], capture_output=True, env=env, cwd=root)
    wall = time.perf_counter() - t0
    if run.returncode == 2 and not out.exists():  # refused (one line, exit 2): no solve
        return wall, 0.0
    run.check_returncode()
    return wall, json.loads(out.read_text())["volatile"]["solve_time_s"]


def cold_plan(args: list[str], runs: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        got = [plan_once(args, Path(tmp) / "plan.json") for _ in range(runs)]
    return statistics.median(w for w, _ in got), statistics.median(s for _, s in got)


def before_after(before: Path, runs: int, cases: list) -> None:
    """The cold `amsp plan` of `cases` from checkout `before` and from this one, each run of
    one followed by one of the other (which goes first alternating); medians."""
    trees = (before.resolve(), here())
    for root in trees:
        compile_package(root)
    print(f"before: {trees[0]}, after: {trees[1]}; {runs} runs each, interleaved\n")
    print("| case | runs | before: wall (s) | solve (s) | after: wall (s) | solve (s) | "
          "after / before |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        for name, args in cases:
            got: dict = {root: [] for root in trees}
            for i in range(runs):  # in turn, each tree first every other run
                for root in trees if i % 2 == 0 else trees[::-1]:
                    got[root].append(plan_once(args, out, root))
            (wb, sb), (wa, sa) = ((statistics.median(w for w, _ in got[r]),
                                   statistics.median(s for _, s in got[r])) for r in trees)
            print(f"| {name} | {runs} | {wb:.3f} | {sb:.3f} | {wa:.3f} | {sa:.3f} | "
                  f"{wa / wb:.2f} |")


def python_startup(runs: int) -> float:
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def ilp_vs_brute(runs: int) -> list[tuple[str, int, float, float]]:
    from amsp_planner.cost.job import Job
    from amsp_planner.solver import SearchSpace, solve
    from amsp_planner.solver.brute import brute_force
    from amsp_planner.solver.space import Preference
    from amsp_planner.specs import TrainingSpec, load_cluster, load_model

    rows = []
    for model, gpus, seqs in (("llama-7b", 64, 256), ("llama-13b", 256, 1024),
                              ("llama-7b", 1024, 1024)):
        job = Job.create(load_model(model), load_cluster(None), TrainingSpec(global_batch_seqs=seqs),
                         gpus)
        space = SearchSpace.for_job(job)
        pref = Preference.default()
        t_ilp, t_en, t_bf = [], [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            a = solve(job, runners_up=0, preference=pref).best
            t_ilp.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            e = solve(job, runners_up=0, preference=pref, solver="exhaustive").best
            t_en.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = brute_force(job, space, job.cluster.memory_bytes, preference=pref)[0]
            t_bf.append(time.perf_counter() - t0)
            # the same choice by the planner's rule (its last tie-break: memory)
            for x in (a, e):
                assert abs(x.memory.total - b.memory.total) <= 1e-6 * b.memory.total
        rows.append((f"{model}, {gpus} GPUs", space.size(job), statistics.median(t_ilp),
                     statistics.median(t_en), statistics.median(t_bf)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-brute", action="store_true",
                    help="skip the ILP / enumeration / brute force table (minutes)")
    ap.add_argument("--before", type=Path, default=None,
                    help="another checkout: its cold plans against this one's, interleaved")
    ap.add_argument("--case", default="", help="only the cases whose name contains this")
    a = ap.parse_args()
    cases = [(name, args) for name, args in CASES if a.case in name]
    if a.before is not None:
        before_after(a.before, a.runs, cases)
        return
    compile_package()
    py = python_startup(a.runs)
    print(f"python -c pass: {py:.3f} s (median of {a.runs})\n")
    print("| case | cold `amsp plan` wall (s) | solve (s) | with `--solver exhaustive` (s) | "
          "solve (s) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, args in cases:
        wall, solve_s = cold_plan(args, a.runs)
        if "refused" in name or "--pp" in args:  # no solve / the pipeline search: no ILP
            print(f"| {name} | {wall:.3f} | - | - | - |")
            continue
        wall_e, solve_e = cold_plan([*args, "--solver", "exhaustive"], a.runs)
        print(f"| {name} | {wall:.3f} | {solve_s:.3f} | {wall_e:.3f} | {solve_e:.3f} |")
    if a.no_brute:
        return
    print("\n| instance | candidates | ILP solve (s) | enumeration (s) | brute force (s) | "
          "brute / ILP | ILP / enumeration |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n, ti, te, tb in ilp_vs_brute(max(1, a.runs // 2)):
        print(f"| {name} | {n:,} | {ti:.3f} | {te:.3f} | {tb:.3f} | {tb / ti:.1f}x | "
              f"{ti / te:.1f}x |")


if __name__ == "__main__":
    main()
