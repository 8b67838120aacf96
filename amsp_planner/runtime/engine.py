"""The sharded training step: exactly the collectives of ``cost/schedule.py``, on exactly the
tensors of ``cost/memory.py``.

Per micro-batch, per unit (forward in order, backward in reverse):
  forward   all-gather the P shards into a gather buffer (qwZ: INT8 + scales, dequantized),
            prefetching the next unit while this one computes; hpZ: keep this rank's slice of
            the gathered unit as the secondary copy;
  backward  all-gather again over P (or over hpZ from the secondary copy), then the unit's
            gradient goes into a gradient buffer and is reduce-scattered over G (qgZ: two-hop
            INT4 all-to-all) into the G shard, asynchronously, overlapping the next unit; with
            s_G = 1 it is accumulated locally into the full-size G shard.
Once per step, per unit: reduce-scatter the G shard over OS_shard into the step buffer,
all-reduce over OS_replica, AdamW on the fp32 master shard, all-gather the updated shard (in the
parameter dtype) over P_update into the P shard. One world all-reduce carries [loss, grad-norm^2].

This module owns the engine's state (its buffers, by the memory model's terms, and their
initial values), the micro-batch's forward and backward unit by unit, and the full units for
tests and checkpoints. The engine's other parts are its bases: the gathers and saved-tensor
hooks (``gather.py``), the gradient path to the G shard (``reduce.py``), the step boundary and
AdamW (``optim.py``).

[Note: units outside autograd's reach] Each unit runs on leaves that are views of its gather
buffer, and the backward is driven unit by unit with ``torch.autograd.grad``. Tensors autograd
saves that live in a gather buffer are packed as (unit, shape, stride, offset) and unpacked
from wherever that unit was gathered again for backward, so the buffers can be reused between
forward and backward without holding a copy.

[Note: leaves and the gather buffers] A unit's leaves alias its gather buffer but do not share
its version counter (``detach()`` would): gloo finishes an asynchronous all-gather by copying
into the output on its own thread, which bumps the output's version counter, and the prefetch
of the next unit in backward may land in the buffer a checkpointed block's leaves were made
from in forward; its recomputation packs those leaves, and autograd refuses a pack hook whose
input's version changes meanwhile ("A saved tensor pack hook is modifying its input in place").

[Note: tied embeddings] The tied LM head uses the embedding unit's weights at the end of
forward and the start of backward, while the embedding lookup uses them at the start of
forward and its gradient arrives at the end of backward. The embedding unit therefore has its
own gather buffer (holding it from the lookup to the head) and its own gradient buffer (collecting
the head's and the lookup's parts), and it is gathered for backward together with the head.
"""

from __future__ import annotations

import torch

from amsp_planner.cost.fp8_gathers import gathers_fp8
from amsp_planner.runtime import faults
from amsp_planner.runtime import model as M
from amsp_planner.runtime import moe as MOE
from amsp_planner.runtime import tp as TP
from amsp_planner.runtime.collectives import Comm, Group
from amsp_planner.runtime.experts import ExpertClass, fetch_unit
from amsp_planner.runtime.fp8 import Fp8Scales
from amsp_planner.runtime.gather import Gathers, _alias
from amsp_planner.runtime.layout import UnitLayout
from amsp_planner.runtime.optim import DTYPES, OptimConfig, StepBoundary, adamw_  # noqa: F401
from amsp_planner.runtime.reduce import GradReduce
from amsp_planner.runtime.state import ShardState
from amsp_planner.runtime.support import check_tp


class ShardedEngine(ShardState, Gathers, GradReduce, StepBoundary, ExpertClass, Fp8Scales):
    """Model states of one rank under one strategy, and the training step over them."""

    def __init__(self, job, strategy, comm: Comm, groups: dict[str, Group], rank: int,
                 optim: OptimConfig | None = None, device: str | torch.device = "cpu",
                 gate: str = "balanced"):
        M.check_supported(job.model)
        check_tp(strategy, job)
        self.job, self.s, self.comm, self.groups = job, strategy, comm, groups
        self.rank, self.optim, self.device = rank, optim or OptimConfig(), torch.device(device)
        t = job.training
        self.pdt, self.gdt = DTYPES[t.dtype_name], DTYPES[t.grad_dtype_name]
        tp = self.tp = strategy.tp
        self.specs = M.unit_param_specs(job.model, tp)
        self.offsets = [M.offsets(u) for u in self.specs]
        self.real = job.model.unit_params() if tp == 1 else job.model.tp_unit_params(tp)
        self.num_units = len(self.specs)
        self.tied = job.model.tied_embeddings
        s = strategy
        self.units = job.tp_units(tp)
        """Padded elements of each unit this rank's buffers hold (its TP shard at tp > 1; a
        MoE block's dense part when the experts are a class of their own, experts.py)."""
        self.max_unit = max(self.units)
        self._split_experts(gate)
        self.layouts = [UnitLayout(u, s.s_p, s.s_g, s.s_os, s.hpz) for u in self.units]
        self.dp_rank, self.tp_rank = rank // tp, rank % tp
        """[Note: TP layout] Global rank r is TP rank r mod t of data-parallel rank r div t;
        the ZeRO factors shard over the data-parallel ranks (groups strided by t)."""
        d = self.dp_rank
        self.i_p, self.i_os = d % s.s_p, d % s.s_os
        self.i_h = d % s.hpz
        self.tpc = None
        self.rep_slices: list[list[tuple[int, int]]] = [[] for _ in self.specs]
        if tp > 1:
            self.tpc = TP.TPContext(comm, groups["TP"])
            self.rep_slices = [TP.replicated_slices(job.model, i, tp)
                               for i in range(self.num_units)]
        self.s0_g, self.s1_g = s.mesh("g", job.gpus_per_node)
        self.ckpt_modes = [None] + M.block_modes(s.ckpt_value, job.model.num_layers) + [None]
        """Per unit: None, 'full' or 'op' checkpointing (blocks only)."""
        self.step_count = 0
        self.fp8ag = gathers_fp8(job, s)
        """FP8 parameter all-gathers (runtime/fp8.py), as the plan's schedule has them."""
        self._alloc()

    # ----- initial values ---------------------------------------------------------------------
    def init_params(self, seed: int) -> None:
        """The initial values, unit by unit: each unit is drawn in full (deterministic from
        the seed, the same on every rank and plan), this rank keeps its shards, and the unit
        is freed before the next, so start-up memory is the model states (less the Adam
        moments, allocated at the first step) plus one unit."""
        for i, lay in enumerate(self.layouts):
            flat = torch.zeros(lay.size, dtype=torch.float32)
            if i in self.x_of:  # the dense part here, this rank's experts in the expert unit
                full = M.init_unit(self.job.model, i, seed)
                flat[:self.real[i]] = full[:self.real[i]]
                self._init_experts(i, full)
                del full
            elif self.tp == 1:
                M.init_unit(self.job.model, i, seed, out=flat)
            else:  # the logical unit, then this TP rank's shard of it
                full = M.init_unit(self.job.model, i, seed)
                flat[:self.real[i]] = full[TP.shard_index(self.job.model, i, self.tp,
                                                          self.tp_rank)]
                del full
            self._load_unit(i, flat.to(self.device))
            del flat

    # ----- one micro-batch ------------------------------------------------------------------------
    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, micro: int,
                         loss_scale: float) -> float:
        """Forward and backward of one micro-batch; returns its (unscaled) mean loss."""
        U, model, tpc, epc = self.num_units, self.job.model, self.tpc, self.epc
        self._cur: dict[int, torch.Tensor] = {}
        self._live: dict[int, int] = {}
        acts: list = [None] * U
        leaves: list = [None] * U
        tp_kept: list = [None] * U
        """Per op-level checkpointed block at tp > 1: its TP collectives' forward outputs
        (and a MoE block's all-to-all outputs)."""
        emb_head_leaf = None
        fetch = fetch_unit(self, 0, "forward")
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            x = None
            for i in range(U):
                faults.at(doing=f"running the forward of unit {i}")
                buf = fetch.wait()
                xbuf = fetch.xbuf
                if i + 1 < U:
                    fetch = fetch_unit(self, i + 1, "forward")
                self._cur[i] = buf
                self._live = {buf.untyped_storage().data_ptr(): i}
                leaves[i] = self._leaves(i, buf)
                if xbuf is not None:
                    self._expert_leaf(i, xbuf, leaves[i])
                kind = M.unit_kind(i, U)
                if kind == "embedding":
                    if tpc is None:
                        y = M.embed(tokens, leaves[i])
                    else:
                        y = TP.embed(tokens, leaves[i], tpc)
                    acts[i] = (None, y)
                elif kind == "block":
                    xin = x.detach().requires_grad_(True)
                    if tpc is None:
                        ep = epc if i in self.x_of else None
                        if ep is not None:
                            ep.record = [] if self.ckpt_modes[i] == "op" else None
                        y = M.run_block(xin, leaves[i], model, self.ckpt_modes[i], ep,
                                        self.routing)
                        if ep is not None:
                            tp_kept[i], ep.record = ep.record, None
                    else:
                        op = self.ckpt_modes[i] == "op"
                        tpc.record = [] if op else None
                        y = TP.run_block(xin, leaves[i], model, tpc, self.ckpt_modes[i])
                        tp_kept[i], tpc.record = tpc.record, None
                    acts[i] = (xin, y)
                else:
                    xin = x.detach().requires_grad_(True)
                    if self.tied:
                        ebuf = self._cur[0]
                        self._live[ebuf.untyped_storage().data_ptr()] = 0
                        emb_head_leaf = ebuf[:self.real[0]].view(-1, model.hidden_size)
                        emb_head_leaf = _alias(emb_head_leaf).requires_grad_(True)
                        lm = emb_head_leaf
                    else:
                        lm = leaves[i]["lm_head"]
                    if tpc is None:
                        y = M.head_loss(xin, leaves[i], lm, targets)
                    else:
                        y = TP.head_loss(xin, leaves[i], lm, targets, tpc)
                    acts[i] = (xin, y)
                x = y
        loss = acts[U - 1][1]
        # backward, unit by unit in reverse
        head = U - 1
        fetch = fetch_unit(self, head, "backward")
        emb_fetch = self._fetch(0, "backward") if self.tied else None
        grad_y = None
        emb_target = None
        for c in (tpc, epc):  # a forward collective from now on is a recomputation
            if c is not None:
                c.backward = True
        for j in range(head, -1, -1):
            faults.at(doing=f"running the backward of unit {j}")
            xbuf = None
            if j == 0 and self.tied:
                buf = emb_fetch.wait()
            else:
                buf = fetch.wait()
                xbuf = fetch.xbuf
                nxt = j - 1
                if nxt >= 0 and not (nxt == 0 and self.tied):
                    fetch = fetch_unit(self, nxt, "backward")
            self._cur[j] = buf
            if xbuf is not None:
                self._cur[U + j] = xbuf
            if j == head and self.tied:
                self._cur[0] = emb_fetch.wait()
            if self.ckpt_modes[j]:
                # the recomputation reads the parameters through the forward's leaves: point
                # them at this backward gather (the forward's buffer holds another unit now)
                for name, view in M.views(buf, self.specs[j]).items():
                    leaves[j][name].data = view
                if xbuf is not None:
                    xv = M.views(xbuf, self.xp.specs[self.x_of[j]])
                    leaves[j][MOE.EXPERTS].data = xv[MOE.EXPERTS]
            xin, y = acts[j]
            names = list(leaves[j])
            inputs = ([xin] if xin is not None else []) + [leaves[j][k] for k in names]
            ctx = tpc if tpc is not None else epc if j in self.x_of else None
            if ctx is not None:
                ctx.replay = tp_kept[j]
            if j == head:
                if self.tied:
                    inputs.append(emb_head_leaf)
                grads = torch.autograd.grad(y * loss_scale, inputs)
            else:
                grads = torch.autograd.grad(y, inputs, grad_y)
            if ctx is not None:  # (the recomputation stops early: the last may be unused)
                ctx.replay = tp_kept[j] = None
            if xin is not None:
                grad_y, grads = grads[0], grads[1:]
            acts[j] = None
            pgrads = dict(zip(names, grads[:len(names)], strict=True))
            if xbuf is not None:
                self._reduce_experts(j, pgrads.pop(MOE.EXPERTS), micro)
            if self.rep_slices[j]:
                self._sum_replicated(j, pgrads)
            if j == head and self.tied:
                emb_target = self._grad_target(0)
                self._deposit(0, emb_target, {"tok_emb": grads[-1]}, first=True)
            if j == 0 and self.tied:
                target, first = emb_target, False
            else:
                target, first = self._grad_target(j), True
            self._deposit(j, target, pgrads, first)
            if self.s.s_g > 1:
                self._reduce(j, target, micro)
        for c in self.classes():
            c._wait_pending()
        for c in (tpc, epc):
            if c is not None:
                c.backward = False
        self._cur, self._live = {}, {}
        return float(loss.detach())

    # ----- whole parameters (tests, checkpoints) ------------------------------------------------
    def full_units(self, what: str = "master") -> list[torch.Tensor]:
        """The unpadded full fp32 units of `what` ('master', 'exp_avg', 'exp_avg_sq'),
        assembled on every rank with a world all-gather (phase 'export')."""
        src = getattr(self, what)
        world = self.groups["world"]
        self.comm.phase = "export"
        out, t = [], self.tp
        for i, lay in enumerate(self.layouts):
            allg = torch.empty(lay.os_len * world.size, dtype=torch.float32, device=self.device)
            self.comm.all_gather(allg, src[i], world)
            full = torch.empty(t, lay.size, dtype=torch.float32, device=self.device)
            for r in range(world.size):  # rank r: TP rank r mod t of DP rank r div t
                oo = lay.os_off((r // t) % self.s.s_os)
                full[r % t, oo:oo + lay.os_len] = allg[r * lay.os_len:(r + 1) * lay.os_len]
            if t == 1:
                out.append(full[0, :self.real[i]].clone())
                continue
            logical = torch.empty(self.job.model.unit_params()[i], dtype=torch.float32,
                                  device=self.device)
            for j in range(t):
                idx = TP.shard_index(self.job.model, i, t, j).to(self.device)
                logical[idx] = full[j, :self.real[i]]
            out.append(logical)
        if self.xp is not None:  # each MoE block: its dense part, then all E experts
            for k, part in enumerate(self.xp.full_parts(what)):
                i = self.xp.moe_units[k]
                out[i] = torch.cat([out[i], part])
        return out
