"""The parameter gathers of the sharded engine, and the saved tensors that live in them.

Forward: all-gather unit i's P shards into a gather buffer (qwZ: INT8 + scales; fp8ag: FP8
bytes under the unit's scale, runtime/fp8.py; dequantized on arrival), started while the previous unit computes; hpZ keeps this rank's slice of the
gathered unit as the secondary copy. Backward: the same over P, or over hpZ from the
secondary copy. With the tied embedding the embedding unit has a gather buffer of its own.

The saved-tensor hooks pack a tensor autograd saves in a gather buffer as (unit, shape,
stride, offset) and unpack it from wherever that unit was gathered again ([Note: units outside
autograd's reach] in ``engine.py``); the leaves alias the buffer with a version counter of
their own ([Note: leaves and the gather buffers]).

``Gathers``: the methods of ``engine.ShardedEngine`` that gather, on the engine's own state.
"""

from __future__ import annotations

import torch

from amsp_planner.runtime import fp8 as F8
from amsp_planner.runtime import model as M
from amsp_planner.runtime.collectives import Work
from amsp_planner.runtime.quant import dequantize_chunks, qbytes, quantize_chunks


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


class Gathers:
    """The gathers and saved-tensor hooks of ShardedEngine (a base of it; its state is the
    engine's)."""

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
        if self.fp8ag:
            return self._fetch_fp8(i, dst, keep)
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

    def _fetch_fp8(self, i: int, dst: torch.Tensor, keep) -> _Fetch:
        """The FP8 all-gather of unit i (runtime/fp8.py): this rank's shard cast under the
        unit's scale, the bytes gathered as uint8, the unit dequantized into `dst`."""
        scale = self._fp8_scale(i)
        recv = self.qrecv[self._qslot][:dst.numel()]
        self._qslot ^= 1
        send = F8.quantize(self.p_shard[i], scale)
        work = self.comm.all_gather(recv, send, self.groups["P"], True)

        def finish(send=send):  # keeps the send buffer alive until the gather is done
            dst.copy_(F8.dequantize(recv, scale))
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
