"""Checking a generated FSDP2 module with torch: apply it on a tiny model and report what
FSDP2 built (``amsp export --to fsdp2 --check``, and the tests).

``check_with_torch`` imports the module text (``load_module``), makes a one-rank gloo group on CPU
and the module's mesh at size 1, applies it (with TP_SIZE > 1: on a tiny torchtitan-named MLP
block, so the module's TP plan is exercised) with ``strict=False``, runs one forward and backward,
and returns the sharded parameters' mesh and placements, the checkpoint wrappers, how often each
block ran forward (recomputation runs it twice) and the module's own settings. ``check_in_child``
runs it in a fresh process. torch is imported inside the functions (the runtime extra);
``exports/fsdp2.py`` writes the module.
"""

from __future__ import annotations


def _Tiny(layers: int = 2):
    import torch

    class Tiny(torch.nn.Module):
        """`layers` blocks in .layers, as apply() expects of a transformer."""

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(layers)])
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x)

    return Tiny()


def _TinyMoE(layers: int = 2, experts: int = 2):
    import torch

    class Block(torch.nn.Module):
        """A block whose MLP is `experts` experts in ``.experts`` (each token to all of them)."""

        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(experts)])

        def forward(self, x):
            return x + sum(torch.relu(e(x)) for e in self.experts)

    model = _Tiny(layers)
    model.layers = torch.nn.ModuleList([Block() for _ in range(layers)])
    return model


def _TinyTP(layers: int = 2):
    import torch

    class FeedForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(16, 32, bias=False)
            self.w2 = torch.nn.Linear(32, 16, bias=False)

        def forward(self, x):
            return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))

    class Attention(torch.nn.Module):
        """torchtitan's attention signature (v0.2.2: x, freqs_cis, attention_masks,
        positions) around its four linears; heads mixed elementwise, so a TP rank's shard
        computes on its own."""

        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (torch.nn.Linear(16, 16, bias=False) for _ in range(3))
            self.wo = torch.nn.Linear(16, 16, bias=False)

        def forward(self, x, freqs_cis, attention_masks, positions=None):
            return self.wo(self.wq(x) * torch.sigmoid(self.wk(x)) + self.wv(x) * freqs_cis)

    class Block(torch.nn.Module):
        """A torchtitan-named block (attention_norm, attention.wq/wk/wv/wo, ffn_norm,
        feed_forward.w1/w2/w3)."""

        def __init__(self):
            super().__init__()
            self.attention_norm, self.attention = torch.nn.RMSNorm(16), Attention()
            self.ffn_norm, self.feed_forward = torch.nn.RMSNorm(16), FeedForward()

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x), 1.0, None, None)
            return h + self.feed_forward(self.ffn_norm(h))

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block() for _ in range(layers)])
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Tiny()


def check_with_torch(text: str, layers: int = 2, given_blocks: bool = False) -> dict:
    """Import the generated module and apply it with FSDP2 on a tiny model, in this process.

    One-rank gloo group on CPU (created here when none exists, on an in-memory store), mesh
    (1, 1), strict=False; a model of `layers` blocks, passed to ``apply`` as ``blocks=[...]``
    when `given_blocks`; runs one forward and backward. Returns what FSDP2 built: the sharded
    parameters' mesh shape and placements, which blocks are checkpoint wrappers, how many times
    each block's forward ran (2 where backward recomputed it), and the module's own settings.
    Needs torch (the runtime extra).
    """

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mod = load_module(text)
    created = not dist.is_initialized()
    if created:  # an in-memory store: no TCP port, no store thread to outlive the check
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    tp = getattr(mod, "TP_SIZE", 1) > 1
    if tp:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("replicate", "shard", "tp"))
    else:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    moe = hasattr(mod, "EP_SIZE")
    model = _TinyTP(layers) if tp else _TinyMoE(layers) if moe else _Tiny(layers)
    calls = [0] * layers
    for i, block in enumerate(model.layers):  # counts forwards, recomputation included
        block.register_forward_pre_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
    mod.apply(model, mesh, strict=False, blocks=list(model.layers) if given_blocks else None)
    mod.set_micro_batch(model, mod.GRAD_ACCUM - 1)
    x = torch.randn(2, 4, 16) if tp else torch.randn(4, 16)  # TP: (batch, sequence, hidden)
    model(x).float().sum().backward()
    params = list(model.parameters())
    out = {
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
        "mesh_shape": tuple(params[0].device_mesh.shape),
        "placements": [str(pl) for pl in params[0].placements],
        "grads": all(p.grad is not None for p in params),
        "module_mesh_shape": tuple(mod.MESH_SHAPE),
        **({"tp_size": mod.TP_SIZE, "tp_mesh_dims": list(params[0].device_mesh.mesh_dim_names),
            "tp_plan": sorted(f"{k}:{type(v).__name__}"
                              for k, v in mod.tp_plan(_TinyTP().layers[0]).items())}
           if tp else {}),
        "module_mesh_for_plan": mod.mesh_shape(mod.NUM_GPUS),
        "reshard_after_forward": mod.RESHARD_AFTER_FORWARD,
        "checkpointed": [isinstance(b, CheckpointWrapper) for b in model.layers],
        "forward_calls": calls,
        **({"expert_mesh_dims": sorted({str(p.device_mesh.mesh_dim_names) for b in model.layers
                                        for n, p in b.named_parameters() if "experts" in n}),
            "dense_mesh_dims": sorted({str(p.device_mesh.mesh_dim_names)
                                       for n, p in model.named_parameters()
                                       if "experts" not in n})} if moe else {}),
        "selective": [getattr(b, "checkpoint_fn", None) is not None
                      and "context_fn" in getattr(b.checkpoint_fn, "keywords", {})
                      for b in model.layers],
    }
    if created:
        dist.destroy_process_group()
    return out


_CHILD = """
import json, os, sys
from amsp_planner.exports.fsdp2_check import check_with_torch
print(json.dumps(check_with_torch(sys.stdin.read())), flush=True)
os._exit(0)  # skip interpreter teardown: gloo and autograd threads end with the process
"""


def check_in_child(text: str, timeout_s: float = 300) -> dict:
    """``check_with_torch`` in a fresh Python process, which ends with ``os._exit``.

    torch.distributed's C++ threads could otherwise still be joinable when this interpreter
    exits ('terminate called without an active exception', exit 134, after the result was
    printed). Raises RuntimeError with the child's last line when it fails.
    """
    import json
    import subprocess
    import sys

    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=text, text=True,
                              capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the FSDP2 check did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise RuntimeError(f"the FSDP2 check failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_module(text: str, name: str = "amsp_fsdp2_generated"):
    """Import generated module text (for checks and tests)."""
    import types

    mod = types.ModuleType(name)
    exec(compile(text, f"<{name}>", "exec"), mod.__dict__)
    return mod
