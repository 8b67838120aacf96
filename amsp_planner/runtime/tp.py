"""Tensor (+ sequence) parallelism of the bundled runtime: Megatron-style shards of each unit
and the TP collectives, as autograd functions counted by the same ``Comm`` as everything else.

    amsp train plan.json        # a plan with tp=T (docs/runtime.md, "Tensor parallelism")

What TP rank j of t holds of each unit (``shard_index``; the layout of ``Job.tp_units``):
the embedding and the LM head vocabulary-parallel (rows j*V/t ..), QKV column-parallel by heads
(the query heads j*a/t .., the key/value heads j*kv/t ..), the output projection row-parallel
(input features j*h/t ..), the MLP's gate and up column-parallel (rows j*f/t .. of each), its
down row-parallel; the RMSNorm weights whole (their gradients are summed over the TP group).

Sequence parallelism (Korthikanti et al. 2022): the activations between the matmul regions are
sequence-sharded, [b, s/t, h] on each TP rank. Per block: RMSNorm on the shard, all-gather the
sequence before QKV, reduce-scatter after the output projection, the same around the MLP;
each all-gather's backward is a reduce-scatter and the reverse (``gather_seq``,
``scatter_seq``). The embedding's lookup of its vocabulary rows gives partial sums, reduce-
scattered into the sequence shard; the head all-gathers before the LM head and computes the
vocabulary-parallel cross-entropy with three all-reduces of b*s fp32 values in forward (the
maximum, the target logit, the sum of exponentials), none in backward. Every call is counted
under 'forward', 'backward', or 'recompute' (the forward of a checkpointed block run again in
backward), group 'TP': the schedule's TP entries (cost/schedule.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from amsp_planner.runtime import model as M
from amsp_planner.runtime.collectives import Comm, Group


@dataclass
class TPContext:
    """This rank's TP group, and whether the engine is in its backward pass (then a forward
    collective belongs to a recomputed forward)."""

    comm: Comm
    group: Group
    backward: bool = False
    record: list | None = None
    """Under op-level checkpointing: the forward's TP outputs of the block being run, kept."""
    replay: list | None = None
    """Its recomputation: the kept outputs, handed back in order instead of communicating."""

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def index(self) -> int:
        return self.group.index

    def forward_phase(self) -> str:
        return "recompute" if self.backward else "forward"


# ----- what a TP rank holds --------------------------------------------------------------------
REPLICATED = ("attn_norm", "mlp_norm", "norm")
"""Parameters every TP rank holds whole."""


def _shard(model, name: str, w: torch.Tensor, t: int, j: int) -> torch.Tensor:
    """TP rank j's part of logical parameter `w` (a view or a new tensor)."""
    h, kv = model.hidden_size, model.kv_dim
    if name in REPLICATED:
        return w
    if name in ("tok_emb", "lm_head"):
        return w.chunk(t, 0)[j]
    if name == "wqkv":
        q, k, v = w.split([h, kv, kv], 0)
        return torch.cat([q.chunk(t, 0)[j], k.chunk(t, 0)[j], v.chunk(t, 0)[j]])
    if name == "w13":
        g, u = w.chunk(2, 0)
        return torch.cat([g.chunk(t, 0)[j], u.chunk(t, 0)[j]])
    if name in ("wo", "w2"):
        return w.chunk(t, 1)[j]
    raise KeyError(name)


def shard_index(model, unit: int, t: int, j: int) -> torch.Tensor:
    """int64 [tp_unit_params(t)[unit]]: element e of TP rank j's unit buffer is element
    ``out[e]`` of the logical (t = 1) unit."""
    specs = M.unit_param_specs(model)[unit]
    n = sum(math.prod(s) for _, s in specs)
    v = M.views(torch.arange(n), specs)
    out = torch.cat([_shard(model, name, v[name], t, j).reshape(-1) for name, _ in specs])
    assert out.numel() == model.tp_unit_params(t)[unit]
    return out


def replicated_slices(model, unit: int, t: int) -> list[tuple[int, int]]:
    """(offset, length) in a TP rank's unit buffer of the parameters every TP rank holds."""
    offs = M.offsets(M.unit_param_specs(model, t)[unit])
    return [offs[n] for n in REPLICATED if n in offs]


# ----- the sequence collectives ----------------------------------------------------------------
def _all_gather_seq(x: torch.Tensor, tp: TPContext, phase: str) -> torch.Tensor:
    """[b, s/t, h] sequence shards -> [b, s, h] (member j's shard is positions j*s/t ..)."""
    b, sl, h = x.shape
    t = tp.size
    out = torch.empty(t * x.numel(), dtype=x.dtype, device=x.device)
    tp.comm.phase = phase
    tp.comm.all_gather(out, x.contiguous().view(-1), tp.group)
    return out.view(t, b, sl, h).transpose(0, 1).reshape(b, t * sl, h)


def _reduce_scatter_seq(y: torch.Tensor, tp: TPContext, phase: str) -> torch.Tensor:
    """[b, s, h] partial sums -> this member's [b, s/t, h] sequence shard of their sum."""
    b, s, h = y.shape
    t = tp.size
    inp = y.reshape(b, t, s // t, h).transpose(0, 1).contiguous().view(-1)
    out = torch.empty(inp.numel() // t, dtype=y.dtype, device=y.device)
    tp.comm.phase = phase
    tp.comm.reduce_scatter(out, inp, tp.group)
    return out.view(b, s // t, h)


def _forward_collective(tp: TPContext, run) -> torch.Tensor:
    """A TP collective of the forward; under op-level checkpointing its output is kept in
    forward and handed back in the recomputation, which so issues none (the schedule's
    'op-level recomputes none'), as a saved matmul output is."""
    if tp.replay is not None:
        return tp.replay.pop(0).detach()
    out = run(tp.forward_phase())
    if tp.record is not None:
        tp.record.append(out.detach())
    return out


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _forward_collective(tp, lambda phase: _all_gather_seq(x, tp, phase))

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.tp, "backward"), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, tp):
        ctx.tp = tp
        return _forward_collective(tp, lambda phase: _reduce_scatter_seq(y, tp, phase))

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g, ctx.tp, "backward"), None


def gather_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """All-gather the sequence in forward, reduce-scatter its gradient in backward."""
    return _GatherSeq.apply(x, tp)


def scatter_seq(y: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Reduce-scatter partial sums into the sequence shard; all-gather the gradient back."""
    return _ScatterSeq.apply(y, tp)


# ----- the units under TP ----------------------------------------------------------------------
def embed(tokens: torch.Tensor, p: dict[str, torch.Tensor], tp: TPContext) -> torch.Tensor:
    """Vocabulary-parallel lookup: this rank's rows give partial sums (zero for the others'
    tokens), reduce-scattered into the sequence shard."""
    w = p["tok_emb"]
    local = tokens - tp.index * w.shape[0]
    outside = (local < 0) | (local >= w.shape[0])
    y = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
    return scatter_seq(y, tp)


def block(x: torch.Tensor, p: dict[str, torch.Tensor], model, tp: TPContext) -> torch.Tensor:
    """One block on the sequence shard x [b, s/t, h] (module docstring): the model's block
    with the sequence-parallel collectives around its sharded matmuls."""
    return M.block(x, p, model, tp.size, lambda y: gather_seq(y, tp),
                   lambda y: scatter_seq(y, tp))


def run_block(x: torch.Tensor, p: dict[str, torch.Tensor], model, tp: TPContext,
              mode: str | None = None) -> torch.Tensor:
    """One block, plainly, under full checkpointing (recomputed whole in backward, its TP
    collectives with it: no early stop), or under op-level checkpointing (the matmul and
    attention outputs kept, and the TP collectives' outputs: the caller collects them in
    ``tp.record`` and hands them back in ``tp.replay`` for the recomputation)."""
    if mode is None:
        return block(x, p, model, tp)
    from torch.utils.checkpoint import (
        checkpoint,
        create_selective_checkpoint_contexts,
        set_checkpoint_early_stop,
    )

    if mode == "op":
        ctx = functools.partial(create_selective_checkpoint_contexts,
                                lambda *a, **k: M.op_policy(*a, **k))
        return checkpoint(block, x, p, model, tp, use_reentrant=False, context_fn=ctx)
    with set_checkpoint_early_stop(False):
        return checkpoint(block, x, p, model, tp, use_reentrant=False)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy of fp32 logits [n, V/t] whose vocabulary is split over the TP group
    (this rank's rows from `start`): three all-reduces of n values in forward, none in backward."""

    @staticmethod
    def forward(ctx, logits, targets, tp, start):
        comm, g = tp.comm, tp.group
        n, vl = logits.shape
        comm.phase = "forward"
        m = logits.max(-1).values
        comm.all_reduce(m, g, op="max")
        shifted = logits - m.unsqueeze(-1)
        local = targets - start
        inside = (local >= 0) & (local < vl)
        local = local.masked_fill(~inside, 0)
        pred = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
        comm.all_reduce(pred, g)
        e = shifted.exp_()
        sumexp = e.sum(-1)
        comm.all_reduce(sumexp, g)
        loss = (sumexp.log() - pred).mean()
        e.div_(sumexp.unsqueeze(-1))
        ctx.save_for_backward(e, local, inside)
        return loss

    @staticmethod
    def backward(ctx, go):
        probs, local, inside = ctx.saved_tensors
        n = probs.shape[0]
        grad = probs.clone()
        grad.scatter_add_(1, local.unsqueeze(1), -inside.to(grad.dtype).unsqueeze(1))
        return grad.mul_(go / n), None, None, None


def head_loss(x: torch.Tensor, p: dict[str, torch.Tensor], lm_weight: torch.Tensor,
              targets: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Final norm on the sequence shard, all-gather, LM head over this rank's vocabulary rows,
    vocabulary-parallel cross-entropy (the mean over the micro-batch, on every TP rank)."""
    y = gather_seq(M.rms_norm(x, p["norm"]), tp)
    logits = F.linear(y, lm_weight).float()
    start = tp.index * lm_weight.shape[0]
    return _VocabParallelCE.apply(logits.view(-1, logits.shape[-1]), targets.reshape(-1), tp,
                                  start)
