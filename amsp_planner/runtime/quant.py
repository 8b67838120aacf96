"""Block quantization for ZeRO++ (arXiv 2306.10209): qwZ INT8 and qgZ INT4, one fp32 scale
per block, symmetric (scale = absmax / 127 or / 7).

A quantized chunk of n elements is one uint8 buffer: n*bits/8 bytes of values (INT4: two per
byte, low nibble first, offset by 8) followed by n/block fp32 scales, so its size is
``cost.schedule.quantized_bytes(n, bits, block)``. A collective's buffer is its members' chunks
back to back, each quantized on its own.
"""

from __future__ import annotations

import torch

from amsp_planner.cost.schedule import quantized_bytes as qbytes  # the layout the plan prices

_QMAX = {8: 127, 4: 7}


def quantize_into(out: torch.Tensor, x: torch.Tensor, bits: int, block: int) -> None:
    """Quantize `x` (any float dtype) into the uint8 buffer `out` of qbytes(x.numel()) bytes."""
    n = x.numel()
    nv = n * bits // 8
    assert out.numel() == qbytes(n, bits, block) and out.dtype == torch.uint8
    xb = x.reshape(-1, block).float()
    qmax = _QMAX[bits]
    scale = xb.abs().amax(dim=1).clamp_min(1e-30) / qmax
    q = torch.round(xb / scale[:, None]).clamp_(-qmax - 1, qmax).reshape(-1)
    if bits == 8:
        out[:nv].copy_(q.to(torch.int8).view(torch.uint8))
    else:
        u = (q + 8).to(torch.uint8)
        out[:nv].copy_(u[0::2] | (u[1::2] << 4))
    out[nv:].view(torch.float32).copy_(scale)


def dequantize(buf: torch.Tensor, n: int, bits: int, block: int) -> torch.Tensor:
    """fp32 values of a quantized chunk of n elements."""
    nv = n * bits // 8
    scale = buf[nv:].view(torch.float32)
    if bits == 8:
        q = buf[:nv].view(torch.int8).float()
    else:
        b = buf[:nv]
        q = torch.stack([(b & 15), (b >> 4)], dim=1).reshape(-1).float() - 8
    return (q.view(-1, block) * scale[:, None]).reshape(-1)


def quantize_chunks(out: torch.Tensor, x: torch.Tensor, chunks: int, bits: int, block: int) -> None:
    """Quantize `x` as `chunks` equal chunks, back to back in `out`."""
    n = x.numel() // chunks
    qb = qbytes(n, bits, block)
    for c in range(chunks):
        quantize_into(out[c * qb:(c + 1) * qb], x[c * n:(c + 1) * n], bits, block)


def dequantize_chunks(buf: torch.Tensor, n_total: int, chunks: int, bits: int, block: int
                      ) -> list[torch.Tensor]:
    n = n_total // chunks
    qb = qbytes(n, bits, block)
    return [dequantize(buf[c * qb:(c + 1) * qb], n, bits, block) for c in range(chunks)]
