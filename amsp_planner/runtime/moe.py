"""The mixture-of-experts MLP of the runtime model: router, top-k, dispatch, the experts, combine.

    amsp train plan.json          # a plan of a MoE model (docs/runtime.md, "Mixture of experts")

A MoE layer (``ModelSpec.is_moe_layer``) replaces the block's MLP with a router (E x h, no
bias), E routed experts (each a SwiGLU MLP of width f_e) of which every token uses k, and
optionally a shared-expert MLP every token goes through. The routed experts are one parameter
``experts`` of shape [E, 3 h f_e] (each row one expert: its gate-and-up rows, then its down),
the last of the block's unit, so the EP rank j of e holds rows j E/e .. of it: a contiguous
slice of the logical unit (``expert_slice``).

Routing (``gate``):
- ``balanced`` (default): token s of a sequence goes to experts (s k + j) mod E, j < k, the
  router's probabilities at those experts as weights (renormalised over the k): every expert
  gets exactly S k / E tokens of every sequence, so every all-to-all has a fixed size and the
  measured bytes equal the plan's (as published benchmarks force balanced routing);
- ``topk``: the router's top-k, with a capacity of C = S k / E tokens per expert per sequence
  (GShard's capacity factor 1): tokens past it (in sequence order) are dropped by that expert
  (their weight there is lost), empty slots are zeros. The all-to-alls have the same fixed size.
The weights are the router's softmax probabilities at the chosen experts renormalised over
the k (equal to Mixtral's softmax over the top-k scores, and what transformers' Qwen-MoE and
OLMoE blocks do with ``norm_topk_prob: true``; the spec has no field for models that keep
the raw probabilities, a difference of values, not of bytes). No auxiliary load-balancing
loss is added. Both need E to divide S k (``capacity``).

The capacity factor (``Routing.capacity_factor``, the plan's ``--expert-imbalance``: the
busiest expert's tokens over the mean) gives every expert c S k / E slots per sequence, so the
all-to-all buffers are c b S k h elements, the plan's; with ``balanced`` the extra slots stay
empty, with ``topk`` fewer tokens are dropped. c S k / E must be whole. Capacity per sequence makes the routing independent
of how sequences are grouped into micro-batches, so the single-process reference routes the
same tokens to the same experts.

Expert parallelism of degree e: the dispatch buffer [b, E, C, h] is laid out expert-major,
[E, b, C, h], so member m of the EP group gets the slots of its experts m E/e ..; one
all-to-all over the EP group (``EPContext``) sends them, the local experts run as two batched
matmuls over [E/e, e b C, h], and a second all-to-all returns the results (combine). Each is an
autograd function whose backward is the reverse all-to-all (the same exchange, on the
gradient). Every call goes through ``Comm`` under 'forward', 'backward', or 'recompute' (the
forward of a checkpointed block run again in backward), group 'EP': per MoE layer and
micro-batch, dispatch and combine of b E C h = b S k h elements each way. gloo in torch 2.13
runs ``all_to_all_single`` natively (checked on 4 ranks: equal and uneven splits, and the
list form ``all_to_all``), so no point-to-point emulation is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime.collectives import Comm, Group
from amsp_planner.runtime.support import check_moe

EXPERTS = "experts"
"""The name of the routed experts' parameter (the expert class) in a MoE block's unit."""

GATES = ("balanced", "topk")


def expert_width(model) -> int:
    return model.expert_ffn_hidden_size or model.ffn_hidden_size


def mlp_specs(model) -> list[tuple[str, tuple[int, ...]]]:
    """The MLP of a MoE layer after its norm: the router, the shared experts (if any), the
    routed experts (the expert class, last)."""
    h, E, fe = model.hidden_size, model.num_experts, expert_width(model)
    out = [("router", (E, h))]
    fs = model.shared_expert_ffn_hidden_size
    if fs:
        out += [("ws13", (2 * fs, h)), ("ws2", (h, fs))]
    return out + [(EXPERTS, (E, 3 * h * fe))]


@dataclass(frozen=True)
class Routing:
    """How a MoE layer routes (module docstring): the gate, and the capacity factor."""

    gate: str = "balanced"
    capacity_factor: float = 1.0


BALANCED = Routing()
"""The default: balanced routing, capacity factor 1."""

def capacity(model, seq_len: int, factor: float = 1.0) -> int:
    """Slots per expert per sequence: c S k / E (``support.check_moe`` refuses the rest)."""
    return check_moe(SimpleNamespace(model=model, training=SimpleNamespace(
        seq_len=seq_len, expert_imbalance=factor)))


def check_gate(gate: str) -> str:
    if gate not in GATES:
        raise AmspUserError(f"--gate: unknown routing '{gate}': use one of {', '.join(GATES)}")
    return gate


@dataclass
class EPContext:
    """This rank's expert-parallel group and the routing; whether the engine is in its
    backward pass (then a forward all-to-all belongs to a recomputed forward)."""

    comm: Comm
    group: Group
    routing: Routing = BALANCED
    backward: bool = False
    record: list | None = None
    """Under op-level checkpointing: the forward's all-to-all outputs of the block, kept."""
    replay: list | None = None
    """Its recomputation: the kept outputs, handed back in order instead of communicating."""
    peak_bytes: int = 0
    """The largest send + receive buffers of one all-to-all so far (the memory report)."""

    @property
    def size(self) -> int:
        return self.group.size

    def forward_phase(self) -> str:
        return "recompute" if self.backward else "forward"


def _exchange(x: torch.Tensor, ep: EPContext, phase: str) -> torch.Tensor:
    """One all-to-all over the EP group: chunk m of `x` (dim 0) goes to member m; chunk i of
    the result came from member i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    ep.comm.phase = phase
    ep.comm.all_to_all(out.view(-1), x.view(-1), ep.group)
    ep.peak_bytes = max(ep.peak_bytes, x.nbytes + out.nbytes)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ep):
        ctx.ep = ep
        if ep.replay is not None:  # op-level recomputation: the kept output, no collective
            return ep.replay.pop(0).detach()
        out = _exchange(x, ep, ep.forward_phase())
        if ep.record is not None:
            ep.record.append(out.detach())
        return out

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.ep, "backward"), None


def all_to_all(x: torch.Tensor, ep: EPContext | None) -> torch.Tensor:
    """The EP exchange (identity without expert parallelism)."""
    if ep is None or ep.size == 1:
        return x
    return _AllToAll.apply(x, ep)


def route(probs: torch.Tensor, k: int, gate: str) -> torch.Tensor:
    """Experts [b, s, k] of every token (module docstring)."""
    b, s, E = probs.shape
    if gate == "topk":
        return probs.topk(k, dim=-1).indices
    pos = torch.arange(s, device=probs.device).view(1, s, 1) * k
    return ((pos + torch.arange(k, device=probs.device).view(1, 1, k)) % E).expand(b, s, k)


def _slots(idx: torch.Tensor, E: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, kept) [b, s, k]: each assignment's row in the dispatch buffer [b, E, C] (in
    sequence order per expert: a stable sort by (sequence, expert) keeps the token order), and
    whether it is within the expert's capacity. O(b s k) memory, not O(b s k E)."""
    b, s, k = idx.shape
    key = (torch.arange(b, device=idx.device).view(b, 1) * E + idx.reshape(b, s * k)).view(-1)
    order = torch.sort(key, stable=True).indices
    start = torch.cumsum(torch.bincount(key, minlength=b * E), 0) - torch.bincount(
        key, minlength=b * E)
    pos = torch.empty_like(key)
    pos[order] = torch.arange(key.numel(), device=idx.device) - start[key[order]]
    kept = pos < C
    slot = key * C + pos.clamp(max=C - 1)
    return slot.view(b, s, k), kept.view(b, s, k)


def _swiglu_experts(x: torch.Tensor, experts: torch.Tensor, h: int, fe: int) -> torch.Tensor:
    """Local experts on their tokens: x [n_e, rows, h] -> [n_e, rows, h]."""
    n_e = experts.shape[0]
    w13 = experts[:, :2 * fe * h].view(n_e, 2 * fe, h)
    w2 = experts[:, 2 * fe * h:].view(n_e, h, fe)
    gate, up = torch.bmm(x, w13.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))


def moe_mlp(y: torch.Tensor, p: dict[str, torch.Tensor], model, ep: EPContext | None = None,
            routing: Routing = BALANCED) -> torch.Tensor:
    """The MoE MLP on the normed input y [b, s, h]; p holds the router, the shared experts
    and this rank's E/e rows of ``experts`` (all E without expert parallelism); the routing
    is `ep`'s when given."""
    b, s, h = y.shape
    E, k, fe = model.num_experts, model.experts_per_token, expert_width(model)
    routing = ep.routing if ep is not None else routing
    C = capacity(model, s, routing.capacity_factor)
    e = 1 if ep is None else ep.size
    n_local = p[EXPERTS].shape[0]
    assert n_local * e == E, (n_local, e, E)
    probs = F.linear(y, p["router"]).float().softmax(-1)
    idx = route(probs, k, routing.gate)
    w = probs.gather(-1, idx)
    w = (w / w.sum(-1, keepdim=True)).to(y.dtype)
    slot, kept = _slots(idx, E, C)
    # dispatch: the slots' source tokens (an empty slot reads a zero row)
    pad = b * s
    src = torch.full((b * E * C,), pad, dtype=torch.long, device=y.device)
    tok = torch.arange(b * s, device=y.device).view(b, s, 1).expand(b, s, k)
    src[slot[kept]] = tok[kept]
    rows = torch.cat([y.reshape(b * s, h), y.new_zeros(1, h)])[src]
    send = rows.view(b, E, C, h).transpose(0, 1).contiguous()  # [E, b, C, h], expert-major
    recv = all_to_all(send, ep).view(e, n_local, b * C, h)
    out = _swiglu_experts(recv.transpose(0, 1).reshape(n_local, e * b * C, h), p[EXPERTS], h, fe)
    back = all_to_all(out.view(n_local, e, b * C, h).transpose(0, 1).contiguous(), ep)
    done = back.view(E, b, C, h).transpose(0, 1).reshape(b * E * C, h)
    pick = torch.where(kept, slot, b * E * C)
    got = torch.cat([done, done.new_zeros(1, h)])[pick]  # [b, s, k, h]
    z = (got * w.unsqueeze(-1)).sum(2)
    if "ws13" in p:
        g, u = F.linear(y, p["ws13"]).chunk(2, dim=-1)
        z = z + F.linear(F.silu(g) * u, p["ws2"])
    return z


def expert_slice(model, index: int, ep: int, j: int) -> tuple[int, int]:
    """[a, b) of EP rank j's experts in the logical unit `index` (a MoE block): rows j E/e ..
    of ``experts``, the unit's last parameter."""
    n = model.unit_params()[index]
    size = model.unit_expert_params()[index]
    part = size // ep
    return n - size + j * part, n - size + (j + 1) * part
