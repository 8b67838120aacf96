"""amsp calibrate: measure the cluster's collectives and matmuls, write a ClusterSpec.

    torchrun --nproc-per-node=8 --nnodes=2 --rdzv-endpoint=HOST:29500 \\
        -m amsp_planner.cli.main calibrate --cluster dgx-h100-ndr --out my-cluster.yaml
    amsp calibrate --nproc 4 --out cpu.yaml            # launches torchrun on this host
    amsp plan --model tiny --gpus 4 --cluster cpu.yaml

Under torchrun every rank runs the measurement (amsp_planner/calibrate.py); rank 0 writes the
spec only after every rank has finished, atomically, so a killed run or a lost rank leaves no
file. Outside torchrun, ``--nproc`` (and ``--nnodes`` node agents on loopback) launches it here.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from amsp_planner.cli.options import Number
from amsp_planner.errors import AmspUserError

MAX_MESSAGE = 16 * 2**30
"""Largest calibrated message, bytes (--min-size / --max-size)."""


@click.command()
@click.option("--out", "-o", default="cluster.yaml", show_default=True,
              help="Where to write the calibrated cluster spec (YAML).")
@click.option("--cluster", "-c", default="cpu-local", show_default=True,
              help="Preset or spec file the output is based on (GPU memory, latencies...).")
@click.option("--name", default=None, help="Name of the written cluster (default: <base>-calibrated).")
@click.option("--min-size", default="4K", show_default=True,
              help="Smallest message (full tensor of one call), K/M/G suffixes are powers of 2.")
@click.option("--max-size", default=None,
              help="Largest message (default: 256M on GPUs, 4M on CPUs).")
@click.option("--ops", default="all_gather,reduce_scatter,all_reduce,all_to_all",
              show_default=True, help="Collectives to measure, comma-separated.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Element type of the measured tensors and matmuls.")
@click.option("--seconds-per-point", type=Number(0, 3600), default=0.25,
              show_default=True, help="Time budget of the timed calls of one message size, per pass.")
@click.option("--passes", type=click.IntRange(1, 1000), default=3, show_default=True,
              help="Passes over all sizes; each figure is the median over passes.")
@click.option("--matmul-size", type=click.IntRange(16, 65536), default=None,
              help="Side of the square matmul (default: 4096 on GPUs, 512 on CPUs).")
@click.option("--model", "-m", default=None,
              help="Also time the runtime's forward+backward of this model: sets achievable_fraction.")
@click.option("--seq-len", type=click.IntRange(1, 1048576), default=512, show_default=True,
              help="With --model: tokens per sequence.")
@click.option("--micro-batch", type=click.IntRange(1, 65536), default=1, show_default=True,
              help="With --model: sequences per forward+backward.")
@click.option("--fp8", "fp8_sizes", default=None, metavar="SIZES",
              help="GPUs with FP8 tensor cores: also measure the FP8 linear's speed-up over bf16 "
                   "(tensorwise, rowwise) at M, K, N in SIZES, e.g. 1024,4096,16384; FP8 plans "
                   "on the written cluster use it.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto",
              show_default=True, help="auto: nccl on CUDA, gloo otherwise.")
@click.option("--timeout", "timeout_s", type=Number(1, 86400), default=60.0,
              show_default=True, help="Seconds the ranks wait for a lost rank before failing.")
@click.option("--nproc", type=click.IntRange(1, 1024), default=None,
              help="Not under torchrun: launch torchrun on this host with this many ranks per node.")
@click.option("--nnodes", type=click.IntRange(1, 64), default=1, show_default=True,
              help="With --nproc: node agents to launch on this host (loopback).")
@click.option("--fail-rank", type=int, default=None, hidden=True)
def calibrate(out, cluster, name, min_size, max_size, ops, dtype, seconds_per_point, passes,
              matmul_size, model, seq_len, micro_batch, fp8_sizes, backend, timeout_s, nproc,
              nnodes, fail_rank):
    """Measure collective bus bandwidth and matmul throughput; write a ClusterSpec."""
    from amsp_planner.calibrate import OPS, check_out, under_torchrun
    from amsp_planner.specs import load_cluster, parse_batch

    base = load_cluster(cluster)
    if model is not None:
        from amsp_planner.specs import load_model

        load_model(model)  # a bad name fails here, once, with one line
    lo = parse_batch(min_size, "--min-size")
    hi = parse_batch(max_size, "--max-size") if max_size is not None else None
    if hi is not None and hi < lo:
        raise AmspUserError(f"--max-size {max_size} is below --min-size {min_size}: raise it")
    for option, size, text in (("--min-size", lo, min_size), ("--max-size", hi, max_size)):
        if size is not None and size > MAX_MESSAGE:  # each rank allocates it, and more
            raise AmspUserError(f"{option} {text}: at most 16G, the full tensor of one call "
                                "(each rank holds it; bus bandwidth is flat well before)")
    op_list = tuple(o.strip() for o in ops.split(",") if o.strip())
    bad = [o for o in op_list if o not in OPS]
    if bad or not op_list:
        raise AmspUserError(f"--ops: unknown collective '{bad[0] if bad else ops}': use some of "
                            f"{','.join(OPS)}")
    twice = sorted({o for o in op_list if op_list.count(o) > 1})
    if twice:
        raise AmspUserError(f"--ops: '{twice[0]}' given twice: give each collective once")
    if name is not None and not name.strip():
        raise AmspUserError("--name is empty: give the calibrated cluster a name, or drop "
                            "--name for <base>-calibrated")
    sizes = fp8_grid_sizes(fp8_sizes, base) if fp8_sizes is not None else ()
    check_out(out)
    if backend == "nccl":
        _check_nccl()
    if not under_torchrun():
        if nproc is None:
            raise AmspUserError(
                "not under torchrun (no RANK/WORLD_SIZE): run it with torchrun "
                "--nproc-per-node=R -m amsp_planner.cli.main calibrate ..., or give --nproc N "
                "to launch N ranks on this host")
        passthrough = ["--out", os.path.abspath(out), "--cluster", cluster, "--min-size", min_size,
                       "--ops", ",".join(op_list), "--dtype", dtype, "--seconds-per-point",
                       str(seconds_per_point), "--passes", str(passes), "--backend", backend,
                       "--timeout", str(timeout_s),
                       "--seq-len", str(seq_len), "--micro-batch", str(micro_batch)]
        for flag, value in (("--name", name), ("--max-size", max_size), ("--model", model),
                            ("--matmul-size", matmul_size), ("--fail-rank", fail_rank),
                            ("--fp8", fp8_sizes)):
            if value is not None:
                passthrough += [flag, str(value)]
        from amsp_planner.runtime.lifecycle import EXIT_SIGNALLED, Signalled

        try:
            rc = launch_local(nproc, nnodes, passthrough)
        except Signalled as e:
            click.echo(f"interrupted: {e.line_name}: the calibration is stopped, every rank "
                       f"ended; nothing written to {out}", err=True)
            sys.exit(EXIT_SIGNALLED.get(e.signum, 128 + e.signum))
        if rc != 0:
            click.echo(f"error: calibration failed (torchrun exit code {rc}); nothing written "
                       f"to {out}", err=True)
            sys.exit(1)
        return
    if nproc is not None:
        raise AmspUserError("--nproc: already under torchrun: drop --nproc/--nnodes (torchrun "
                            "sets the world)")
    _run_rank(base, out, name, lo, hi, op_list, dtype, seconds_per_point, passes, matmul_size,
              backend, timeout_s, fail_rank, model, seq_len, micro_batch, sizes)


def fp8_grid_sizes(text: str, base) -> tuple[int, ...]:
    """--fp8's sizes, checked: multiples of 16 from 16 to 65536 (the FP8 tensor cores' rule),
    on a cluster whose GPU has FP8 tensor cores and a CUDA device to measure on."""
    from amsp_planner.cost.fp8 import FP8_PEAK_RATIO

    try:
        sizes = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or any(s < 16 or s > 65536 or s % 16 for s in sizes):
        raise AmspUserError(f"--fp8 {text}: give comma-separated sizes, multiples of 16 from 16 "
                            "to 65536, e.g. --fp8 1024,4096,16384")
    if base.gpu.arch not in FP8_PEAK_RATIO:
        raise AmspUserError(f"--fp8: cluster {base.name}'s GPU ({base.gpu.name}, {base.gpu.arch})"
                            " has no FP8 tensor cores: calibrate on a Hopper or Blackwell "
                            "cluster, or drop --fp8")
    import torch

    if not torch.cuda.is_available():
        raise AmspUserError("--fp8: no CUDA device here: run the calibration on the GPU "
                            "nodes, or drop --fp8")
    return sizes


def _run_rank(base, out, name, lo, hi, ops, dtype, seconds_per_point, passes, matmul_size,
              backend, timeout_s, fail_rank, model, seq_len, micro_batch, fp8_sizes=()):
    import datetime

    from amsp_planner.calibrate import CalibrationConfig, run, stderr_progress, write_spec
    from amsp_planner.runtime.launch import leave

    cfg = CalibrationConfig(min_bytes=lo, max_bytes=hi, ops=ops, dtype=dtype,
                            seconds_per_point=seconds_per_point, passes=passes,
                            matmul_size=matmul_size,
                            matmul_seconds=min(1.0, max(0.2, 4 * seconds_per_point)),
                            backend=backend, timeout_s=timeout_s, fail_rank=fail_rank,
                            model=model, seq_len=seq_len, micro_batch=micro_batch,
                            fp8_sizes=fp8_sizes, progress=stderr_progress)
    try:
        spec = run(cfg, base, name)
    except RuntimeError as e:  # a lost rank: the collectives fail at the timeout
        rank = os.environ.get("RANK", "?")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        click.echo(f"error: rank {rank}: calibration failed ({first}); nothing written to {out}",
                   err=True)
        leave(1)
    if spec is not None:
        world = int(os.environ["WORLD_SIZE"])
        r = spec.gpus_per_node
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        header = (f"written by amsp calibrate on {when}: {world} ranks ({world // r} node(s) x "
                  f"{r}), {dtype}, based on {base.name}\n"
                  f"measured tables override the alpha-beta model for the (op, scope) they cover")
        write_spec(spec, out, header)
        click.echo(f"wrote {out}: {spec.name}, {len(spec.measured)} measured tables, matmul "
                   f"{spec.gpu.peak_bf16_tflop_per_s:.4g} TFLOP/s per rank", err=True)
    leave(0)


def launch_local(nproc: int, nnodes: int, args: list[str]) -> int:
    """Run `amsp calibrate args` under torchrun on this host: `nnodes` node agents on loopback,
    `nproc` ranks each. Returns the first non-zero agent exit code (0 when all succeed)."""
    import subprocess

    from amsp_planner.runtime.agent import QUIET_ENV
    from amsp_planner.runtime.launch import free_port, torchrun_cmd
    from amsp_planner.runtime.lifecycle import LAUNCHER_PID_ENV, raising

    port = free_port()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env[QUIET_ENV] = "1"  # torchrun's warnings not on this terminal
    if nnodes > 1:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The agents run in sessions of their own and die with this process (the parent-death
    # signal, runtime/agent.py): a Ctrl-C, SIGTERM or SIGHUP reaches this process alone, which
    # ends them (torchrun ends its ranks) and prints one line; a killed calibration writes
    # nothing.
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    with raising(signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        procs = [subprocess.Popen(torchrun_cmd(nproc, port, nnodes, node) + [
            "-m", "amsp_planner.cli.main", "calibrate", *args], env=env,
            start_new_session=True) for node in range(nnodes)]
        try:
            codes = [p.wait() for p in procs]
        except BaseException:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
            raise
    return next((c for c in codes if c != 0), 0)


def _check_nccl() -> None:
    """--backend nccl on a host that cannot run it: refused before any rank starts."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return  # the launch refuses it with the runtime extra's install line
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        raise AmspUserError("--backend nccl: this torch has no NCCL (a CPU build): use "
                            "--backend gloo, or a CUDA build of torch")
    if not torch.cuda.is_available():
        raise AmspUserError("--backend nccl: no CUDA GPU is visible on this host: use --backend "
                            "gloo, or run it where the GPUs are")
