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

import math
from dataclasses import dataclass

import torch

from amsp_planner.runtime import faults
from amsp_planner.runtime import model as M
from amsp_planner.runtime import tp as TP
from amsp_planner.runtime.collectives import Comm, Group, Work
from amsp_planner.runtime.layout import UnitLayout
from amsp_planner.runtime.quant import dequantize_chunks, qbytes, quantize_chunks

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


class _Fetch:
    """A gather in flight: ``wait()`` returns the unit's full flat buffer."""

    def __init__(self, work: Work, dst: torch.Tensor, finish=None):
        self.work, self.dst, self.finish, self.done = work, dst, finish, False

    def wait(self) -> torch.Tensor:
        if not self.done:
            self.work.wait()
            if self.finish is not None:
                self.finish()
            self.done = True
        return self.dst


def _alias(v: torch.Tensor) -> torch.Tensor:
    """A tensor on `v`'s memory with a version counter of its own (``detach`` would share
    `v`'s): [Note: leaves and the gather buffers]."""
    t = v.new_empty(0)
    return t.set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())


class ShardedEngine:
    """Model states of one rank under one strategy, and the training step over them."""

    def __init__(self, job, strategy, comm: Comm, groups: dict[str, Group], rank: int,
                 optim: OptimConfig = OptimConfig(), device: str | torch.device = "cpu"):
        M.check_supported(job.model)
        from amsp_planner.runtime.preflight import check_tp

        check_tp(strategy, job)
        self.job, self.s, self.comm, self.groups = job, strategy, comm, groups
        self.rank, self.optim, self.device = rank, optim, torch.device(device)
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
        """Padded elements of each unit this rank's buffers hold (its TP shard at tp > 1)."""
        self.max_unit = max(self.units)
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
        self._alloc()

    # ----- allocation -------------------------------------------------------------------------
    def _new(self, n: int, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def _alloc(self) -> None:
        s, u_max = self.s, self.max_unit
        L = self.layouts
        self.p_shard = [self._new(x.p_len, self.pdt) for x in L]
        self.g_shard = [self._new(x.g_len, self.gdt) for x in L]
        self.master = [self._new(x.os_len, torch.float32) for x in L]
        self._moments: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.hpz = [self._new(x.hpz_len, self.pdt) for x in L] if s.hpz > 1 else []
        e = self.units[0]
        self.gather = [self._new(u_max, self.pdt) for _ in range(2)] if s.s_p > 1 else []
        self.gather_emb = self._new(e, self.pdt) if s.s_p > 1 and self.tied else None
        qb8 = qbytes(u_max, 8, s.quant_block)
        self.qrecv = [self._new(qb8, torch.uint8) for _ in range(2)] if s.qwz else []
        self.gradbuf = [self._new(u_max, self.gdt) for _ in range(2)] if s.s_g > 1 else []
        self.grad_emb = self._new(e, self.gdt) if s.s_g > 1 and self.tied else None
        qb4 = qbytes(u_max, 4, s.quant_block)
        self.qg = [self._new(qb4, torch.uint8) for _ in range(2)] if s.qgz else []
        need_staging = s.s_g > 1 and (1 < s.s_p < s.s_g or s.qgz)
        self.staging = self._new(u_max, self.gdt) if need_staging else None
        self.step_buf = self._new(u_max // s.s_os, self.gdt) if s.s_os > s.s_g else None
        self._gslot = 0
        self._qslot = 0
        self._rslot = 0
        self._pending: list[tuple[Work, object, object]] = []

    def _adam_moments(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The Adam moments, zero until the first step: allocated at first use (the first
        step, a checkpoint save or load), as torch's AdamW and DeepSpeed do, so they are not
        in the start-up peak."""
        if self._moments is None:
            L = self.layouts
            self._moments = ([self._new(x.os_len, torch.float32) for x in L],
                             [self._new(x.os_len, torch.float32) for x in L])
        return self._moments

    @property
    def exp_avg(self) -> list[torch.Tensor]:
        return self._adam_moments()[0]

    @property
    def exp_avg_sq(self) -> list[torch.Tensor]:
        return self._adam_moments()[1]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The runtime's own model-state tensors and buffers, by the memory model's terms."""
        opt = self.master + self.exp_avg + self.exp_avg_sq
        extra = [t for t in (self.gather_emb,) if t is not None]
        gextra = [t for t in (self.grad_emb,) if t is not None]
        return {
            "params": list(self.p_shard),
            "grads": list(self.g_shard),
            "optimizer": opt,
            "hpz": list(self.hpz),
            "gather_buffers": self.gather + extra + self.qrecv,
            "grad_buffers": self.gradbuf + gextra + self.qg,
            "staging": [self.staging] if self.staging is not None else [],
            "step_buffer": [self.step_buf] if self.step_buf is not None else [],
        }

    def state_bytes(self) -> dict[str, int]:
        return {k: sum(t.nbytes for t in v) for k, v in self.state_tensors().items()}

    # ----- initial values ---------------------------------------------------------------------
    def _load_unit(self, i: int, flat: torch.Tensor) -> None:
        """This rank's shards of unit i from its padded full fp32 values (the Adam moments of
        a new engine are zero)."""
        lay = self.layouts[i]
        po = lay.p_off(self.i_p)
        self.p_shard[i].copy_(flat[po:po + lay.p_len])
        oo = lay.os_off(self.i_os)
        self.master[i].copy_(flat[oo:oo + lay.os_len])

    def init_params(self, seed: int) -> None:
        """The initial values, unit by unit: each unit is drawn in full (deterministic from
        the seed, the same on every rank and plan), this rank keeps its shards, and the unit
        is freed before the next, so start-up memory is the model states (less the Adam
        moments, allocated at the first step) plus one unit."""
        for i, lay in enumerate(self.layouts):
            flat = torch.zeros(lay.size, dtype=torch.float32)
            if self.tp == 1:
                M.init_unit(self.job.model, i, seed, out=flat)
            else:  # the logical unit, then this TP rank's shard of it
                full = M.init_unit(self.job.model, i, seed)
                flat[:self.real[i]] = full[TP.shard_index(self.job.model, i, self.tp,
                                                          self.tp_rank)]
                del full
            self._load_unit(i, flat.to(self.device))
            del flat

    # ----- gathers ----------------------------------------------------------------------------
    def _fetch(self, i: int, phase: str) -> _Fetch:
        """Start gathering unit i for `phase` ('forward' or 'backward')."""
        lay, s = self.layouts[i], self.s
        if s.s_p == 1:
            return _Fetch(Work(None), self.p_shard[i])
        if i == 0 and self.tied:
            dst = self.gather_emb[:lay.size]
        else:
            dst = self.gather[self._gslot][:lay.size]
            self._gslot ^= 1
        self.comm.phase = phase
        if phase == "backward" and s.hpz > 1:
            return _Fetch(self.comm.all_gather(dst, self.hpz[i], self.groups["hpZ"], True), dst)
        keep = None
        if phase == "forward" and s.hpz > 1:
            def keep():
                h0 = self.i_h * lay.hpz_len
                self.hpz[i].copy_(dst[h0:h0 + lay.hpz_len])
        if not s.qwz:
            work = self.comm.all_gather(dst, self.p_shard[i], self.groups["P"], True)
            return _Fetch(work, dst, keep)
        recv = self.qrecv[self._qslot][:qbytes(lay.size, 8, s.quant_block)]
        self._qslot ^= 1
        send = torch.empty(qbytes(lay.p_len, 8, s.quant_block), dtype=torch.uint8,
                           device=self.device)
        quantize_chunks(send, self.p_shard[i], 1, 8, s.quant_block)
        work = self.comm.all_gather(recv, send, self.groups["P"], True)

        def finish(send=send):  # keeps the send buffer alive until the gather is done
            parts = dequantize_chunks(recv, lay.size, s.s_p, 8, s.quant_block)
            torch.cat(parts, out=dst) if dst.dtype == torch.float32 else dst.copy_(torch.cat(parts))
            if keep is not None:
                keep()
        return _Fetch(work, dst, finish)

    # ----- saved tensors of the gathered units ([Note: units outside autograd's reach]) --------
    def _pack(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.device != self.device or t.is_sparse:
            return t
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        unit = self._live.get(ptr)
        if unit is None:
            return t
        return (unit, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, tuple):
            unit, shape, stride, off = packed
            buf = self._cur[unit]
            return buf.as_strided(shape, stride, buf.storage_offset() + off)
        return packed

    def _leaves(self, i: int, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Leaves over unit i's views of `buf`, each with a version counter of its own
        ([Note: leaves and the gather buffers])."""
        return {k: _alias(v).requires_grad_(True) for k, v in M.views(buf, self.specs[i]).items()}

    # ----- gradients ----------------------------------------------------------------------------
    def _grad_target(self, i: int) -> torch.Tensor:
        """Where unit i's full gradient collects: a gradient buffer, or (s_G = 1) the G shard."""
        size = self.layouts[i].size
        if self.s.s_g == 1:
            return self.g_shard[i]
        if i == 0 and self.tied:
            return self.grad_emb[:size]
        slot = self._rslot
        self._rslot ^= 1
        self._wait_pending(self.gradbuf[slot])
        return self.gradbuf[slot][:size]

    def _deposit(self, i: int, target: torch.Tensor, grads: dict[str, torch.Tensor],
                 first: bool) -> None:
        accumulate = self.s.s_g == 1 or not first
        if not accumulate:
            target[self.real[i]:].zero_()
        for name, g in grads.items():
            off, n = self.offsets[i][name]
            dst = target[off:off + n]
            if accumulate:
                dst.add_(g.reshape(-1))
            else:
                dst.copy_(g.reshape(-1))

    def _wait_pending(self, buf: torch.Tensor | None = None) -> None:
        """Finish pending reductions (those reading `buf`, or all)."""
        keep = []
        for work, src, finish in self._pending:
            if buf is None or (src is not None and src.untyped_storage().data_ptr()
                               == buf.untyped_storage().data_ptr()):
                work.wait()
                if finish is not None:
                    finish()
            else:
                keep.append((work, src, finish))
        self._pending = keep

    def _reduce(self, i: int, full: torch.Tensor, micro: int) -> None:
        """Reduce unit i's full gradient over G into the G shard (s_G > 1)."""
        s, lay = self.s, self.layouts[i]
        self.comm.phase = "backward"
        src = full
        perm = lay.grad_source_chunks(self.s0_g, self.s1_g) if s.qgz else lay.grad_source_chunks()
        if self.staging is not None:
            self._wait_pending(self.staging)
            src = self.staging[:lay.size]
            if perm is None:
                src.copy_(full)
            else:
                idx = torch.tensor(perm, device=self.device)
                torch.index_select(full.view(s.s_g, -1), 0, idx, out=src.view(s.s_g, -1))
        if s.qgz:
            self.g_shard[i].add_(self._qgz_reduce(src, lay).to(self.gdt))
            return
        if micro == 0:
            work = self.comm.reduce_scatter(self.g_shard[i], src, self.groups["G"], True)
            self._pending.append((work, src, None))
            return
        out = torch.empty_like(self.g_shard[i])
        work = self.comm.reduce_scatter(out, src, self.groups["G"], True)
        self._pending.append((work, src, lambda: self.g_shard[i].add_(out)))

    def _qgz_reduce(self, staged: torch.Tensor, lay: UnitLayout) -> torch.Tensor:
        """ZeRO++ qgZ: INT4 all-to-all inside the node, then across nodes, summing each hop."""
        blk = self.s.quant_block
        x = staged.float()
        for name, m in (("G_intra", self.s0_g), ("G_inter", self.s1_g)):
            if m == 1:
                continue
            nb = qbytes(x.numel(), 4, blk)
            send, recv = self.qg[0][:nb], self.qg[1][:nb]
            quantize_chunks(send, x, m, 4, blk)
            self.comm.all_to_all(recv, send, self.groups[name])
            x = torch.stack(dequantize_chunks(recv, x.numel(), m, 4, blk)).sum(0)
        assert x.numel() == lay.g_len
        return x

    # ----- one micro-batch ------------------------------------------------------------------------
    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, micro: int,
                         loss_scale: float) -> float:
        """Forward and backward of one micro-batch; returns its (unscaled) mean loss."""
        U, model, tpc = self.num_units, self.job.model, self.tpc
        self._cur: dict[int, torch.Tensor] = {}
        self._live: dict[int, int] = {}
        acts: list = [None] * U
        leaves: list = [None] * U
        tp_kept: list = [None] * U
        """Per op-level checkpointed block at tp > 1: its TP collectives' forward outputs."""
        emb_head_leaf = None
        fetch = self._fetch(0, "forward")
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            x = None
            for i in range(U):
                faults.at(doing=f"running the forward of unit {i}")
                buf = fetch.wait()
                if i + 1 < U:
                    fetch = self._fetch(i + 1, "forward")
                self._cur[i] = buf
                self._live = {buf.untyped_storage().data_ptr(): i}
                leaves[i] = self._leaves(i, buf)
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
                        y = M.run_block(xin, leaves[i], model, self.ckpt_modes[i])
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
        fetch = self._fetch(head, "backward")
        emb_fetch = self._fetch(0, "backward") if self.tied else None
        grad_y = None
        emb_target = None
        if tpc is not None:
            tpc.backward = True  # a forward TP collective from now on is a recomputation
        for j in range(head, -1, -1):
            faults.at(doing=f"running the backward of unit {j}")
            if j == 0 and self.tied:
                buf = emb_fetch.wait()
            else:
                buf = fetch.wait()
                nxt = j - 1
                if nxt >= 0 and not (nxt == 0 and self.tied):
                    fetch = self._fetch(nxt, "backward")
            self._cur[j] = buf
            if j == head and self.tied:
                self._cur[0] = emb_fetch.wait()
            if self.ckpt_modes[j]:
                # the recomputation reads the parameters through the forward's leaves: point
                # them at this backward gather (the forward's buffer holds another unit now)
                for name, view in M.views(buf, self.specs[j]).items():
                    leaves[j][name].data = view
            xin, y = acts[j]
            names = list(leaves[j])
            inputs = ([xin] if xin is not None else []) + [leaves[j][k] for k in names]
            if tpc is not None:
                tpc.replay = tp_kept[j]
            if j == head:
                if self.tied:
                    inputs.append(emb_head_leaf)
                grads = torch.autograd.grad(y * loss_scale, inputs)
            else:
                grads = torch.autograd.grad(y, inputs, grad_y)
            if tpc is not None:  # (the recomputation stops early: the last may be unused)
                tpc.replay = tp_kept[j] = None
            if xin is not None:
                grad_y, grads = grads[0], grads[1:]
            acts[j] = None
            pgrads = dict(zip(names, grads[:len(names)], strict=True))
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
        self._wait_pending()
        if tpc is not None:
            tpc.backward = False
        self._cur, self._live = {}, {}
        return float(loss.detach())

    def _sum_replicated(self, j: int, pgrads: dict[str, torch.Tensor]) -> None:
        """TP: the gradients of the weights every TP rank holds whole (the norms) are partial
        sums over this rank's sequence shard: one all-reduce of all of unit j's over the TP
        group, in the gradient dtype (phase 'backward')."""
        names = [n for n in pgrads if n in TP.REPLICATED]
        buf = torch.cat([pgrads[n].reshape(-1).to(self.gdt) for n in names])
        self.comm.phase = "backward"
        self.comm.all_reduce(buf, self.tpc.group)
        off = 0
        for n in names:
            k = pgrads[n].numel()
            pgrads[n] = buf[off:off + k]
            off += k

    # ----- the step boundary -------------------------------------------------------------------
    def nonfinite(self, loss_sum: float) -> bool:
        """Whether any rank has a non-finite loss or gradient before the step: one world
        all-reduce (phase 'guard'). Every gradient element lands in some rank's G shard, so
        a NaN anywhere is seen by the rank that owns it."""
        bad = sum(int(not torch.isfinite(g).all()) for g in self.g_shard)
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
            for g in self.g_shard:
                g.zero_()
            return math.nan, math.nan
        o = self.optim
        faults.at(doing="running the optimizer step")
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
        for w in gathers:
            if w is not None:
                w.wait()
        stats = torch.stack([torch.tensor(loss_sum, dtype=torch.float32, device=self.device),
                             norm2])
        self.comm.phase = "update"
        self.comm.all_reduce(stats, self.groups["world"])
        replicas = self.groups["OS_replica"].size
        return float(stats[0]), math.sqrt(float(stats[1]) / replicas)

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
        return out
