"""Calibration of the compute: matmul throughput and curve, the quantizers, the optimizer
step, a model's forward + backward, and the compute slowdown under collectives.

Every rank measures at the same time (on a CPU "cluster" the ranks share the cores, as the
runtime's ranks do), with the runtime's own kernels: its int8/int4 block quantizers, its
AdamW, its model. On GPUs the matmul curve, (T x 4096) @ (4096 x 11008) at ``CURVE_TOKENS``,
is fitted to t = FLOPs / (peak x fraction) + overhead (cost/compute.py).

``amsp_planner/calibrate.py`` runs the passes.
torch is imported inside the functions.
"""

from __future__ import annotations

import statistics
import time

from amsp_planner.calibrate_config import CalibrationConfig


def torch_dtype(cfg: CalibrationConfig):
    """The torch dtype of cfg.dtype, as the runtime names them."""
    from amsp_planner.runtime.optim import DTYPES

    return DTYPES[cfg.dtype]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure_matmul(cfg: CalibrationConfig, device: str) -> float:
    """FLOP/s of this rank on square matmuls (all ranks measure at the same time)."""
    import torch

    n = cfg.matmul_size or (4096 if device.startswith("cuda") else 512)
    dtype = torch_dtype(cfg)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    sync(device)
    t0, calls = time.perf_counter(), 0
    while True:
        torch.mm(a, b)
        calls += 1
        sync(device)
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
    sync(device)
    t0, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
        sync(device)
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
        sync(device)
        t0, calls = time.perf_counter(), 0
        while calls < 3 or time.perf_counter() - t0 < cfg.matmul_seconds / 2:
            quantize_into(buf, x, bits, 256)
            dequantize(buf, elems, bits, 256)
            calls += 1
            sync(device)
        rates.append(2 * 2 * elems * calls / (time.perf_counter() - t0))
    return statistics.fmean(rates)


def measure_optimizer(cfg: CalibrationConfig, device: str, elems: int = 2**20) -> float:
    """Bytes per second of the runtime's optimizer step (its AdamW on an fp32 master shard of
    `elems`, from the gradient in the training dtype, then the cast of the new parameters),
    counted as the cost model counts them (``optimizer_bytes_per_element``); all ranks at once."""
    import torch

    from amsp_planner.cost.step_time import optimizer_bytes_per_element
    from amsp_planner.runtime.optim import OptimConfig, adamw_

    dtype = torch_dtype(cfg)
    esize = dtype.itemsize
    p = torch.randn(elems, device=device)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    g = torch.randn(elems, device=device).to(dtype)
    o = OptimConfig()

    def step(k: int) -> None:
        adamw_(p, m, v, g, o, k)
        p.to(dtype)  # the new parameters, as the runtime casts them for the update gather

    step(1)
    sync(device)
    t0, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - t0 < cfg.matmul_seconds / 2:
        step(calls + 2)
        calls += 1
        sync(device)
    return optimizer_bytes_per_element(esize, esize) * elems * calls / (time.perf_counter() - t0)


def measure_training(cfg: CalibrationConfig, device: str) -> float:
    """Model FLOP/s of this rank running forward + backward of `cfg.model` (the runtime's own
    model code, no communication), all ranks at once."""
    import torch

    from amsp_planner.runtime.model import ReferenceModel
    from amsp_planner.specs import load_model

    spec = load_model(cfg.model)
    dtype = torch_dtype(cfg)
    model = ReferenceModel(spec, seed=0, dtype=dtype).to(device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (cfg.micro_batch, cfg.seq_len + 1), generator=gen)
    tokens = tokens.to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()

    step()
    sync(device)
    t0, calls = time.perf_counter(), 0
    while True:
        step()
        calls += 1
        sync(device)
        if time.perf_counter() - t0 >= 2 * cfg.matmul_seconds and calls >= 3:
            break
    per_call = (time.perf_counter() - t0) / calls
    return spec.flops_per_token(cfg.seq_len) * cfg.micro_batch * cfg.seq_len / per_call
