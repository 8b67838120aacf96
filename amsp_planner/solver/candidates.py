"""The enumeration's candidates as arrays, priced with the ILP's coefficient tables
(solver/tables.py) and stage terms (``cost/step_time.stages``, evaluated on arrays with
``np.maximum`` for max()): ``Configs`` (every configuration of the space), ``Candidates``
(the fitting configuration x activation-option pairs) and ``objective_of`` (their step time,
or collective time). The search over them is solver/exhaustive.py's.

A candidate is a *configuration* c (s_P, s_G, s_OS, qwZ, hpZ, qgZ: every collective and the
model-state memory) with an *activation option* j (micro-batch, checkpointing: compute, the
TP collectives and activation memory), at one tensor-parallel degree. Memory is the sum of
the two parts, so the fitting pairs are found before any step time is computed.

One reduction that cannot change the choice (``prunes_blocks``): for a configuration and
micro-batch, checkpointing more of the first K blocks costs no less time (compute grows with K,
and a stage's time never falls when its compute grows), strictly more recompute, and the same
process groups. So when the rule breaks ties by recompute before memory (the planner's
default), a larger K than the smallest that fits is never chosen, nor is it ever faster: only
that K is priced. Under rules that prefer memory first (or have no recompute tie-break) every K
is priced.
"""

from __future__ import annotations

import itertools

import numpy as np

from amsp_planner.cost.job import Job
from amsp_planner.cost.schedule import CLASSES
from amsp_planner.cost.step_time import stage_time, stages
from amsp_planner.solver.rank_terms import extra_units, priced
from amsp_planner.solver.space import MEMORY, RECOMPUTE, STEP, Preference, SearchSpace
from amsp_planner.solver.tables import Tables
from amsp_planner.strategy import Strategy, ckpt_fields

NCLS = len(CLASSES)


def _by_factor(d: dict, idx: dict, width: int = NCLS) -> np.ndarray:
    """A table keyed by factor as an array (factor index, class); zero where it has no entry."""
    out = np.zeros((len(idx), width))
    for f, v in d.items():
        out[idx[f]] = v
    return out


def _scalar(d: dict, idx: dict) -> np.ndarray:
    """A table of one number per factor as an array (factor index)."""
    return _by_factor(d, idx, 1)[:, 0]


class Configs:
    """Every valid configuration (s_P, s_G, s_OS, qwZ, hpZ, qgZ) of the space, as arrays: the
    per-unit communication and kernel seconds per class (model time units, as the ILP's
    tables), the once-per-step terms, the model-state GiB and the process groups."""

    def __init__(self, job: Job, space: SearchSpace, T: Tables):
        self.tp, self.fp8ag, self.space = space.tp, space.fp8ag, space
        self.rank_calls = None
        """(per micro-batch, per step) rank-calls per configuration, made on first use
        (solver/rank_terms.py)."""
        F = space.factors
        triples = space.triples
        if triples is None:
            triples = [(p, g, o) for p, g, o in itertools.product(F, F, F)
                       if g % p == 0 and o % g == 0]
        rows = []
        for p, g, o in triples:
            for q, h, qg in itertools.product(space.qwz, space.hpz, space.qgz):
                if q and p == 1 or qg and g == 1 or qg and space.qgz_needs_p and p == 1:
                    continue
                if p == 1 and space.fp8ag and not space.fp8_alone:  # the bf16 space's
                    continue
                if h > 1 and (p <= h or p % h):
                    continue
                rows.append((p, g, o, q, h, qg))
        a = np.array(rows, dtype=np.int64).reshape(-1, 6)
        self.p, self.g, self.o, self.h = a[:, 0], a[:, 1], a[:, 2], a[:, 4]
        self.q, self.qg = a[:, 3].astype(bool), a[:, 5].astype(bool)
        fi = {f: i for i, f in enumerate(F)}
        pi = np.searchsorted(np.array(F), self.p)
        gi = np.searchsorted(np.array(F), self.g)
        oi = np.searchsorted(np.array(F), self.o)
        zs = sorted(T.hpz)
        zi_map = {z: i + 1 for i, z in enumerate(zs)}  # 0: no hpZ
        zi = np.array([zi_map.get(int(z), 0) for z in self.h], dtype=np.int64)

        def hp(d, width=NCLS):  # hpZ tables with a zero row for "off"
            out = np.zeros((len(zs) + 1, width))
            for z, v in d.items():
                out[zi_map[z]] = v
            return out

        q, qg = self.q[:, None], self.qg[:, None]
        on_h = (zi > 0)[:, None]
        self.gf = np.where(q, _by_factor(T.agq, fi)[pi], _by_factor(T.ag, fi)[pi])
        self.kf = np.where(q, _by_factor(T.kq, fi)[pi], _by_factor(T.ka, fi)[pi])
        self.gb = np.where(on_h, hp(T.hpz)[zi], self.gf)
        self.kb = np.where(on_h, hp(T.khz)[zi], self.kf)
        df = np.where(q, _by_factor(T.dmq, fi)[pi], _by_factor(T.dm, fi)[pi])
        self.dmb = np.where(on_h, hp(T.dmh)[zi], df)
        self.dm = df + self.dmb
        """Gathers fetched on demand per unit call, forward + backward (the 'comm' objective)."""
        self.red = np.where(qg, _by_factor(T.qgz, fi)[gi], _by_factor(T.rs, fi)[gi])
        self.kr = np.where(qg, _by_factor(T.kg, fi)[gi], _by_factor(T.krs, fi)[gi])
        if T.rs2:  # ZeRO-2 (s_P = 1, G not quantized): the engine's own reduction (tables.py)
            z2 = ((self.p == 1) & ~self.qg)[:, None]
            self.red = np.where(z2, _by_factor({**T.rs, **T.rs2}, fi)[gi], self.red)
            self.kr = np.where(z2, _by_factor({**T.krs, **T.krs2}, fi)[gi], self.kr)
        pairs = {k: i for i, k in enumerate(T.osrs)}
        go = np.array([pairs[int(g), int(o)] for g, o in zip(self.g, self.o, strict=True)],
                      dtype=np.int64)
        osrs = np.array([T.osrs[k] for k in pairs]).reshape(-1, NCLS)
        self.sync = osrs[go] + _by_factor(T.ar, fi)[oi]
        upd_idx = {k: i for i, k in enumerate(T.upd)}
        upd = np.array(list(T.upd.values()))
        po = np.array([upd_idx[int(p), int(o)] for p, o in zip(self.p, self.o, strict=True)],
                      dtype=np.int64)
        self.cu = upd[po] + T.metrics
        self.topt = _scalar(T.opt, fi)[oi]
        staging = np.where((1 < self.p) & (self.p < self.g) | self.qg, T.perm, 0.0)
        step_buf = np.array([T.step_buf[k] for k in pairs])[go]
        self.states = (_scalar(T.mem_p, fi)[pi] + _scalar(T.mem_g, fi)[gi]
                       + _scalar(T.mem_o, fi)[oi] + hp(T.mem_h, 1)[zi, 0]
                       + np.where(self.q, _scalar(T.buf_agq, fi)[pi], _scalar(T.buf_ag, fi)[pi])
                       + np.where(self.qg, _scalar(T.buf_grq, fi)[gi], _scalar(T.buf_gr, fi)[gi])
                       + staging + step_buf + T.fixed)
        a2a = _scalar(T.a2a or {}, fi)[gi]
        self.a2a = np.where(self.qg, a2a, 0.0)
        self.ex = None
        if space.expert_factors:  # a mixture of experts: x the expert triples
            from amsp_planner.solver.expert_configs import with_experts

            with_experts(self, job, space, T)
        self.groups = self._groups(job)
        extra = (T.experts or {}).get("ep_comm", 0.0)
        self.comms = (T.comm * self.groups + self.a2a + extra) if T.comm else (
            np.zeros(len(self.p)))

    def __len__(self) -> int:
        return len(self.p)

    def _groups(self, job: Job) -> np.ndarray:
        """Distinct (size, stride) of the group kinds each configuration's collectives use,
        the world and the TP group included (cost/communicators.py: one communicator each).
        The data-parallel kinds are over the N/t ranks, R/t per node, strided by t."""
        t, world = self.tp, job.num_gpus
        n, r = world // t, max(1, job.gpus_per_node // t)
        p, g, o, h, qg = self.p, self.g, self.o, self.h, self.qg
        one = np.ones_like(p)
        kinds = [(p, t * one), (h, t * one), (np.where(qg, 1, g), t * one),
                 (np.where(qg, np.minimum(g, r), 1), t * one),
                 (np.where(qg, np.maximum(1, g // r), 1), np.full_like(p, r * t)),
                 (o // g, g * t), (n // o, o * t), (o // p, p * t),
                 (np.full_like(p, world), one), (np.full_like(p, t), one)]
        if self.ex is not None:
            kinds += self.ex.kinds
        keys = np.stack([np.where(size > 1, size * (world + 1) + stride, -1)
                         for size, stride in kinds], axis=1)
        keys.sort(axis=1)
        distinct = (keys[:, 1:] != keys[:, :-1]) & (keys[:, 1:] >= 0)
        return distinct.sum(axis=1) + (keys[:, 0] >= 0)

    def strategy(self, c: int, mb: int, ck, num_layers: int) -> Strategy:
        ex = self.ex.fields(c) if self.ex is not None else {}
        return Strategy(s_p=int(self.p[c]), s_g=int(self.g[c]), s_os=int(self.o[c]),
                        qwz=bool(self.q[c]), hpz=int(self.h[c]), qgz=bool(self.qg[c]),
                        fp8ag=bool(self.fp8ag and self.p[c] > 1), tp=self.tp, micro_batch=mb, **ckpt_fields(ck, num_layers), **ex)


def prunes_blocks(pref: Preference, T: Tables) -> bool:
    """Whether only the smallest fitting K of a block range can be chosen (module docstring)."""
    tb = pref.tie_breaks
    if RECOMPUTE not in tb or any(c in tb and tb.index(c) < tb.index(RECOMPUTE)
                                  for c in (MEMORY, STEP)):
        return False
    return all(T.drec[j] > 0 and min(T.dbwd[j]) >= 0 and T.dact[j] <= 0
               and (T.dtpc or {}).get(j, 0.0) >= 0 for j in T.krange)


class Candidates:
    """The fitting candidates, flat: configuration index, option, K, and per candidate its
    compute per class, activation GiB, recompute, micro-batches and memory."""

    def __init__(self, job: Job, T: Tables, cf: Configs, usable_gib: float, prune: bool):
        gpu = job.cluster.gpu
        frag = 1 + gpu.fragmentation_fraction
        base = cf.states * frag + cf.comms + gpu.context_reserve_gib  # (C,)
        parts = []
        self.options = list(T.fwd)
        tpc, dtpc = T.tpc or {}, T.dtpc or {}
        for oj, j in enumerate(self.options):
            fwd, bwd, act, rec = (np.array(T.fwd[j]), np.array(T.bwd[j]), T.act[j], T.rec[j])
            tp_s = tpc.get(j, 0.0)
            if j in T.krange:
                lo, hi = T.krange[j]
                dbwd, dact, drec = np.array(T.dbwd[j]), T.dact[j], T.drec[j]
                if prune:  # the smallest k = K - lo that fits, per configuration
                    need = (base + act * frag - usable_gib) / (-dact * frag) if dact < 0 else (
                        np.where(base + act * frag <= usable_gib, 0.0, np.inf))
                    k = np.clip(np.ceil(np.nan_to_num(need, posinf=hi - lo + 1)), 0, hi - lo + 1)
                    k = k.astype(np.int64)
                    for _ in range(2):  # round-off at the edge: step to the true smallest k
                        lower = np.maximum(k - 1, 0)
                        k = np.where((k > 0) & (base + (act + lower * dact) * frag <= usable_gib),
                                     lower, k)
                        k = np.where((k <= hi - lo) & (base + (act + k * dact) * frag > usable_gib),
                                     k + 1, k)
                    cs = np.nonzero(k <= hi - lo)[0]
                    ks = k[cs]
                else:
                    cs, ks = (a.ravel() for a in np.meshgrid(np.arange(len(cf)),
                                                             np.arange(hi - lo + 1), indexing="ij"))
                parts.append((cs, np.full(len(cs), oj), ks + lo, fwd, bwd[None] + ks[:, None] * dbwd,
                              act + ks * dact, rec + ks * drec, tp_s + ks * dtpc.get(j, 0.0)))
            else:
                cs = np.arange(len(cf))
                parts.append((cs, np.full(len(cs), oj), np.zeros(len(cs), np.int64), fwd,
                              np.broadcast_to(bwd, (len(cs), NCLS)), np.full(len(cs), act),
                              np.full(len(cs), rec), np.full(len(cs), tp_s)))
        c = np.concatenate([x[0] for x in parts])
        mem = base[c] + np.concatenate([x[5] for x in parts]) * frag
        # a candidate at the limit exactly fits (evaluate's byte count): allow the round-off of
        # these GiB sums, which add the terms in another order
        ok = mem <= usable_gib * (1 + 1e-12)
        self.c = c[ok]
        self.option = np.concatenate([x[1] for x in parts])[ok]
        self.blocks = np.concatenate([x[2] for x in parts])[ok]
        self.fwd = np.concatenate([np.broadcast_to(x[3], (len(x[0]), NCLS)) for x in parts])[ok]
        self.bwd = np.concatenate([x[4] for x in parts])[ok]
        self.rec = np.concatenate([x[6] for x in parts])[ok]
        self.tpc = np.concatenate([x[7] for x in parts])[ok]
        """TP collective time per step (model time units): in fwd/bwd for the step time, added
        on its own to the 'comm' objective."""
        self.mem = mem[ok]
        n_of = np.array([T.n[j] for j in self.options])
        self.n = n_of[self.option]
        self.total = len(c)

    def __len__(self) -> int:
        return len(self.c)


def objective_of(job: Job, T: Tables, cf: Configs, cand: Candidates, objective: str) -> np.ndarray:
    """Step time (or all collective time) of every candidate, in model time units: the ILP's
    expressions (solver/step_rows.py ``_add_time``) on arrays."""
    c = cand.c
    ci = {cls: i for i, cls in enumerate(CLASSES)}
    gb, kb, dm = cf.gb[c], cf.kb[c], cf.dm[c]
    if T.regather and T.kblocks:  # re-gathers of checkpointed blocks (step_rows._regather)
        ranged = np.array([j in T.krange for j in cand.options])
        lo = np.array([T.kblocks[j] for j in cand.options])
        kk = np.where(ranged[cand.option], cand.blocks, lo[cand.option])
        extra = np.zeros((len(c), len(CLASSES)))
        extra[:, ci["block"]] = T.regather * kk / job.model.num_layers
        gb, kb, dm = gb * (1 + extra), kb * (1 + extra), dm + cf.dmb[c] * extra
    comm = {"gather_fwd": cf.gf[c], "gather_bwd": gb, "reduce": cf.red[c],
            "sync": cf.sync[c]}
    fwd = cand.fwd + cf.kf[c]
    bwd = cand.bwd + kb + cf.kr[c]
    counts = {"embedding": 1, "block": job.model.num_layers, "head": 1}
    if objective == "comm":
        per_mb = sum(counts[k] * (comm["gather_fwd"][:, i] + comm["gather_bwd"][:, i]
                                  + comm["reduce"][:, i] + dm[:, i]) for k, i in ci.items())
        return (cand.n * per_mb + sum(counts[k] * comm["sync"][:, i] for k, i in ci.items())
                + cf.cu[c] + cand.tpc)

    def q(role, cls):
        i = ci[cls]
        if role == "fwd":
            return fwd[:, i]
        if role == "bwd":
            return bwd[:, i]
        return comm[role][:, i]

    sig = job.cluster.gpu.comm_compute_slowdown
    eta = job.cluster.overlap_efficiency
    sts, ends = stages(job.model.num_layers, q, 0.0)
    phase = {p: ends[p] + sum(st.count * stage_time(st.compute, st.comm, sig, eta, np.maximum)
                              for st in sts if st.phase == p)
             for p in ("forward", "backward", "last")}
    step = (cand.n * phase["forward"] + (cand.n - 1) * phase["backward"] + phase["last"]
            + cf.topt[c] + cf.cu[c])
    if not priced(job):
        return step
    part = {p: sum(st.count * st.compute for st in sts if st.phase == p)
            for p in ("forward", "backward", "last")}
    busy = (cand.n * part["forward"] + (cand.n - 1) * part["backward"] + part["last"]
            - cand.tpc)  # the step's compute and kernels (cost/step_time.py: compute_s + kernel_s)
    return step + extra_units(job, T, cf, cand, busy)

