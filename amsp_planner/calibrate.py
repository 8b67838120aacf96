"""Measure a cluster: collective bus bandwidths by message size, and matmul throughput.

    torchrun --nproc-per-node=8 --nnodes=4 ... -m amsp_planner.cli.main calibrate --out c.yaml
    amsp calibrate --nproc 4 --out cpu.yaml        # not under torchrun: launches it on this host

``run(cfg)`` runs inside every rank of an initialised-or-not torch.distributed job (torch is
imported inside the functions, so the planner path never pays for it) and returns, on rank 0, a
``ClusterSpec`` with measured tables; ``write_spec`` then writes it atomically.

This module runs the passes and builds and writes the spec; the options are in
``calibrate_config.py``, the collective points in ``calibrate_comm.py``, the matmul, quantizer,
optimizer and model timings in ``calibrate_compute.py``.

What is measured (nccl-tests conventions: bus bandwidth = factor(m) * size / time, factor
(m-1)/m for all-gather, reduce-scatter and all-to-all, 2(m-1)/m for all-reduce; ``size`` is the
full tensor of one call: the gathered output, the reduce-scatter input, the all-reduce tensor,
the all-to-all send buffer):

- scope ``intra``: each node's ranks (LOCAL_WORLD_SIZE of them) form one group; every node
  measures at once, as every node does during training. Rank 0 keeps the mean over nodes.
- scope ``inter``: one rank per node (local rank 0 of each), the other ranks idle. The table is
  the bandwidth one node gets to the others; ``Topology`` shares it among the ranks of a node
  that cross nodes at the same time. With a single node there is no inter table.
- quantization: the runtime's int8/int4 block quantizers (qwZ, qgZ) on every rank at once
  become ``quant_gbyte_per_s``; the runtime's AdamW step becomes ``optimizer_gbyte_per_s``;
  with ``model``, the runtime's forward + backward of that model sets ``achievable_fraction``
  (model FLOP/s over the matmul rate).
- matmul: every rank multiplies square matrices at the same time (on a CPU "cluster" they share
  the cores, as the runtime's ranks do); on CPU the mean per-rank FLOP/s becomes the
  ``peak_bf16_tflop_per_s`` (the base preset's ``achievable_fraction`` still applies on top).
- on GPUs: the matmul curve, (T x 4096) @ (4096 x 11008) at several T in bf16 and fp32, fitted
  to t = FLOPs / (peak x fraction) + overhead (``achievable_fraction``, ``kernel_overhead_us``,
  ``peak_fp32_tflop_per_s``); and ``comm_compute_slowdown``: a matmul loop timed alone and under
  a concurrent all-gather + reduce-scatter on another stream; with ``--fp8`` the FP8 linear's
  speed-ups over bf16, tensorwise and rowwise, on a grid of shapes (``calibrate_fp8.py``,
  ``gpu.fp8_linear``).

Each point: one untimed warm-up call, one timed probe that fixes how many calls fit in the
point's time budget (every member agrees: the probe time is max-reduced), a barrier, then the
timed calls; the time of a point is the slowest member's. The grid is measured ``passes``
times and every figure is the median over passes. A lost rank makes the others fail at
the process-group timeout, so a partial run never reaches the write (see ``write_spec``).
"""

from __future__ import annotations

import os
import statistics
import sys

from amsp_planner.calibrate_comm import measure_point, process_groups
from amsp_planner.calibrate_compute import (  # noqa: F401 - CURVE_TOKENS, fit_*: this API too
    CURVE_TOKENS,
    fit_curve,
    fit_rate,
    measure_matmul,
    measure_matmul_curve,
    measure_optimizer,
    measure_quant,
    measure_slowdown,
    measure_training,
)
from amsp_planner.calibrate_config import OPS, CalibrationConfig, World  # noqa: F401 - this API
from amsp_planner.report.fmt import bytes_h


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of 4 times min_bytes up to max_bytes (max_bytes included)."""
    out, s = [], min_bytes
    while s < max_bytes:
        out.append(s)
        s *= 4
    out.append(max_bytes)
    return sorted(set(out))


# ----- process groups ---------------------------------------------------------------------
def init(cfg: CalibrationConfig) -> tuple[World, str]:
    """Initialise torch.distributed (if not yet) and return (world, device)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    device = "cpu"
    if cuda and backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    rank, size = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if size % local:
        raise RuntimeError(f"world of {size} ranks is not a whole number of {local}-rank nodes")
    node = int(os.environ.get("GROUP_RANK", rank // local))
    return World(rank, size, local, node), device


# ----- the whole run ----------------------------------------------------------------------
def run(cfg: CalibrationConfig, base, name: str | None = None):
    """Measure; returns the calibrated ClusterSpec on rank 0 (None elsewhere) after a world
    barrier, so that rank 0 only writes once every rank has finished."""
    import torch
    import torch.distributed as dist

    world, device = init(cfg)
    top = cfg.max_bytes or (256 * 2**20 if device.startswith("cuda") else 4 * 2**20)
    sizes = default_sizes(cfg.min_bytes, max(top, cfg.min_bytes))
    say = cfg.progress if world.rank == 0 and cfg.progress else (lambda msg: None)
    intra, inter = process_groups(world)
    scopes = [("intra", intra, world.local_size > 1)]
    if world.nodes > 1:
        scopes.append(("inter", inter, True))
    else:
        say("single node: measuring intra-node groups only (no inter-node tables; cross-node "
            "groups keep the alpha-beta model)")
    total = cfg.passes * sum(1 for _, _, on in scopes if on) * len(cfg.ops) * len(sizes)
    done = 0
    results: dict[tuple[str, str], list[tuple[int, float]]] = {}
    say(f"calibrating {world.size} ranks ({world.nodes} node(s) x {world.local_size}), "
        f"backend {dist.get_backend()}, {cfg.dtype}, {len(sizes)} sizes "
        f"{bytes_h(sizes[0])}..{bytes_h(sizes[-1])}, {cfg.passes} pass(es)")

    def mean_over_world(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t.item()) / world.size

    flops_runs, quant_runs, opt_runs, train_runs = [], [], [], []
    for pas in range(1, cfg.passes + 1):
        for scope, group, on in scopes:
            if not on:
                continue
            for op in cfg.ops:
                for size in sizes:
                    point = (size, 0.0)
                    if group is not None:
                        point = measure_point(op, size, group, cfg, device)
                    # Share the point with the world: rank 0 needs every node's intra figure.
                    row = torch.tensor([point[0], point[1], 1.0 if group is not None else 0.0],
                                       dtype=torch.float64, device=device)
                    rows = [torch.zeros_like(row) for _ in range(world.size)]
                    dist.all_gather(rows, row)
                    lead = [rows[nd * world.local_size].cpu() for nd in range(world.nodes)]
                    lead = [r for r in lead if r[2] > 0]
                    bw = statistics.fmean(float(r[1]) for r in lead)
                    results.setdefault((op, scope), []).append((int(lead[0][0]), bw))
                    done += 1
                    if cfg.fail_rank == world.rank:
                        print(f"rank {world.rank}: dying after point {done} (fault injection)",
                              file=sys.stderr, flush=True)
                        os._exit(9)
                    say(f"[{done}/{total}] {op:<14} {scope:<5} "
                        f"{bytes_h(int(lead[0][0])):>9}  busbw {bw / 1e9:8.3f} GB/s")
        flops_runs.append(mean_over_world(measure_matmul(cfg, device)))
        quant_runs.append(mean_over_world(measure_quant(cfg, device)))
        opt_runs.append(mean_over_world(measure_optimizer(cfg, device)))
        if cfg.model:
            train_runs.append(mean_over_world(measure_training(cfg, device)))
        say(f"pass {pas}/{cfg.passes}: matmul ({cfg.dtype}, every rank at once) "
            f"{flops_runs[-1] / 1e12:.4f} TFLOP/s per rank; qwZ/qgZ (de)quantization "
            f"{quant_runs[-1] / 1e9:.3f} GB/s of 16-bit input; optimizer step "
            f"{opt_runs[-1] / 1e9:.3f} GB/s"
            + (f"; {cfg.model} forward+backward {train_runs[-1] / 1e12:.4f} model TFLOP/s"
               if train_runs else ""))
    flops = statistics.median(flops_runs)
    quant = statistics.median(quant_runs)
    opt = statistics.median(opt_runs)
    train_rate = statistics.median(train_runs) if train_runs else None
    say(f"medians over {cfg.passes} pass(es): matmul {flops / 1e12:.4f} TFLOP/s per rank, "
        f"(de)quantization {quant / 1e9:.3f} GB/s, optimizer step {opt / 1e9:.3f} GB/s"
        + (f", {cfg.model} forward+backward ({cfg.micro_batch} x {cfg.seq_len} tokens) "
           f"{train_rate / 1e12:.4f} model TFLOP/s = {train_rate / flops:.1%} of matmul"
           if train_rate else ""))
    gpu = None
    if device.startswith("cuda"):
        peak = base.gpu.peak_flop_per_s("bf16")
        bf16 = fit_curve(measure_matmul_curve(cfg, device, "bf16"), peak)
        fp32 = fit_rate(measure_matmul_curve(cfg, device, "fp32"))
        gpu = {"achievable_fraction": bf16[0], "kernel_overhead_us": bf16[1],
               "peak_fp32_tflop_per_s": fp32[0] / bf16[0] / 1e12}
        if world.size > 1:
            gpu["comm_compute_slowdown"] = mean_over_world(measure_slowdown(cfg, device, None))
        say(f"matmul curve (bf16): {bf16[0]:.1%} of peak at large sizes, {bf16[1]:.1f} us per "
            f"kernel; fp32 {fp32[0] / 1e12:.1f} TFLOP/s"
            + (f"; compute slowdown under collectives {gpu['comm_compute_slowdown']:.3f}"
               if "comm_compute_slowdown" in gpu else ""))
    if device.startswith("cuda") and cfg.fp8_sizes:
        from amsp_planner.calibrate_fp8 import calibrate_grids

        n = len(cfg.fp8_sizes) ** 3
        done_fp8 = iter(range(1, n + 1))
        gpu["fp8_linear"] = calibrate_grids(cfg.fp8_sizes, device, lambda row: say(
            f"[{next(done_fp8)}/{n}] FP8 linear M={row['M']} K={row['K']} N={row['N']}: "
            f"tensorwise {row['bf16_s'] / row['tensorwise_s']:.3f}x, rowwise "
            f"{row['bf16_s'] / row['rowwise_s']:.3f}x of bf16"))
    dist.barrier()  # every rank finished: only now may rank 0 write
    if world.rank != 0:
        return None
    return build_spec(base, world.local_size, results, flops, name, train_rate, quant, opt,
                      gpu=gpu)


def build_spec(base, local_size: int, results: dict, flop_per_s: float, name: str | None = None,
               train_flop_per_s: float | None = None, quant_bytes_per_s: float | None = None,
               optimizer_bytes_per_s: float | None = None, gpu: dict | None = None):
    """The base ClusterSpec with R = local_size, measured tables, the measured (de)quantization
    throughput and optimizer-step traffic. On CPU processes the measured matmul rate becomes
    the peak (and, when the training rate was measured, achievable_fraction = training /
    matmul); on GPUs (`gpu`: the fitted matmul curve, fp32 peak and compute slowdown) the
    preset's peak stays and the curve sets the fraction of it."""
    from amsp_planner.specs.cluster import ClusterSpec

    tables = []
    for (op, scope), pts in results.items():
        by_size: dict[int, list[float]] = {}
        for s, bw in pts:  # one figure per pass (rounded sizes may also repeat)
            by_size.setdefault(s, []).append(bw)
        pts = sorted((s, statistics.median(v)) for s, v in by_size.items())
        tables.append({"op": op, "scope": scope, "points": [
            {"size_bytes": s, "busbw_gbyte_per_s": round(bw / 1e9, 6)} for s, bw in pts]})
    data = base.model_dump(mode="json")
    data.update(name=name or f"{base.name}-calibrated", gpus_per_node=local_size,
                measured=tables)
    if gpu:
        data["gpu"].update(gpu)
    else:
        peak = max(flop_per_s, train_flop_per_s or 0.0)
        data["gpu"]["peak_bf16_tflop_per_s"] = max(peak / 1e12, 1e-9)
        if train_flop_per_s:
            data["gpu"]["achievable_fraction"] = train_flop_per_s / peak
    if quant_bytes_per_s:
        data["gpu"]["quant_gbyte_per_s"] = quant_bytes_per_s / 1e9
    if optimizer_bytes_per_s:
        data["gpu"]["optimizer_gbyte_per_s"] = optimizer_bytes_per_s / 1e9
    return ClusterSpec.model_validate(data)


SPEC_MARK = "# written by amsp calibrate"
"""First words of every spec this module writes: an earlier one may be replaced, nothing else."""


def check_out(path: str) -> None:
    """Refuse, before measuring, an --out that could not be written or holds something else."""
    from amsp_planner.outfile import check_output, contains

    check_output(path, "--out", "a calibrated cluster spec", contains(SPEC_MARK))


def write_spec(spec, path: str, header: str = "") -> None:
    """Write `spec` as YAML to `path` atomically (a temporary file next to it, then a rename,
    so a reader or a killed run never sees half a file), under `header` as comments; the
    header starts with SPEC_MARK."""
    import yaml

    from amsp_planner.outfile import contains, write_output

    text = "".join(f"# {line}\n" for line in header.splitlines())
    assert text.startswith(SPEC_MARK)
    text += yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
    write_output(path, "--out", "a calibrated cluster spec", contains(SPEC_MARK), text)


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
