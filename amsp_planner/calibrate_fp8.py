"""Measure the FP8 linear's speed-up over bf16 on this GPU: forward + backward of one linear
with its casts, as torchao's ``Float8Linear`` runs them (docs/fp8.md).

One linear y = x W^T, x (M, K), W (N, K), three GEMMs per step: the forward, the input
gradient dx = dy W and the weight gradient dW = dy^T x. The FP8 arms quantize each GEMM's
operands the way torchao's recipes do (pytorch/ao torchao/float8/float8_linear.py,
``matmul_with_hp_or_float8_args``, and config.py ``Float8LinearRecipeName`` at
36027d82d1ad9949597ea16002ff4940374b1b94):

  tensorwise  one fp32 scale per tensor from the tensor's amax (a reduction before the cast);
              x and W cast in the forward and again from their bf16 copies in the backward,
              for both backward GEMMs (their transposes), dy cast once (e5m2, torchao's
              default for the gradient);
  rowwise     one scale per row along each GEMM's contraction axis, rounded down to a power
              of 2; every GEMM casts its own operands along its own axis: x and W in the
              forward, dy and W (along N) for dx, dy and x (along M) for dW, all e4m3.

The casts run under torch.compile (as in every published FP8 training run), the GEMMs are
``torch._scaled_mm`` (cuBLAS for tensorwise, the CUTLASS rowwise kernel on SM90). Nothing
else is in the timed region: no LayerNorm or activation around the linear (torchao's own
benchmark grid has them, which dilutes its ratios at small N).

torch is imported inside the functions; this module imports nothing else of the project, so
``bench/fp8_linear.py`` runs it on a GPU machine that has torch alone.
"""

from __future__ import annotations

import statistics
import time

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
EPS = 1e-12
RECIPES = ("tensorwise", "rowwise")


def _dtypes():
    import torch

    return torch.float8_e4m3fn, torch.float8_e5m2


def cast_tensorwise(t, e5m2: bool = False):
    """(fp8 tensor, fp32 inverse scale): one scale for the whole tensor from its amax."""
    import torch

    e4, e5 = _dtypes()
    top = E5M2_MAX if e5m2 else E4M3_MAX
    amax = t.abs().amax().float().clamp(min=EPS)
    scale = top / amax
    q = (t.float() * scale).clamp(-top, top).to(e5 if e5m2 else e4)
    return q, scale.reciprocal().to(torch.float32)


def cast_rowwise(t, dim: int):
    """(fp8 e4m3 tensor, fp32 inverse scales): one scale per slice along `dim` (the GEMM's
    contraction axis), rounded down to a power of 2 as torchao's rowwise recipe does."""
    import torch

    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=EPS)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    q = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(_dtypes()[0])
    return q.contiguous(), scale.reciprocal()


def _mm(a, sa, b, sb):
    """a (m, k) @ b (k, n) in FP8 with a row-major and b column-major, bf16 out."""
    import torch

    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _tensorwise_fwd(x, w):
    xq, sx = cast_tensorwise(x)
    wq, sw = cast_tensorwise(w)
    return _mm(xq, sx, wq.t(), sw)                                   # (M,K) @ (K,N)


def _tensorwise_bwd(x, w, dy):
    """(dx, dW): x and W cast again from the bf16 copies backward keeps (their amax too), dy
    once in e5m2; each GEMM takes the transposed layout it needs."""
    xq, sx = cast_tensorwise(x)
    wq, sw = cast_tensorwise(w)
    gq, sg = cast_tensorwise(dy, e5m2=True)
    dx = _mm(gq, sg, wq.t().contiguous().t(), sw)                    # (M,N) @ (N,K)
    dw = _mm(gq.t().contiguous(), sg, xq.t().contiguous().t(), sx)  # (N,M) @ (M,K)
    return dx, dw


def _rowwise_fwd(x, w):
    xq, sx = cast_rowwise(x, -1)                     # (M,K), scales (M,1)
    wq, sw = cast_rowwise(w, -1)                     # (N,K), scales (N,1)
    return _mm(xq, sx, wq.t(), sw.t())


def _rowwise_bwd(x, w, dy):
    """(dx, dW), each GEMM scaling its operands along its contraction axis: dy and W along N
    for dx, dy and x along M for dW."""
    gq, sg = cast_rowwise(dy, -1)                    # (M,N), scales (M,1)
    wq, sw = cast_rowwise(w, 0)                      # (N,K), scales (1,K)
    dx = _mm(gq, sg, wq.t().contiguous().t(), sw)
    gt, sgt = cast_rowwise(dy.t(), -1)               # (N,M), scales (N,1)
    xt, sxt = cast_rowwise(x.t(), -1)                # (K,M), scales (K,1)
    dw = _mm(gt, sgt, xt.t(), sxt.t())
    return dx, dw


PASSES = {"bf16": (lambda x, w: x @ w.t(), lambda x, w, dy: (dy @ w, dy.t() @ x)),
          "tensorwise": (_tensorwise_fwd, _tensorwise_bwd),
          "rowwise": (_rowwise_fwd, _rowwise_bwd)}
"""recipe -> (forward(x, W) -> y, backward(x, W, dy) -> (dx, dW)), torchao's Float8Linear
(module docstring)."""


def _plain(recipe: str):
    fwd, bwd = PASSES[recipe]
    return lambda x, w, dy: (fwd(x, w), *bwd(x, w, dy))


STEPS = {r: _plain(r) for r in PASSES}
"""recipe -> step(x, W, dy) -> (y, dx, dW), the passes called in a row, eagerly."""


def linear_fn(recipe: str):
    """An autograd function y = x W^T in `recipe` that keeps the bf16 x and W for backward
    and casts there again, as torchao's ``matmul_with_hp_or_float8_args`` does (under
    torch.compile the partitioner may keep FP8 copies instead, as it does for torchao)."""
    import torch

    class Fp8Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return PASSES[recipe][0](x, w)

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            return PASSES[recipe][1](x, w, dy)

    return Fp8Linear.apply


def compiled_steps(device: str, dynamic: bool = True, compile: bool | None = None) -> dict:
    """recipe -> step(x, w, dy): forward, then both gradients through autograd. On CUDA the
    forward is torch.compile'd (dynamic shapes: one compilation serves every shape) and
    AOTAutograd compiles its backward, as in a compiled training run (`dynamic` False: one
    compilation per shape); on CPU the plain functions run eagerly (there the point is
    correctness, not speed), unless `compile` asks for the compiled path."""
    if not (device.startswith("cuda") if compile is None else compile):
        return dict(STEPS)
    import torch

    cfg = torch._dynamo.config  # one compilation per shape (static): room for large grids
    cfg.cache_size_limit = max(cfg.cache_size_limit, 4096)
    cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4096)

    def make(recipe):
        fwd = torch.compile(linear_fn(recipe), dynamic=dynamic)

        def step(x, w, dy):
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = fwd(x, w)
            return (y, *torch.autograd.grad(y, (x, w), dy))

        return step

    return {r: make(r) for r in ("bf16", *RECIPES)}


def operands(m: int, k: int, n: int, device: str, seed: int = 0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    mk = dict(device=device, dtype=torch.bfloat16, generator=g)
    return torch.randn(m, k, **mk), torch.randn(n, k, **mk), torch.randn(m, n, **mk)


def time_step(step, args, device: str, seconds: float) -> float:
    """Median seconds of one call (CUDA events on GPUs, perf_counter elsewhere)."""
    import torch

    step(*args)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(*args)
    if cuda:
        torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(3, min(50, int(seconds / one)))
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(*args)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            step(*args)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_times(step, args, reps: int = 5) -> list[tuple[str, float]]:
    """(kernel name, seconds per call) of the GPU kernels of one call (CUDA), longest first:
    their durations as torch.profiler records them over `reps` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step(*args)
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            out.append((e.key, us / 1e6 / reps))
    return sorted(out, key=lambda x: -x[1])


def kernel_seconds(step, args, reps: int = 5) -> float:
    """Seconds of GPU kernels per call: their sum (kernel_times), without the gaps where the
    GPU waits for the host; in a training step the host runs ahead and those gaps do not
    exist."""
    return sum(t for _, t in kernel_times(step, args, reps))


def measure_shapes(device: str, shapes, recipes=RECIPES, seconds: float = 0.05,
                   progress=None, steps: dict | None = None, kernels: bool = False) -> list[dict]:
    """One row per (M, K, N) of `shapes`: bf16 seconds and each recipe's seconds of forward +
    backward (`kernels`: the GPU kernels' own time, kernel_seconds; else wall time,
    time_step)."""
    steps = steps or compiled_steps(device)
    rows = []
    for m, k, n in shapes:
        args = operands(m, k, n, device)
        row = {"M": m, "K": k, "N": n}
        for r in ("bf16", *recipes):
            row[f"{r}_s"] = (kernel_seconds(steps[r], args) if kernels
                             else time_step(steps[r], args, device, seconds))
        rows.append(row)
        del args
        if progress:
            progress(row)
    return rows


def measure_grid(device: str, ms, ks, ns, **kw) -> list[dict]:
    """measure_shapes on every (M, K, N) of the axes."""
    return measure_shapes(device, [(m, k, n) for m in ms for k in ks for n in ns], **kw)


def grids_from_rows(rows: list[dict], measured: str, recipes=RECIPES) -> list[dict]:
    """GpuSpec.fp8_linear grids (one per recipe: bf16 seconds / recipe seconds on the M, K, N
    axes of `rows`, which must cover every combination of them)."""
    axes = {a: sorted({r[a] for r in rows}) for a in ("M", "K", "N")}
    at = {(r["M"], r["K"], r["N"]): r for r in rows}
    return [{"recipe": rec, **axes, "measured": measured,
             "speedup": [[round(at[m, k, n]["bf16_s"] / at[m, k, n][f"{rec}_s"], 4)
                          for n in axes["N"]] for m in axes["M"] for k in axes["K"]]}
            for rec in recipes]


def calibrate_grids(sizes, device: str, progress=None) -> list[dict]:
    """``amsp calibrate --fp8``: the grids on (sizes)^3. On CUDA the steps are compiled for
    each shape (static shapes: with dynamic shapes Inductor's amax reductions ran 3.6x slower
    on an H200, docs/fp8.md) and timed by their GPU kernels (kernel_seconds); elsewhere the
    eager steps by wall time (a check of the pipeline, not a GPU figure)."""
    import datetime

    import torch

    cuda = device.startswith("cuda")
    steps = compiled_steps(device, dynamic=False) if cuda else dict(STEPS)
    rows = measure_grid(device, sizes, sizes, sizes, steps=steps, kernels=cuda,
                        progress=progress)
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    day = datetime.date.today().isoformat()
    how = "GPU kernel time, casts compiled per shape" if cuda else "wall time, eager"
    return grids_from_rows(rows, f"amsp calibrate --fp8 on {where}, torch {torch.__version__}, "
                                 f"{day}: one linear's forward + backward with torchao's "
                                 f"casts ({how})")
