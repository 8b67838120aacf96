"""The model-state tensors of one parameter class on one rank, by the memory model's terms.

``ShardState``: a base of ``engine.ShardedEngine`` (the dense class, or every parameter of a
dense model) and of ``experts.ExpertShards`` (the routed experts of a MoE model): the P, G and
fp32 OS shards of each unit, the Adam moments (allocated at first use), the gather and gradient
buffers, the staging and step buffers, sized from the class's own units and factors
(``self.layouts``, ``self.s``, ``self.max_unit``, ``self.units``, ``self.tied``).
"""

from __future__ import annotations

import torch

from amsp_planner.runtime.collectives import Work
from amsp_planner.runtime.quant import qbytes

BUFFERS = ("gather_buffers", "grad_buffers", "staging", "step_buffer")


class ShardState:
    """Allocation and the state's tensors (a base; its attributes are the class's)."""

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
        """Bytes of the runtime's own tensors by the memory model's terms (cost/memory.py); a
        MoE model's expert class under its own (``expert_*``), with the largest send and
        receive buffers one all-to-all held (``dispatch_buffers``, measured in runtime/moe.py)."""
        out = {k: sum(t.nbytes for t in v) for k, v in self.state_tensors().items()}
        xp = getattr(self, "xp", None)
        if xp is not None:
            x = {k: sum(t.nbytes for t in v) for k, v in xp.state_tensors().items()}
            out.update(expert_params=x["params"], expert_grads=x["grads"],
                       expert_optimizer=x["optimizer"],
                       expert_buffers=sum(x[k] for k in BUFFERS),
                       dispatch_buffers=self.epc.peak_bytes)
        return out

    def _load_unit(self, i: int, flat: torch.Tensor) -> None:
        """This rank's shards of unit i from its padded full fp32 values (the Adam moments of
        a new engine are zero)."""
        lay = self.layouts[i]
        po = lay.p_off(self.i_p)
        self.p_shard[i].copy_(flat[po:po + lay.p_len])
        oo = lay.os_off(self.i_os)
        self.master[i].copy_(flat[oo:oo + lay.os_len])
