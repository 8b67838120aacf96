"""The gradient path of the sharded engine: from a unit's backward to its G shard.

A unit's gradient collects in a gradient buffer (double-buffered; the tied embedding has its
own, collecting the head's part and the lookup's), or with s_G = 1 straight in the full-size
G shard. With s_G > 1 it is reduce-scattered over G into the G shard, asynchronously,
overlapping the next unit's backward (through a staging buffer when the shard order differs
from the buffer's); ZeRO++ qgZ instead runs a two-hop INT4 all-to-all, inside the node, then
across nodes. At tp > 1 the gradients of the weights every TP rank holds whole are summed
over the TP group first.

``GradReduce``: the methods of ``engine.ShardedEngine`` that do this, on the engine's own
state (``engine.py``).
"""

from __future__ import annotations

import torch

from amsp_planner.runtime import tp as TP
from amsp_planner.runtime.layout import UnitLayout
from amsp_planner.runtime.quant import dequantize_chunks, qbytes, quantize_chunks


class GradReduce:
    """The gradient path of ShardedEngine (a base of it; its state is the engine's)."""

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
