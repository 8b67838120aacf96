"""The straggler and per-rank sync terms (cost/straggler.py) of every candidate the
enumeration prices (solver/candidates.py), so that a search on a cluster with ``rank_jitter``
or ``collective_rank_us`` set ranks the strategies by the step time it shows.

    straggler = cv x e(N) x (compute + kernels),   sync = u x sum over calls of the group's ranks

The first is the step's compute-stream time, which the enumeration already has per candidate
(its pipeline stages' compute arguments, less the TP collectives and the token all-to-alls,
``Candidates.tpc``). The second needs, per configuration, the data-parallel calls times their
group sizes: read off the cost model's schedule with probe strategies (``rank_calls``), as the
time tables are (solver/tables.py), at one micro-batch:

- per micro-batch: the forward P gather (plain, qwZ), the backward gather (P's, qwZ's, or
  hpZ's group), the gradient reduction (G's, qgZ's two hops, or the engine's ZeRO-2 one at
  s_P = 1), and a mixture of experts' EP_P gathers and EP_G reduction;
- per step: OS_shard (G, OS pair), OS_replica (OS), the update's gather and the FP8 amax
  all-reduce (P, OS pair), the experts' three, and the world's grad-norm all-reduce.

A call's count does not grow with re-gathers of checkpointed blocks (their bytes and seconds
do: cost/schedule.py ``_entry``), so the rank-calls depend on the configuration and the number
of micro-batches only. The ILP does not carry these terms; with either set, ``solve`` searches
by this enumeration (solver/solve.py).
"""

from __future__ import annotations

import functools

import numpy as np

from amsp_planner.cost.schedule import build_schedule
from amsp_planner.cost.straggler import CRITICAL_PATH_GROUPS, expected_max_normal
from amsp_planner.strategy import Strategy
from amsp_planner.strategy_experts import nested_triples


def priced(job) -> bool:
    """Whether the job's cluster prices either term (both default to 0)."""
    c = job.cluster
    return c.rank_jitter > 0 or c.collective_rank_us > 0


def _calls(job, s: Strategy, per_micro_batch: bool = True) -> dict[tuple[str, str], float]:
    """(phase, group) -> calls x group size of the probe's data-parallel entries, at one
    micro-batch (the per-step ones only without `per_micro_batch`)."""
    return {(e.phase, e.group): float(e.calls_per_step * e.group_size)
            for e in build_schedule(job, s, n_micro=1, tensor_parallel=False,
                                    per_micro_batch=per_micro_batch)
            if e.group not in CRITICAL_PATH_GROUPS and e.group_size > 1}


def rank_calls(job, sp) -> dict[str, dict]:
    """Rank-calls per decision of space `sp` (module docstring), by table name."""
    probe = functools.partial(Strategy, tp=sp.tp, fp8ag=sp.fp8ag)
    F = sp.factors
    t = {name: {} for name in ("fwd", "fwdq", "bwd", "bwdq", "hpz", "red", "red2", "qgz",
                               "ar", "osrs", "upd")}
    for f in F:
        e = _calls(job, probe(s_p=f, s_g=f, s_os=f))
        t["fwd"][f], t["bwd"][f] = e.get(("forward", "P"), 0.0), e.get(("backward", "P"), 0.0)
        t["red"][f] = e.get(("backward", "G"), 0.0)
        t["ar"][f] = e.get(("grad_sync", "OS_replica"), 0.0)
        t["red2"][f] = _calls(job, probe(s_p=1, s_g=f, s_os=f)).get(("backward", "G"), 0.0)
        if f > 1 and True in sp.qwz:
            e = _calls(job, probe(s_p=f, s_g=f, s_os=f, qwz=True))
            t["fwdq"][f], t["bwdq"][f] = e[("forward", "P")], e.get(("backward", "P"), 0.0)
        if f > 1 and True in sp.qgz:
            e = _calls(job, probe(s_p=f, s_g=f, s_os=f, qgz=True))
            t["qgz"][f] = e.get(("backward", "G_intra"), 0.0) + e.get(("backward", "G_inter"), 0.0)
    n = job.num_gpus // sp.tp
    for z in sp.hpz:
        if z > 1:
            t["hpz"][z] = _calls(job, probe(s_p=n, s_g=n, s_os=n, hpz=z))[("backward", "hpZ")]
    for p in F:
        for o in F:
            if o % p == 0:
                e = _calls(job, probe(s_p=p, s_g=p, s_os=o), per_micro_batch=False)
                t["osrs"][p, o] = e.get(("grad_sync", "OS_shard"), 0.0)
                t["upd"][p, o] = e.get(("update", "P_update"), 0.0) + e.get(("update", "P"), 0.0)
    t["world"] = float(job.num_gpus) if job.num_gpus > 1 else 0.0
    if sp.expert_factors:
        t["experts"] = _expert_calls(job, sp)
    return t


def _expert_calls(job, sp) -> dict[str, dict]:
    """The expert class's rank-calls per expert triple (EP_ groups)."""
    out: dict = {"mb": {}, "step": {}}
    for p, g, o in nested_triples(sp.expert_factors):
        s = Strategy(ep=sp.ep, ep_span=sp.ep_span, ep_p=p, ep_g=g, ep_os=o)
        e = _calls(job, s)
        out["mb"][p, g, o] = sum(v for (ph, gr), v in e.items() if gr.startswith("EP_")
                                 and ph in ("forward", "backward"))
        out["step"][p, g, o] = sum(v for (ph, gr), v in e.items() if gr.startswith("EP_")
                                   and ph not in ("forward", "backward"))
    return out


def config_rank_calls(cf, t: dict) -> tuple[np.ndarray, np.ndarray]:
    """(per micro-batch, per step) rank-calls of each configuration of `cf` (a
    ``candidates.Configs``, expanded by the expert triples where it has them)."""
    def look(d, *keys):
        return np.array([d.get(k if len(k) > 1 else k[0], 0.0)
                         for k in zip(*(map(int, a) for a in keys), strict=True)])

    p, g, o, h, q, qg = cf.p, cf.g, cf.o, cf.h, cf.q, cf.qg
    fwd = np.where(q, look(t["fwdq"], p), look(t["fwd"], p))
    bwd = np.where(h > 1, look(t["hpz"], h), np.where(q, look(t["bwdq"], p), look(t["bwd"], p)))
    red = np.where(qg, look(t["qgz"], g), np.where(p == 1, look(t["red2"], g),
                                                   look(t["red"], g)))
    per_mb = fwd + bwd + red
    per_step = look(t["osrs"], g, o) + look(t["ar"], o) + look(t["upd"], p, o) + t["world"]
    if cf.ex is not None:
        ex = t["experts"]
        per_mb = per_mb + look(ex["mb"], cf.ex.p, cf.ex.g, cf.ex.o)
        per_step = per_step + look(ex["step"], cf.ex.p, cf.ex.g, cf.ex.o)
    return per_mb, per_step


def extra_units(job, T, cf, cand, busy: np.ndarray) -> np.ndarray:
    """Both terms of every candidate, in model time units: `busy` is its compute and kernels
    (model time units)."""
    c = job.cluster
    out = c.rank_jitter * expected_max_normal(job.num_gpus) * busy
    if c.collective_rank_us > 0:
        if cf.rank_calls is None:
            cf.rank_calls = config_rank_calls(cf, rank_calls(job, cf.space))
        per_mb, per_step = cf.rank_calls
        calls = cand.n * per_mb[cand.c] + per_step[cand.c]
        out = out + c.collective_rank_us * 1e-6 * calls / T.time_unit
    return out
