"""Where the time of one FP8 linear goes on this GPU: the kernels of forward + backward
(torch.profiler) at a few Llama shapes, compiled with static and with dynamic shapes, and the
FP8 GEMMs alone on pre-quantized operands (bench/fp8_linear.py measures the grid).

    python bench/fp8_linear_breakdown.py --out breakdown.json     # needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from amsp_planner.calibrate_fp8 import (  # noqa: E402
    cast_rowwise,
    cast_tensorwise,
    compiled_steps,
    kernel_seconds,
    kernel_times,
    operands,
)

SHAPES = ((8192, 4096, 4096), (8192, 4096, 14336))


def kernels(step, args) -> list[tuple[str, float]]:
    """(name, microseconds per call) of the step's kernels, longest first."""
    return [(name[:90], t * 1e6) for name, t in kernel_times(step, args, reps=3)]


def gemm_only(m: int, k: int, n: int) -> dict:
    import torch

    x, w, _ = operands(m, k, n, "cuda")
    xq, sx = cast_tensorwise(x)
    wq, sw = cast_tensorwise(w)
    xr, rx = cast_rowwise(x, -1)
    wr, rw = cast_rowwise(w, -1)
    arms = {
        "bf16": lambda: torch.mm(x, w.t()),
        "tensorwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw,
                                               out_dtype=torch.bfloat16),
        "rowwise": lambda: torch._scaled_mm(xr, wr.t(), scale_a=rx, scale_b=rw.t(),
                                            out_dtype=torch.bfloat16),
    }
    return {k2: kernel_seconds(lambda f=f: f(), (), reps=10) for k2, f in arms.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="breakdown.json")
    args = ap.parse_args()
    doc = {"gemm_only": {}, "kernels": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)

    for m, k, n in SHAPES:
        key = f"{m}x{k}x{n}"
        doc["gemm_only"][key] = g = gemm_only(m, k, n)
        print(key, "gemm only", {a: round(g["bf16"] / v, 3) for a, v in g.items()}, flush=True)
        save()
    for mode, dynamic in (("dynamic", True), ("static", False)):
        steps = compiled_steps("cuda", dynamic)
        for m, k, n in SHAPES:
            args_ = operands(m, k, n, "cuda")
            for r in ("bf16", "tensorwise", "rowwise"):
                ks = kernels(steps[r], args_)
                doc["kernels"][f"{mode} {r} {m}x{k}x{n}"] = ks
                print(mode, r, m, k, n, f"total {sum(t for _, t in ks):.0f} us", flush=True)
                for name, t in ks[:10]:
                    print(f"   {t:9.1f} us  {name}", flush=True)
                save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
