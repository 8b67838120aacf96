"""FP8 linear speed-ups over bf16 on this GPU (amsp_planner/calibrate_fp8.py), on torchao's
grid axes (M, K, N each 1024 ... 32768), tensorwise and rowwise.

    python bench/fp8_linear.py --out fp8_linear.json            # needs a CUDA GPU
    python bench/fp8_linear.py --device cpu --axes 64,128       # a smoke run on CPU

Writes one JSON object: the machine (GPU, torch, CUDA), and one row per shape with the median
seconds of forward + backward in bf16 and in each recipe; the file is rewritten after every
shape, so a run cut short keeps what it measured. Also times, at a few shapes, the LayerNorm
and Sigmoid that torchao's benchmark puts around its linear (their bf16 forward + backward,
compiled), so the dilution of torchao's published grid can be read off beside the bare ratio.
Imports torch and amsp_planner.calibrate_fp8 only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from amsp_planner.calibrate_fp8 import (  # noqa: E402
    RECIPES,
    compiled_steps,
    kernel_seconds,
    measure_shapes,
    time_step,
)

AXES = (1024, 2048, 4096, 8192, 16384, 32768)
NEIGHBOUR_SHAPES = ((4096, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096),
                    (8192, 4096, 1024), (16384, 8192, 8192))


def machine(device: str) -> dict:
    import torch

    out = {"torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, sm_count=p.multi_processor_count, cuda=torch.version.cuda,
                   memory_gib=round(p.total_memory / 2**30, 1))
    return out


def pick_steps(device: str):
    """(steps, mode): compiled with dynamic shapes, else one compilation per shape, else eager
    (each tried on a small shape first; the mode goes into the output)."""
    from amsp_planner.calibrate_fp8 import STEPS, operands

    probe = operands(256, 256, 256, device)
    for mode, dynamic in (("compiled, dynamic shapes", True), ("compiled per shape", False)):
        try:
            steps = compiled_steps(device, dynamic)
            for s in steps.values():
                s(*probe)
            return steps, mode
        except Exception as exc:  # noqa: BLE001 - report and fall back, the run goes on
            print(f"{mode}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return dict(STEPS), "eager"


def neighbours(device: str, seconds: float, kernels: bool = False) -> list[dict]:
    """bf16 forward + backward of LayerNorm(x) and Sigmoid(y) at (M, K) and (M, N), compiled
    on CUDA: the work torchao's grid adds to both of its arms."""
    import torch
    import torch.nn.functional as F

    def around(x, y, dy, dx):
        x = x.detach().requires_grad_()
        y = y.detach().requires_grad_()
        ln = F.layer_norm(x, (x.shape[-1],))
        s = torch.sigmoid(y)
        torch.autograd.backward([s, ln], [dy, dx])
        return x.grad, y.grad

    fn = torch.compile(around, dynamic=True) if device.startswith("cuda") else around
    rows = []
    for m, k, n in NEIGHBOUR_SHAPES:
        mk = dict(device=device, dtype=torch.bfloat16)
        args = (torch.randn(m, k, **mk), torch.randn(m, n, **mk), torch.randn(m, n, **mk),
                torch.randn(m, k, **mk))
        t = kernel_seconds(fn, args) if kernels else time_step(fn, args, device, seconds)
        rows.append({"M": m, "K": k, "N": n, "norm_sigmoid_s": t})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_linear.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--axes", default=",".join(map(str, AXES)),
                    help="values of M, K and N (comma-separated)")
    ap.add_argument("--shapes", default=None,
                    help="M:K:N,... to measure instead of the grid of --axes")
    ap.add_argument("--static", action="store_true",
                    help="compile per shape (static shapes), as amsp calibrate --fp8 does")
    ap.add_argument("--kernels", action="store_true",
                    help="time the GPU kernels (torch.profiler) instead of the wall time")
    ap.add_argument("--seconds", type=float, default=0.05, help="timed seconds per arm and shape")
    ap.add_argument("--recipes", default=",".join(RECIPES),
                    help="recipes to time beside bf16 (comma-separated; default: all)")
    args = ap.parse_args()
    axes = [int(v) for v in args.axes.split(",")]
    recipes = [r for r in args.recipes.split(",") if r]
    if not recipes or set(recipes) - set(RECIPES):
        ap.error(f"--recipes: choose from {', '.join(RECIPES)}")
    doc = {"what": "median seconds of one linear's forward + backward (3 GEMMs) with the casts "
                   "of each FP8 recipe, amsp_planner/calibrate_fp8.py",
           "machine": machine(args.device), "recipes": recipes, "rows": []}
    t0 = time.time()

    def save(row=None):
        if row is not None:
            doc["rows"].append(row)
            print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    if args.static:
        steps, doc["machine"]["mode"] = compiled_steps(args.device, False), "compiled per shape"
    else:
        steps, doc["machine"]["mode"] = pick_steps(args.device)
    shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
              if args.shapes else [(m, k, n) for m in axes for k in axes for n in axes])
    measure_shapes(args.device, shapes, recipes=recipes, seconds=args.seconds, progress=save,
                   steps=steps, kernels=args.kernels)
    doc["timing"] = "GPU kernel time (torch.profiler)" if args.kernels else "CUDA events"
    doc["neighbours"] = neighbours(args.device, args.seconds, args.kernels)
    save()
    print(f"wrote {args.out}: {len(doc['rows'])} shapes in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
