"""The FP8 parameter all-gather (``fp8ag``; cost/schedule.py, docs/fp8.md) on CPU with
torch's float8 dtypes.

Each unit is gathered in float8_e4m3fn under one tensorwise scale: scale = amax / 448 (the
largest finite e4m3fn value, torch.finfo(torch.float8_e4m3fn).max), from the unit's amax over
its P group (an all-reduce MAX of one fp32 per unit, phase ``update``, once per step before
the first gather: torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does it after the
optimizer step, the same count per step). A rank casts its own P shard to FP8, the gather
moves the bytes as uint8 (1 per element), and every rank dequantizes the gathered unit into
its gather buffer: the matmuls stay in the runtime's precision (fp32 or bf16 on CPU).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` cast to e4m3fn under `scale`, as uint8 bytes (one per element)."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8)


def dequantize(buf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3fn bytes under `scale`."""
    return buf.view(E4M3).float() * scale


class Fp8Scales:
    """The engine's per-unit FP8 scales (a base of ``engine.ShardedEngine``; its state is the
    engine's): refreshed once per step, before the step's first gather."""

    def _fp8_scale(self, i: int) -> torch.Tensor:
        if getattr(self, "_fp8_step", None) != self.step_count:
            self._fp8_refresh()
        return self._fp8_scales[i]

    def _fp8_refresh(self) -> None:
        phase, self.comm.phase = self.comm.phase, "update"
        out = []
        for shard in self.p_shard:
            amax = shard.detach().abs().max().float().reshape(1)
            self.comm.all_reduce(amax, self.groups["P"], op="max")
            out.append(amax.clamp_min(1e-12) / E4M3_MAX)
        self.comm.phase = phase
        self._fp8_scales, self._fp8_step = out, self.step_count
