"""The roofline of one matmul and the block's matmul shapes (cost/compute.py prices units with
them; cost/tp_overlap.py pairs TP collectives with them): the GPU's rates for a job, a matmul's
seconds max(FLOPs / (peak x achievable), bytes / HBM) + t0, one TP rank's (K, N) of each of a
block's forward matmuls, and whether its linears run FP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.cost.job import Job


@dataclass(frozen=True)
class _Rates:
    flop: float
    attn: float
    hbm: float | None
    t0: float
    act_bytes: int


def _rates(job: Job) -> _Rates:
    from amsp_planner.cost.attention_kernel import attention_fraction

    gpu, t = job.cluster.gpu, job.training
    peak = gpu.peak_flop_per_s(t.dtype_name)
    return _Rates(flop=peak * gpu.achievable_fraction, attn=peak * attention_fraction(job),
                  hbm=gpu.hbm_gbyte_per_s * 1e9 if gpu.hbm_gbyte_per_s else None,
                  t0=gpu.kernel_overhead_us * 1e-6, act_bytes=t.param_bytes)


def _matmul(r: _Rates, t: int, k: int, n: int) -> float:
    flops = 2.0 * t * k * n
    time = flops / r.flop
    if r.hbm is not None:
        time = max(time, r.act_bytes * (t * k + k * n + t * n) / r.hbm)
    return time + r.t0


def _div(x, tp: int):
    """x / tp, and x itself (its type kept) at tp = 1."""
    return x if tp == 1 else x / tp


def _block_matmuls(job: Job, tp: int = 1) -> list[tuple[int, int]]:
    """(K, N) of each forward matmul of a block (one TP rank's shard)."""
    m = job.model
    h, f, kv = m.hidden_size, _div(m.ffn_hidden_size, tp), _div(m.kv_dim, tp)
    q = _div(m.num_heads * m.head_dim, tp)
    mlp = [(h, f), (h, f), (f, h)] if m.ffn_matrices == 3 else [(h, f), (f, h)]
    return [(h, q + 2 * kv), (q, h)] + mlp


def fp8_linears(job: Job) -> bool:
    """Whether the blocks' linears run in FP8: precision fp8 on an engine with FP8 matmuls
    (the bundled runtime's FP8 is its all-gather only: ``cost/fp8.py: GATHER_ONLY``)."""
    from amsp_planner.cost.fp8 import GATHER_ONLY

    return job.training.precision == "fp8" and job.engine not in GATHER_ONLY
