"""Fidelity of the cost model: predicted against measured step time on an emulated cluster.

    sudo python bench/fidelity.py                       # 2 nodes x 4 ranks, 200 Mbit/s links
    python bench/fidelity.py --nodes 2 --nproc 4 --rate-mbit 200 --steps 6 --json out.json

1. Brings up an emulated cluster (amsp_planner/emulate.py): network namespaces joined by veths
   whose bandwidth tc limits, one torchrun agent per node, gloo over the links.
2. Calibrates it with `amsp calibrate` (measured bus-bandwidth tables, matmul rate).
3. Plans the job with `amsp plan --cluster <calibrated spec>` (the planner's choice).
4. Trains every strategy of the set (ZeRO-1/2/3, DDP, HSDP, MiCS, ZeRO++, AMSP points, the
   planner's choice) with the bundled runtime, round-robin: `--rounds` rounds of `--steps`
   steps each, reading the uplinks' byte counters, and compares the median measured step time
   (the first step of each round excluded, the rest pooled) with the cost model's prediction
   on the calibrated spec.
Reports per-strategy error, the median error, Spearman's rank correlation between predicted
and measured order, and where the planner's choice lands (rows of one strategy, such as the
planner's choice and the member of the set it equals, pooled: one strategy measured twice is
not compared with itself); also bytes on the wire per step
next to the runtime's logical cross-node bytes. Targets: median error < 15%, rank correlation
>= 0.9, the planner's choice fastest or within 5% of the fastest.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from amsp_planner.emulate import EmulationUnavailable, emulated_cluster  # noqa: E402

MODEL = str(REPO / "bench" / "models" / "fidelity-3m.yaml")
WORKER = str(REPO / "bench" / "_fidelity_worker.py")


def strategies(world: int, per_node: int) -> list[tuple[str, str]]:
    """(name, strategy) of the set; AMSP points are the non-baseline factor combinations."""
    r = per_node
    return [
        ("ddp", "ddp"), ("zero1", "zero1"), ("zero2", "zero2"), ("zero3", "zero3"),
        ("hsdp", "hsdp"), ("mics-2", "mics-2"), ("zero++", "zeropp"),
        ("amsp os=R", f"p=1,g=1,os={r}"), ("amsp g=R,os=R", f"p=1,g={r},os={r}"),
        ("amsp g=R,os=N", f"p=1,g={r},os={world}"), ("amsp p=R,g=R,os=N", f"p={r},g={r},os={world}"),
        ("amsp p=2,g=R,os=N", f"p=2,g={r},os={world}"),
    ]


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _env() -> dict:
    return {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _check(results: list[tuple[int, str, str]], what: str) -> None:
    for node, (rc, _, err) in enumerate(results):
        if rc:
            raise SystemExit(f"{what} failed on node {node} (exit {rc}):\n{err[-4000:]}")


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="amsp-fidelity-"))
    world = args.nodes * args.nproc
    batch = world * args.micro_batches
    out: dict = {"nodes": args.nodes, "nproc_per_node": args.nproc, "rate_mbit": args.rate_mbit,
                 "model": Path(MODEL).name, "seq_len": args.seq_len, "batch_seqs": batch,
                 "steps": args.steps, "rounds": args.rounds, "precision": args.precision}
    with emulated_cluster(args.nodes, args.rate_mbit, args.delay_ms) as emu:
        out["notes"] = list(emu.notes)
        cal = work / "calibrated.yaml"
        t0 = time.perf_counter()
        res = emu.run_torchrun(args.nproc, [
            "-m", "amsp_planner.cli.main", "calibrate", "--out", str(cal), "--cluster",
            "cpu-local", "--max-size", args.max_size, "--dtype", args.precision,
            "--seconds-per-point", str(args.seconds_per_point), "--passes", str(args.passes),
            "--matmul-size", "256",
            "--model", MODEL, "--seq-len", str(args.seq_len), "--micro-batch", "1"],
            env=_env(), timeout=900)
        _check(res, "calibration")
        out["calibrate_s"] = time.perf_counter() - t0
        print(res[0][2].strip().splitlines()[-1], file=sys.stderr)
        plan_json = work / "plan.json"
        p = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", "plan", "--model", MODEL,
                            "--gpus", str(world), "--cluster", str(cal), "--seq-len",
                            str(args.seq_len), "--global-batch-seqs", str(batch),
                            "--micro-batch", "1", "--activation-checkpointing", "off",
                            "--tp", "1",  # the strategy set above is data parallel only
                            "--precision", args.precision, "-o", str(plan_json)],
                           capture_output=True, text=True, env={**os.environ, **_env()})
        if p.returncode:
            raise SystemExit(f"amsp plan failed:\n{p.stderr}")
        from amsp_planner.plan import load_plan

        plan = load_plan(plan_json)  # the job every prediction is made for, and its choice
        chosen = str(plan.strategy)
        out["planner_choice"] = chosen
        todo = strategies(world, args.nproc)
        if args.only:
            todo = [(n, s) for n, s in todo if n in args.only]
        todo.append(("planner", chosen))
        cfg = {"out": str(work), "model": MODEL, "cluster": str(cal), "seq_len": args.seq_len,
               "batch_seqs": batch, "precision": args.precision, "steps": args.steps,
               "rounds": args.rounds, "strategies": todo}
        (work / "cfg.json").write_text(json.dumps(cfg))
        t0 = time.perf_counter()
        res = emu.run_torchrun(args.nproc, [WORKER, str(work / "cfg.json")], env=_env(),
                               timeout=3000)
        _check(res, "training")
        out["train_s"] = time.perf_counter() - t0
    out["rows"] = _rows(work, todo, plan.job, args)
    out["summary"] = _summary(out["rows"])
    out["calibrated_spec"] = cal.read_text()
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return out


def _rows(work: Path, todo, job, args) -> list[dict]:
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.strategy import parse_strategy_or_baseline

    world = job.num_gpus
    rows = []
    for name, text in todo:
        rep = json.loads((work / f"{name}.json").read_text())
        s = parse_strategy_or_baseline(text, world, job.gpus_per_node)
        ev = evaluate(job, s)
        measured = statistics.median(rep["timed_step_s"])
        wire = statistics.fmean(b["tx"] for b in rep["link_bytes"]) / (args.steps * args.rounds)
        logical = ev.bytes_per_rank("inter") * job.gpus_per_node
        rows.append({
            "name": name, "strategy": str(s), "predicted_s": ev.step_s, "measured_s": measured,
            "samples_s": list(rep["timed_step_s"]),
            "same_as": str(s.with_(grad_accum=None)),
            "error": (ev.step_s - measured) / measured,
            "predicted_compute_s": ev.time.compute_s,
            "predicted_optimizer_s": ev.time.optimizer_s,
            "predicted_exposed_comm_s": ev.time.exposed_comm_s,
            "logical_inter_bytes_per_node_step": logical, "wire_tx_bytes_per_node_step": wire,
        })
    return rows


def _summary(rows: list[dict]) -> dict:
    """Median error and rank correlation over the set; the planner's choice against the fastest
    strategy. Rows of one strategy (the planner's choice is often a member of the set, named
    twice) are one strategy measured twice: their samples are pooled, so the choice is never
    compared with a second measurement of itself."""
    base = [r for r in rows if r["name"] != "planner"]
    pred = [r["predicted_s"] for r in base]
    meas = [r["measured_s"] for r in base]
    pooled: dict[str, list[float]] = {}
    names: dict[str, list[str]] = {}
    for r in rows:
        pooled.setdefault(r["same_as"], []).extend(r["samples_s"])
        names.setdefault(r["same_as"], []).append(r["name"])
    median = {k: statistics.median(v) for k, v in pooled.items()}
    fastest = min(median, key=median.get)
    planner = next(r for r in rows if r["name"] == "planner")["same_as"]
    return {
        "median_abs_error": statistics.median(abs(r["error"]) for r in base),
        "spearman": spearman(pred, meas),
        "fastest_measured": " = ".join(names[fastest]),
        "planner_measured_s": median[planner],
        "planner_same_as": [n for n in names[planner] if n != "planner"],
        "planner_vs_fastest": median[planner] / median[fastest] - 1,
    }


def markdown(out: dict) -> str:
    lines = ["| strategy | string | predicted (ms) | measured (ms) | error | cross-node MB/step/node: "
             "logical | wire |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in out["rows"]:
        lines.append(f"| {r['name']} | `{r['strategy']}` | {r['predicted_s'] * 1e3:.0f} | "
                     f"{r['measured_s'] * 1e3:.0f} | {r['error']:+.0%} | "
                     f"{r['logical_inter_bytes_per_node_step'] / 1e6:.2f} | "
                     f"{r['wire_tx_bytes_per_node_step'] / 1e6:.2f} |")
    s = out["summary"]
    lines += ["", f"median |error| {s['median_abs_error']:.1%}, Spearman rank correlation "
              f"{s['spearman']:.2f}, fastest measured: {s['fastest_measured']}, planner's choice "
              f"`{out['planner_choice']}` is {s['planner_vs_fastest']:+.1%} from the fastest"
              + (f" (one strategy with {', '.join(s['planner_same_as'])}: their samples pooled, "
                 f"{s['planner_measured_s'] * 1e3:.0f} ms)" if s["planner_same_as"] else "")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4, help="ranks per node")
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="uplink Mbit/s each way")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=6, help="steps per strategy and round")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin passes over the set")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--max-size", default="4M", help="largest calibrated message")
    ap.add_argument("--seconds-per-point", type=float, default=0.2)
    ap.add_argument("--passes", type=int, default=3, help="calibration passes (median of them)")
    ap.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="run only this member of the set (repeatable; the planner's choice "
                         "always runs)")
    ap.add_argument("--json", default=None, help="write the full results here")
    args = ap.parse_args()
    if args.only:
        known = [n for n, _ in strategies(args.nodes * args.nproc, args.nproc)]
        args.only = set(args.only)
        if args.only - set(known):
            ap.error(f"--only: unknown name(s) {sorted(args.only - set(known))}; choose from "
                     f"{', '.join(known)}")
    try:
        out = run(args)
    except EmulationUnavailable as e:
        raise SystemExit(f"emulated cluster unavailable: {e}") from None
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(markdown(out))


if __name__ == "__main__":
    main()
