"""A LLaMA-style decoder built from a ModelSpec: RMSNorm, RoPE, GQA, SwiGLU, SDPA.

The model is a list of units (DESIGN.md 3a): the token embedding (tied LM head weights live
here), each block, and the final norm + LM head. Each unit's parameters are views into one flat
buffer, in the order of ``unit_param_specs``; the functions below take those views as a dict,
so the sharded runtime and the single-process reference (``ReferenceModel``) run the same code.

Parameter counts per unit equal ``ModelSpec.unit_params()`` exactly (checked at build time).

Activation checkpointing (``run_block``): a block runs plainly, under full checkpointing
(torch.utils.checkpoint, non-reentrant: only its input is kept, the whole block recomputed in
backward), or under op-level selective checkpointing (the same with
``create_selective_checkpoint_contexts``: the outputs of the matmuls and of attention are kept,
everything else recomputed). ``block_modes`` says which blocks: the first K, or all for op.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from amsp_planner.runtime import moe as MOE
from amsp_planner.runtime.support import check_supported  # noqa: F401 - also this API

NORM_EPS = 1e-5
INIT_STD = 0.02


def unit_param_specs(model, tp: int = 1) -> list[list[tuple[str, tuple[int, ...]]]]:
    """(name, shape) of every parameter of every unit, in flat-buffer order; with `tp` > 1
    the shapes of one TP rank's shards (runtime/tp.py), in the same order."""
    h, f, kv, V = model.hidden_size, model.ffn_hidden_size, model.kv_dim, model.vocab_size
    t = tp
    emb = [("tok_emb", (V // t, h))]
    attn = [("attn_norm", (h,)), ("wqkv", ((h + 2 * kv) // t, h)), ("wo", (h, h // t)),
            ("mlp_norm", (h,))]
    block = attn + [("w13", (2 * f // t, h)), ("w2", (h, f // t))]
    moe_block = attn + MOE.mlp_specs(model) if model.is_moe else None
    head = [("norm", (h,))] + ([] if model.tied_embeddings else [("lm_head", (V // t, h))])
    blocks = [moe_block if model.is_moe_layer(i) else block for i in range(model.num_layers)]
    specs = [emb] + blocks + [head]
    counts = [sum(math.prod(s) for _, s in u) for u in specs]
    want = model.unit_params() if t == 1 else model.tp_unit_params(t)
    assert counts == want, (counts, want)
    return specs


def unit_kind(index: int, num_units: int) -> str:
    return "embedding" if index == 0 else "head" if index == num_units - 1 else "block"


def views(flat: torch.Tensor, specs: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Named views of one unit's flat buffer."""
    out, off = {}, 0
    for name, shape in specs:
        n = math.prod(shape)
        out[name] = flat[off:off + n].view(shape)
        off += n
    return out


def offsets(specs: list[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, int]]:
    out, off = {}, 0
    for name, shape in specs:
        n = math.prod(shape)
        out[name] = (off, n)
        off += n
    return out


def init_unit(model, index: int, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The unpadded fp32 initial values of unit `index` (same on every rank and plan),
    drawn parameter by parameter from one generator per (seed, unit); written into the
    first elements of `out` when given (no other copy of the unit is made)."""
    specs = unit_param_specs(model)[index]
    n = sum(math.prod(shape) for _, shape in specs)
    flat = torch.empty(n) if out is None else out[:n]
    g = torch.Generator().manual_seed(seed * 100003 + index)
    for name, (off, size) in offsets(specs).items():
        shape = dict(specs)[name]
        dst = flat[off:off + size].view(shape)
        if len(shape) == 1:
            dst.fill_(1.0)
            continue
        std = INIT_STD / math.sqrt(2 * model.num_layers) if name in ("wo", "w2", "ws2") else INIT_STD
        torch.randn(shape, generator=g, out=dst)
        dst.mul_(std)
        if name == MOE.EXPERTS:  # each expert's down projection, as w2
            dst[:, 2 * MOE.expert_width(model) * model.hidden_size:].div_(
                math.sqrt(2 * model.num_layers))
    return flat


# ----- the compute -------------------------------------------------------------------------
_ROPE: dict = {}


def _rope(seq_len: int, head_dim: int, theta: float, dtype, device):
    key = (seq_len, head_dim, theta, dtype, str(device))
    if key not in _ROPE:
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
        _ROPE[key] = (ang.cos().to(dtype=dtype, device=device),
                      ang.sin().to(dtype=dtype, device=device))
    return _ROPE[key]


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm in fp32, scaled in the input dtype (as Hugging Face's LlamaRMSNorm), written out
    so that autograd saves the same tensors on every device (F.rms_norm is one fused kernel on
    CUDA and a different decomposition on CPU): docs/memory.md."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return weight * y.to(x.dtype)


def embed(tokens: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.embedding(tokens, p["tok_emb"])


def _same(y: torch.Tensor) -> torch.Tensor:
    return y


def block(x: torch.Tensor, p: dict[str, torch.Tensor], model, tp: int = 1, gather=_same,
          scatter=_same, ep=None, routing: MOE.Routing = MOE.BALANCED,
          moe_ckpt: bool = False) -> torch.Tensor:
    """One block. Under tensor parallelism (runtime/tp.py) `p` holds this rank's 1/tp of the
    heads and of the MLP, x is the sequence shard, `gather` brings the normed sequence whole
    before the column-sharded matmuls and `scatter` reduce-scatters the row-sharded ones'
    partial sums back into the shard; at tp = 1 both are the identity. `moe_ckpt` (``ckpt=moe``):
    the MoE MLP runs under checkpointing, recomputed in backward from its input ``y``, its
    all-to-alls included (no early stop)."""
    a, kvh, hd = model.num_heads // tp, model.kv_heads // tp, model.head_dim
    y = gather(rms_norm(x, p["attn_norm"]))
    b, s, _ = y.shape
    q, k, v = F.linear(y, p["wqkv"]).split([a * hd, kvh * hd, kvh * hd], dim=-1)
    q = q.view(b, s, a, hd).transpose(1, 2)
    k = k.view(b, s, kvh, hd).transpose(1, 2)
    v = v.view(b, s, kvh, hd).transpose(1, 2)
    cos, sin = _rope(s, hd, model.rope_theta, x.dtype, x.device)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != a)
    x = x + scatter(F.linear(o.transpose(1, 2).reshape(b, s, a * hd), p["wo"]))
    y = gather(rms_norm(x, p["mlp_norm"]))
    if "router" in p and moe_ckpt:
        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        with set_checkpoint_early_stop(False):
            return x + checkpoint(MOE.moe_mlp, y, p, model, ep, routing, use_reentrant=False)
    if "router" in p:
        return x + MOE.moe_mlp(y, p, model, ep, routing)
    g, up = F.linear(y, p["w13"]).chunk(2, dim=-1)
    return x + scatter(F.linear(F.silu(g) * up, p["w2"]))


def _save_ops() -> frozenset:
    """The aten ops whose outputs op-level checkpointing keeps: the matmuls and the fused
    attention kernels of every backend (those this torch build has)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


SAVE_OPS = _save_ops()


def op_policy(ctx, func, *args, **kwargs):
    """Selective checkpointing policy: keep matmul and attention outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if func in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def block_modes(ckpt, num_layers: int) -> list[str | None]:
    """Per block: None (no checkpointing), 'full', 'op' or 'moe' (its MoE MLP only, a dense
    layer's nothing), for a checkpointing setting (True, False, the first K blocks, 'op' or
    'moe')."""
    from amsp_planner.strategy import checkpointed_blocks

    if ckpt == "moe":
        return ["moe"] * num_layers
    k, op = checkpointed_blocks(ckpt, num_layers)
    if op:
        return ["op"] * num_layers
    return ["full" if b < k else None for b in range(num_layers)]


def run_block(x: torch.Tensor, p: dict[str, torch.Tensor], model, mode: str | None = None,
              ep=None, routing: MOE.Routing = MOE.BALANCED) -> torch.Tensor:
    """One block, checkpointed per `mode` (module docstring). Under checkpointing the block is
    recomputed in backward from `p`'s tensors as they are then (the caller points them at the
    unit's backward gather). A MoE block's all-to-alls (over `ep`) run again in a full
    recomputation (no early stop); under op-level checkpointing the caller keeps their outputs
    (``moe.EPContext.record``/``replay``), as the TP collectives'."""
    fn = functools.partial(block, ep=ep, routing=routing) if "router" in p else block
    if mode is None or mode == "moe":
        return fn(x, p, model, moe_ckpt=mode == "moe") if "router" in p else fn(x, p, model)
    from torch.utils.checkpoint import (
        checkpoint,
        create_selective_checkpoint_contexts,
        set_checkpoint_early_stop,
    )

    if mode == "op":
        # op_policy is looked up at call time, so a test may wrap it to count what it keeps
        ctx = functools.partial(create_selective_checkpoint_contexts,
                                lambda *a, **k: op_policy(*a, **k))
        return checkpoint(fn, x, p, model, use_reentrant=False, context_fn=ctx)
    if "router" not in p:
        return checkpoint(fn, x, p, model, use_reentrant=False)
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, x, p, model, use_reentrant=False)


def head_loss(x: torch.Tensor, p: dict[str, torch.Tensor], lm_weight: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32 logits) of one micro-batch."""
    y = rms_norm(x, p["norm"])
    logits = F.linear(y, lm_weight).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class ReferenceModel(torch.nn.Module):
    """The unsharded model in one process: the parity oracle (same init, same compute)."""

    def __init__(self, model, seed: int, dtype=torch.float32,
                 routing: MOE.Routing = MOE.BALANCED):
        super().__init__()
        check_supported(model)
        self.spec, self.routing = model, routing
        self.specs = unit_param_specs(model)
        self.flats = torch.nn.ParameterList(
            [torch.nn.Parameter(init_unit(model, i, seed).to(dtype)) for i in range(len(self.specs))]
        )

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        units = [views(f, s) for f, s in zip(self.flats, self.specs, strict=True)]
        x = embed(tokens, units[0])
        for p in units[1:-1]:
            x = block(x, p, self.spec, routing=self.routing)
        head = units[-1]
        lm = units[0]["tok_emb"] if self.spec.tied_embeddings else head["lm_head"]
        return head_loss(x, head, lm, targets)
