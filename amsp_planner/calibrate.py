"""Measure a cluster: collective bus bandwidths by message size, and matmul throughput.

    torchrun --nproc-per-node=8 --nnodes=4 ... -m amsp_planner.cli.main calibrate --out c.yaml
    amsp calibrate --nproc 4 --out cpu.yaml        # not under torchrun: launches it on this host

``run(cfg)`` runs inside every rank of an initialised-or-not torch.distributed job (torch is
imported inside the functions, so the planner path never pays for it) and returns, on rank 0, a
``ClusterSpec`` with measured tables; ``write_spec`` then writes it atomically.

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
  a concurrent all-gather + reduce-scatter on another stream.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from amsp_planner.report.fmt import bytes_h

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
_BUS = {"all_gather": lambda m: (m - 1) / m, "reduce_scatter": lambda m: (m - 1) / m,
        "all_to_all": lambda m: (m - 1) / m, "all_reduce": lambda m: 2 * (m - 1) / m}


@dataclass
class CalibrationConfig:
    min_bytes: int = 4096
    """Smallest full tensor of one call; sizes go up by 4x (rounded down to the group)."""
    max_bytes: int | None = None
    """Largest (None: 256 MiB on GPU, 4 MiB on CPU)."""
    ops: tuple[str, ...] = OPS
    dtype: str = "bf16"
    """Element type of the measured tensors (bf16 or fp32)."""
    seconds_per_point: float = 0.25
    """Time budget of the timed calls of one (op, scope, size) point, per pass."""
    passes: int = 3
    """Passes over the whole grid (and the matmul, quantizer and model timings); each point
    keeps the median over passes, so a slow spell of the machine, which hits a run of
    consecutive points within one pass, moves no point."""
    min_iters: int = 2
    max_iters: int = 50
    matmul_size: int | None = None
    """Side of the square matmul (None: 4096 on GPU, 512 on CPU)."""
    matmul_seconds: float = 1.0
    model: str | None = None
    """Also time the bundled runtime's forward + backward of this model (preset or file) on
    every rank at once; its model FLOP/s over the matmul rate becomes ``achievable_fraction``."""
    seq_len: int = 512
    micro_batch: int = 1
    backend: str = "auto"
    """'auto' (nccl on CUDA, else gloo), 'gloo' or 'nccl'."""
    timeout_s: float = 60.0
    """Process-group timeout: how long ranks wait for a lost rank before failing."""
    fail_rank: int | None = None
    """Testing aid: this rank dies hard after the first point (a lost rank)."""
    progress: Callable[[str], None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_size: int
    node: int

    @property
    def nodes(self) -> int:
        return self.size // self.local_size


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


def _groups(world: World):
    """(intra group of this rank or None, inter group of this rank or None); all ranks create
    every group in the same order, as torch requires."""
    import torch.distributed as dist

    r, n = world.local_size, world.nodes
    intra = inter = None

    def back(pg, ranks):
        # a two-member group's second connection, as the runtime's groups have (Group.pg_back)
        if len(ranks) == 2:
            _BACK[id(pg)] = dist.new_group(ranks)

    if r > 1:
        for node in range(n):
            ranks = list(range(node * r, (node + 1) * r))
            pg = dist.group.WORLD if n == 1 else dist.new_group(ranks)
            back(pg, ranks)
            if world.rank in ranks:
                intra = pg
    if n > 1:
        ranks = [node * r for node in range(n)]
        pg = dist.group.WORLD if r == 1 else dist.new_group(ranks)
        back(pg, ranks)
        if world.rank in ranks:
            inter = pg
    return intra, inter


_BACK: dict[int, object] = {}
"""id(process group) -> its second connection, for groups of two."""


def _dtype(cfg: CalibrationConfig):
    """The torch dtype of cfg.dtype, as the runtime names them."""
    from amsp_planner.runtime.engine import DTYPES

    return DTYPES[cfg.dtype]


# ----- one point --------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _call(op: str, bufs, group) -> None:
    import torch.distributed as dist

    inp, out = bufs
    if op == "all_gather":
        dist.all_gather_single(out, inp, group=group)
    elif op == "reduce_scatter":
        if inp.device.type == "cpu":  # measure what the runtime runs on gloo
            from amsp_planner.runtime.collectives import Group, _ring_reduce_scatter

            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            g = Group("calibrate", ranks, ranks.index(dist.get_rank()), group,
                      pg_back=_BACK.get(id(group)))
            _ring_reduce_scatter(out, inp, g)
        else:
            dist.reduce_scatter_single(out, inp, group=group)
    elif op == "all_reduce":
        dist.all_reduce(inp, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp, group=group)
    else:  # pragma: no cover - OPS is closed
        raise AssertionError(op)


def _buffers(op: str, elems: int, m: int, dtype, device: str):
    import torch

    full = torch.ones(elems, dtype=dtype, device=device)
    if op == "all_gather":
        return torch.ones(elems // m, dtype=dtype, device=device), full
    if op == "reduce_scatter":
        return full, torch.empty(elems // m, dtype=dtype, device=device)
    if op == "all_reduce":
        return full, None
    return full, torch.empty_like(full)


def _max_over(group, value: float, device: str) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure_point(op: str, size_bytes: int, group, cfg: CalibrationConfig, device: str
                  ) -> tuple[int, float]:
    """(size actually used, bus bandwidth in bytes/s) of `op` on `group` at `size_bytes`."""
    import torch.distributed as dist

    dtype = _dtype(cfg)
    esize = dtype.itemsize
    m = dist.get_world_size(group)
    elems = max(m, size_bytes // esize // m * m)
    bufs = _buffers(op, elems, m, dtype, device)
    _call(op, bufs, group)  # warm-up: connections, allocator
    _sync(device)
    t0 = time.perf_counter()
    _call(op, bufs, group)
    _sync(device)
    probe = _max_over(group, time.perf_counter() - t0, device)
    iters = int(min(cfg.max_iters, max(cfg.min_iters, cfg.seconds_per_point / max(probe, 1e-9))))
    dist.barrier(group=group)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        _call(op, bufs, group)
    _sync(device)
    per_call = _max_over(group, (time.perf_counter() - t0) / iters, device)
    return elems * esize, _BUS[op](m) * elems * esize / per_call


def measure_matmul(cfg: CalibrationConfig, device: str) -> float:
    """FLOP/s of this rank on square matmuls (all ranks measure at the same time)."""
    import torch

    n = cfg.matmul_size or (4096 if device.startswith("cuda") else 512)
    dtype = _dtype(cfg)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    _sync(device)
    t0, calls = time.perf_counter(), 0
    while True:
        torch.mm(a, b)
        calls += 1
        _sync(device)
        if time.perf_counter() - t0 >= cfg.matmul_seconds and calls >= 3:
            break
    return 2 * n**3 * calls / (time.perf_counter() - t0)


CURVE_TOKENS = (256, 1024, 4096, 16384)
"""Tokens of the (T x 4096) @ (4096 x 11008) matmuls the GPU curve is measured at: a
LLaMA-7B MLP projection at micro-batches from a quarter to four sequences of 4096."""


def fit_rate(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(FLOP/s at large sizes, overhead seconds) from (FLOPs, seconds) of single matmuls: the
    least-squares line t = FLOPs / rate + overhead (cost/compute.py)."""
    import numpy as np

    flops, secs = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    slope, icpt = np.polyfit(flops, secs, 1)
    return float(1.0 / slope), float(max(0.0, icpt))


def fit_curve(points: list[tuple[float, float]], peak: float) -> tuple[float, float]:
    """(achievable_fraction, kernel_overhead_us) of the matmul curve against `peak`."""
    rate, over = fit_rate(points)
    return min(1.0, rate / peak), over * 1e6


def _time_loop(fn, device: str, seconds: float) -> float:
    fn()
    _sync(device)
    t0, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
        _sync(device)
    return (time.perf_counter() - t0) / calls


def measure_matmul_curve(cfg: CalibrationConfig, device: str, dtype_name: str
                         ) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of one matmul at each of ``CURVE_TOKENS`` (GPU)."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    w = torch.randn(4096, 11008, device=device, dtype=dt)
    out = []
    for t in CURVE_TOKENS:
        x = torch.randn(t, 4096, device=device, dtype=dt)
        secs = _time_loop(lambda x=x: torch.mm(x, w), device, cfg.matmul_seconds / 4)
        out.append((2.0 * t * 4096 * 11008, secs))
    return out


def measure_slowdown(cfg: CalibrationConfig, device: str, group) -> float:
    """comm_compute_slowdown (GPU): a matmul loop timed alone and while an all-gather and a
    reduce-scatter run on another stream for longer than it; with the collectives spanning the
    compute, c' = c / (1 - s), so s = 1 - alone / under."""
    import torch
    import torch.distributed as dist

    m = dist.get_world_size(group)
    a = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    elems = 32 * 2**20 // m * m
    full = torch.empty(elems, device=device, dtype=torch.bfloat16)
    part = torch.empty(elems // m, device=device, dtype=torch.bfloat16)

    def matmuls():
        for _ in range(20):
            torch.mm(a, b)

    alone = _time_loop(matmuls, device, cfg.matmul_seconds / 2)
    side = torch.cuda.Stream()
    runs = []
    for _ in range(3):
        dist.barrier(group)
        with torch.cuda.stream(side):
            for _ in range(max(4, int(4 * alone / 1e-3))):
                dist.all_gather_into_tensor(full, part, group=group)
                dist.reduce_scatter_tensor(part, full, group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        matmuls()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3)
        side.synchronize()
    return max(0.0, min(1.0, 1.0 - alone / statistics.median(runs)))


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
    intra, inter = _groups(world)
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
    dist.barrier()  # every rank finished: only now may rank 0 write
    if world.rank != 0:
        return None
    return build_spec(base, world.local_size, results, flops, name, train_rate, quant, opt,
                      gpu=gpu)


def measure_quant(cfg: CalibrationConfig, device: str, elems: int = 2**20) -> float:
    """Bytes of 16-bit input per second through the runtime's int8 and int4 block quantizers,
    counted as the cost model does: a quantize and a dequantize pass over the 16-bit elements."""
    import torch

    from amsp_planner.runtime.quant import dequantize, qbytes, quantize_into

    x = torch.randn(elems, device=device).to(torch.bfloat16)
    rates = []
    for bits in (8, 4):
        buf = torch.empty(qbytes(elems, bits, 256), dtype=torch.uint8, device=device)
        quantize_into(buf, x, bits, 256)
        dequantize(buf, elems, bits, 256)
        _sync(device)
        t0, calls = time.perf_counter(), 0
        while calls < 3 or time.perf_counter() - t0 < cfg.matmul_seconds / 2:
            quantize_into(buf, x, bits, 256)
            dequantize(buf, elems, bits, 256)
            calls += 1
            _sync(device)
        rates.append(2 * 2 * elems * calls / (time.perf_counter() - t0))
    return statistics.fmean(rates)


def measure_optimizer(cfg: CalibrationConfig, device: str, elems: int = 2**20) -> float:
    """Bytes per second of the runtime's optimizer step (its AdamW on an fp32 master shard of
    `elems`, from the gradient in the training dtype, then the cast of the new parameters),
    counted as the cost model counts them (``optimizer_bytes_per_element``); all ranks at once."""
    import torch

    from amsp_planner.cost.step_time import optimizer_bytes_per_element
    from amsp_planner.runtime.engine import OptimConfig, adamw_

    dtype = _dtype(cfg)
    esize = dtype.itemsize
    p = torch.randn(elems, device=device)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    g = torch.randn(elems, device=device).to(dtype)
    o = OptimConfig()

    def step(k: int) -> None:
        adamw_(p, m, v, g, o, k)
        p.to(dtype)  # the new parameters, as the runtime casts them for the update gather

    step(1)
    _sync(device)
    t0, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - t0 < cfg.matmul_seconds / 2:
        step(calls + 2)
        calls += 1
        _sync(device)
    return optimizer_bytes_per_element(esize, esize) * elems * calls / (time.perf_counter() - t0)


def measure_training(cfg: CalibrationConfig, device: str) -> float:
    """Model FLOP/s of this rank running forward + backward of `cfg.model` (the runtime's own
    model code, no communication), all ranks at once."""
    import torch

    from amsp_planner.runtime.model import ReferenceModel
    from amsp_planner.specs import load_model

    spec = load_model(cfg.model)
    dtype = _dtype(cfg)
    model = ReferenceModel(spec, seed=0, dtype=dtype).to(device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (cfg.micro_batch, cfg.seq_len + 1), generator=gen)
    tokens = tokens.to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()

    step()
    _sync(device)
    t0, calls = time.perf_counter(), 0
    while True:
        step()
        calls += 1
        _sync(device)
        if time.perf_counter() - t0 >= 2 * cfg.matmul_seconds and calls >= 3:
            break
    per_call = (time.perf_counter() - t0) / calls
    return spec.flops_per_token(cfg.seq_len) * cfg.micro_batch * cfg.seq_len / per_call


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
