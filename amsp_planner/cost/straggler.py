"""Waiting for the slowest rank: the expected maximum of N ranks' step-time jitter.

Data-parallel training is lock-step: every rank joins the gradient reduction and the global
gradient-norm all-reduce of each step, so a step ends when its slowest rank does ("the
slowest rank sets the pace"; MegaScale, arXiv 2402.15627, sections 4-5: at more than 10,000
GPUs stragglers are a first-order cost, and a job's step time is set by its slowest host).
With each rank's busy time per step ``T (1 + cv Z_i)``, Z_i independent standard normals, the
step lasts ``T (1 + cv E[max_i Z_i])``; the term priced here is the excess,

    straggler_s = cv x T x e(N),    e(N) = E[max of N independent standard normals]

e(1) = 0 (one rank waits for nobody), e(2) = 1/sqrt(pi) = 0.5642, e(3) = 3 / (2 sqrt(pi)) =
0.8463; e(10) = 1.5388, e(100) = 2.5076, e(1000) = 3.2414 (H. L. Harter, "Expected values of
normal order statistics", Biometrika 48, 1961, table 1). e grows as sqrt(2 ln N): from 128
to 512 ranks by 0.45, so a rank's cv of 2 % costs 0.9 % of the step more.

cv is the cluster's ``rank_jitter`` (default 0: not priced). Only the rank's compute (``T`` =
``StepTime.compute_s + kernel_s``) is taken as jittering; communication is NCCL's model's, and
what the network does at scale stays in ``collectives.scale_factor``. One sync per step is
priced (jitter independent from step to step, its segments between the step's collectives
correlated): the blocking collectives inside a step add no separate term.

The second reading, ``sync_s`` (cluster ``collective_rank_us``, default 0: not priced): each
data-parallel collective call costs ``u`` microseconds per rank of its group that no compute
hides, ``sync_s = u x sum over calls of the group's ranks``: linear in N as a ring's steps are
(NCCL's ring pays 2(N-1) or N-1 per-hop latencies per call, ``src/graph/tuning.cc``: 0.6-3.4
us a hop in a node, 2.7-14 us across nodes), where the jitter above grows as sqrt(2 ln N).
Tensor-, expert-, context-parallel and pipeline calls (groups TP, EP, CP, PP) are not counted:
they are on the compute stream's critical path already, priced whole.

``bench/fit_rank_jitter.py`` fits cv and u to the published runs of one job at several scales
(docs/cost-model.md, "Collectives at scale": the fits, and why both defaults stay 0).
"""

from __future__ import annotations

import math
from functools import cache

_SQRT2 = math.sqrt(2.0)


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / _SQRT2)


@cache
def expected_max_normal(n: int) -> float:
    """E[max of `n` independent standard normals]: the integral of x n phi(x) Phi(x)^(n-1) over
    [-10, 10] by Simpson's rule (4,000 intervals; within 1e-6 of Harter's 1961 table)."""
    if n < 1:
        raise ValueError(f"expected_max_normal needs n >= 1 ranks, got {n}")
    if n == 1:
        return 0.0
    lo, hi, k = -10.0, 10.0, 4000
    h = (hi - lo) / k

    def f(x: float) -> float:
        return x * n * _phi(x) * _cdf(x) ** (n - 1)

    s = f(lo) + f(hi) + sum((4 if i % 2 else 2) * f(lo + i * h) for i in range(1, k))
    return s * h / 3.0


def straggler_seconds(busy_s: float, ranks: int, jitter: float) -> float:
    """The seconds a step waits for its slowest rank: ``jitter x busy_s x e(ranks)`` (module
    docstring); 0 with no jitter or one rank."""
    if jitter <= 0.0 or ranks <= 1:
        return 0.0
    return jitter * busy_s * expected_max_normal(ranks)


CRITICAL_PATH_GROUPS = ("TP", "EP", "CP", "PP")
"""Groups whose calls are priced whole on the critical path (not counted by ``sync_seconds``)."""


def sync_seconds(schedule, us_per_rank: float) -> float:
    """``us_per_rank`` microseconds x the ranks of every data-parallel collective call of the
    step (module docstring); 0 when it is 0. `schedule`: ScheduleEntry items."""
    if us_per_rank <= 0.0:
        return 0.0
    rank_calls = sum(e.calls_per_step * e.group_size for e in schedule
                     if e.group not in CRITICAL_PATH_GROUPS and e.group_size > 1)
    return us_per_rank * 1e-6 * rank_calls
