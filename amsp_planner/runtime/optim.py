"""The step boundary of the sharded engine: AdamW on the fp32 OS shard and the parameter update.

Once per step, per unit: reduce-scatter the G shard over OS_shard into the step buffer,
all-reduce over OS_replica (phase ``grad_sync``), AdamW on the fp32 master shard, all-gather
the updated shard in the parameter dtype over P_update into the P shard (phase ``update``);
one world all-reduce carries [loss, grad-norm^2]. With the guard, one world all-reduce first
(phase ``guard``) skips a step with a non-finite loss or gradient on any rank.

Owns the training dtypes (``DTYPES``), the optimizer's settings (``OptimConfig``) and its step
(``adamw_``, also what ``amsp calibrate`` times), and ``StepBoundary``: the methods of
``engine.ShardedEngine`` that run the step, on the engine's own state (``engine.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from amsp_planner.runtime import faults
from amsp_planner.runtime.collectives import Work
from amsp_planner.runtime.layout import UnitLayout

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter (a flat buffer has no names)."""


def adamw_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
           o: OptimConfig, step: int) -> torch.Tensor:
    """One AdamW step, in place, on an fp32 master shard `p` and its moments, from the
    synchronised gradient `grad` in its own dtype (decoupled weight decay, bias-corrected
    moments); returns the gradient's squared norm. The optimizer step of the runtime, and what
    `amsp calibrate` times."""
    g = grad.float()
    sq = g.pow(2).sum()
    bc1, bc2 = 1 - o.beta1 ** step, 1 - o.beta2 ** step
    p.mul_(1 - o.lr * o.weight_decay)
    m.lerp_(g, 1 - o.beta1)
    v.mul_(o.beta2).addcmul_(g, g, value=1 - o.beta2)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(o.eps)
    p.addcdiv_(m, denom, value=-o.lr / bc1)
    return sq


class StepBoundary:
    """The step boundary of ShardedEngine (a base of it; its state is the engine's)."""

    def classes(self) -> list:
        """The parameter classes whose states step together: this one, and a MoE model's
        routed experts (``experts.ExpertShards``, their own units, factors and groups)."""
        xp = getattr(self, "xp", None)
        return [self] if xp is None else [self, xp]

    def nonfinite(self, loss_sum: float) -> bool:
        """Whether any rank has a non-finite loss or gradient before the step: one world
        all-reduce (phase 'guard'). Every gradient element lands in some rank's G shard, so
        a NaN anywhere is seen by the rank that owns it."""
        bad = sum(int(not torch.isfinite(g).all()) for c in self.classes() for g in c.g_shard)
        flag = torch.tensor([float(bad) + float(not math.isfinite(loss_sum))],
                            dtype=torch.float32, device=self.device)
        self.comm.phase = "guard"
        self.comm.all_reduce(flag, self.groups["world"])
        return float(flag) > 0

    def optimizer_step(self, loss_sum: float, guard: bool = False) -> tuple[float, float]:
        """Grad sync, AdamW, parameter update; returns (global mean loss, grad norm).
        `guard`: skip the step (no update, gradients dropped; returns NaN, NaN) when any rank
        has a non-finite loss or gradient."""
        if guard and self.nonfinite(loss_sum):
            for c in self.classes():
                for g in c.g_shard:
                    g.zero_()
            return math.nan, math.nan
        faults.at(doing="running the optimizer step")
        norm2 = torch.zeros((), dtype=torch.float32, device=self.device)
        gathers = []
        for c in self.classes():
            n2, works = c._step_units()
            norm2 += n2
            gathers += works
        for w in gathers:
            if w is not None:
                w.wait()
        stats = torch.stack([torch.tensor(loss_sum, dtype=torch.float32, device=self.device),
                             norm2])
        self.comm.phase = "update"
        self.comm.all_reduce(stats, self.groups["world"])
        return float(stats[0]), math.sqrt(float(stats[1]))

    def _step_units(self) -> tuple[torch.Tensor, list]:
        """This class's grad sync, AdamW and update gathers, unit by unit; returns its squared
        gradient norm on this rank divided by its OS replicas (each element is held by that
        many ranks), and the update gathers still pending."""
        o = self.optim
        self.step_count += 1
        norm2 = torch.zeros((), dtype=torch.float32, device=self.device)
        gathers = []
        for i, lay in enumerate(self.layouts):
            self.comm.phase = "grad_sync"
            g = self.g_shard[i]
            if self.step_buf is not None:
                gos = self.step_buf[:lay.os_len]
                self.comm.reduce_scatter(gos, g, self.groups["OS_shard"])
            else:
                gos = g
            self.comm.all_reduce(gos, self.groups["OS_replica"])
            norm2 += adamw_(self.master[i], self.exp_avg[i], self.exp_avg_sq[i], gos, o,
                            self.step_count)
            if self.tp_rank:  # TP: the replicated weights' gradients count once, on TP rank 0
                for a, b in self._replicated_in_os(i):
                    norm2 -= gos[a:b].float().pow(2).sum()
            g.zero_()
            self.comm.phase = "update"
            gathers.append(self._update_params(i, lay))
        return norm2 / self.groups["OS_replica"].size, gathers

    def _replicated_in_os(self, i: int) -> list[tuple[int, int]]:
        """[a, b) ranges of this rank's OS shard of unit i that hold replicated weights."""
        oo, n = self.layouts[i].os_off(self.i_os), self.layouts[i].os_len
        out = []
        for off, k in self.rep_slices[i]:
            a, b = max(off, oo), min(off + k, oo + n)
            if a < b:
                out.append((a - oo, b - oo))
        return out

    def _update_params(self, i: int, lay: UnitLayout) -> Work | None:
        """Cast the updated master shard and gather it into the P shard; returns the pending
        all-gather when it can finish later (its output is the P shard itself)."""
        new = self.master[i].to(self.pdt)
        group = self.groups["P_update"]
        if group.size == 1:
            self.p_shard[i].copy_(new)
            return None
        pos = lay.update_positions(self.i_p)
        if pos is None:
            w = self.comm.all_gather(self.p_shard[i], new, group, async_op=True)
            return Work(w.handle, lambda: new)  # keeps the input alive until the wait
        # the permuted output lands in an idle buffer: a gather buffer, else a gradient buffer
        idle = self.gather[0] if self.gather else self.gradbuf[0]
        out = idle.view(torch.uint8)[:lay.p_len * new.element_size()].view(self.pdt)
        self.comm.all_gather(out, new, group)
        idx = torch.tensor(pos, device=self.device)
        self.p_shard[i].view(len(pos), -1).index_copy_(0, idx, out.view(len(pos), -1))
        return None
