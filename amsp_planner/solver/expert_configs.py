"""The enumeration's configurations of a mixture of experts' space (docs/moe.md): every dense
configuration of ``candidates.Configs`` times every nested expert triple (ep.p | ep.g | ep.os
over ``SearchSpace.expert_factors``; the engine's pairs only, ``SearchSpace.expert_pairs``),
each array the dense row's plus the expert triple's
terms, priced with the expert tables as solver/expert_rows.py prices them in the ILP.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from amsp_planner.cost.schedule import CLASSES
from amsp_planner.strategy_experts import expert_layout, nested_triples

NCLS = len(CLASSES)
ADDED = ("gf", "gb", "kf", "kb", "red", "kr", "sync", "cu", "topt", "states")
"""The configuration arrays the expert class adds to."""
KEPT = ("p", "g", "o", "h", "q", "qg", "a2a", "dm")
"""The dense arrays only repeated (``dm``, the gathers fetched on demand: the expert class's
are whole units, prefetched, none on demand)."""


@dataclass
class ExpertPart:
    """The expert triple of each (expanded) configuration and its group kinds."""

    ep: int
    span: bool
    p: np.ndarray
    g: np.ndarray
    o: np.ndarray
    kinds: list

    def fields(self, c: int) -> dict:
        return dict(ep=self.ep, ep_span=self.span, ep_p=int(self.p[c]), ep_g=int(self.g[c]),
                    ep_os=int(self.o[c]))


def with_experts(cf, job, space, T) -> None:
    """Expand the dense configurations `cf` (a ``candidates.Configs``) by the expert triples."""
    E = T.experts
    F = space.expert_factors
    tri = np.array(nested_triples(F), dtype=np.int64)
    p, g, o = tri[:, 0], tri[:, 1], tri[:, 2]

    def per(d, key):
        return np.array([d[k] for k in key])

    ag = per(E["e_ag"], p)
    ka = per(E["e_ka"], p)
    rs = per(E["e_rs"], g)
    krs = per(E["e_krs"], g)
    sync = (np.array([E["e_osrs"][int(a), int(b)] for a, b in zip(g, o, strict=True)])
            + per(E["e_ar"], o))
    cu = np.array([E["e_upd"][int(a), int(b)] for a, b in zip(p, o, strict=True)])
    topt = per(E["e_opt"], o)
    staging = np.where((1 < p) & (p < g), E["e_perm"], 0.0)
    step = np.array([E["e_step_buf"][int(a), int(b)] for a, b in zip(g, o, strict=True)])
    states = (per(E["e_mem_p"], p) + per(E["e_buf_ag"], p) + per(E["e_mem_g"], g)
              + per(E["e_buf_gr"], g) + per(E["e_mem_o"], o) + staging + step)
    add = {"gf": ag, "gb": ag, "kf": ka, "kb": ka, "red": rs, "kr": krs,
           "sync": sync, "cu": cu, "topt": topt, "states": states}
    n_dense = len(cf.p)
    di, xi = (a.ravel() for a in np.meshgrid(np.arange(n_dense), np.arange(len(tri)),
                                             indexing="ij"))
    if space.expert_pairs is not None:  # the engine's (dense, expert) pairs only
        allowed = set(space.expert_pairs)
        keep = np.array([((int(cf.p[d]), int(cf.g[d]), int(cf.o[d])), tuple(map(int, tri[x])))
                         in allowed for d, x in zip(di, xi, strict=True)], dtype=bool)
        di, xi = di[keep], xi[keep]
    for name in ADDED:
        setattr(cf, name, getattr(cf, name)[di] + add[name][xi])
    for name in KEPT:
        setattr(cf, name, getattr(cf, name)[di])
    lay = expert_layout(space.ep, space.ep_span, job.num_gpus, job.gpus_per_node)
    d, n = lay.edp_stride, lay.edp_size
    ep_, eg, eo = p[xi], g[xi], o[xi]
    one = np.ones_like(ep_)
    kinds = [(ep_, d * one), (eg, d * one), (eo // eg, eg * d), (n // eo, eo * d),
             (eo // ep_, ep_ * d), (np.full_like(ep_, lay.ep_size), lay.ep_stride * one)]
    cf.ex = ExpertPart(space.ep, space.ep_span, ep_, eg, eo, kinds)
