"""Where a strategy puts a mixture-of-experts model's routed experts (docs/moe.md).

Expert parallelism of degree e (``ep=E``) splits the N data-parallel ranks (rank = node*R +
local) into N/e expert-parallel (EP) groups of e ranks; each rank of an EP group holds E/e of
the routed experts of every MoE layer, and the tokens go to their experts by all-to-all inside
the EP group. The ranks that hold the same experts (one per EP group, N/e of them) form the
expert-data-parallel (EDP) group, over which the expert class is sharded by its own triple
(``ep.p``, ``ep.g``, ``ep.os``) as the dense class is over all N ranks.

Placement (``ep.span``):

============  ==========================  ==========================  ========================
placement     EP group (size, stride)     EDP group (size, stride)    an expert factor s
============  ==========================  ==========================  ========================
in the node   e consecutive ranks (e, 1)  (N/e, e)                    s consecutive EDP ranks:
(default)     (inside a node when e<=R)                               (s, e)
span          (e, N/e): strided across    (N/e, 1): consecutive       (s, 1)
              the nodes
============  ==========================  ==========================  ========================

Rules: e divides N; in the node, e divides R or is a multiple of R; spanning, N/e divides R or
is a multiple of R, and 1 < e < N (at e = 1 or e = N both placements are one group). The EDP
group has q = min(N/e, max(1, R/stride)) ranks on each node it touches; an expert factor
divides N/e and divides q or is a multiple of q (intra-node first over the EDP ranks), and
ep.p | ep.g | ep.os, as the dense triple's rules.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    """The EP and EDP groups of N ranks, R per node, at degree e and a placement."""

    ep_size: int
    ep_stride: int
    edp_size: int
    edp_stride: int
    edp_per_node: int
    """EDP ranks on each node the EDP group touches (q)."""

    def factor_group(self, s: int) -> tuple[int, int]:
        """(size, stride) of the shard group of expert factor s: s consecutive EDP ranks."""
        return s, self.edp_stride

    def mesh(self, s: int) -> tuple[int, int]:
        """(EDP ranks per node, nodes) of expert factor s's shard group."""
        q = self.edp_per_node
        return min(s, q), max(1, s // q)


def expert_layout(ep: int, span: bool, num_ranks: int, ranks_per_node: int) -> ExpertLayout:
    """The groups (module docstring); the degree and placement are checked by ``check_ep``."""
    n, r = num_ranks, ranks_per_node
    if span:
        ep_stride, edp_stride = n // ep, 1
    else:
        ep_stride, edp_stride = 1, ep
    edp = n // ep
    q = min(edp, max(1, r // edp_stride)) if edp_stride < r else 1
    return ExpertLayout(ep, ep_stride, edp, edp_stride, q)


def check_ep(ep: int, span: bool, factors: dict[str, int], num_ranks: int,
             ranks_per_node: int) -> None:
    """Raise ValueError unless the degree, placement and expert factors follow the rules."""
    n, r = num_ranks, ranks_per_node
    if n % ep:
        raise ValueError(f"ep={ep} does not divide the {n} GPUs: use a divisor of {n}")
    if not span and ep > 1 and r % ep and ep % r:
        raise ValueError(f"ep={ep} neither divides nor is a multiple of the {r} GPUs per node: "
                         "use a divisor of the node size or whole nodes, or ep.span")
    if span:
        if not 1 < ep < n:
            raise ValueError(f"ep.span needs 1 < ep < {n} GPUs (at ep={ep} both placements are "
                             "one group): drop ep.span")
        if r % (n // ep) and (n // ep) % r:
            raise ValueError(f"ep.span with ep={ep} strides the EP group by {n // ep} ranks, "
                             f"which neither divides nor is a multiple of the {r} GPUs per "
                             "node: use another ep or drop ep.span")
    lay = expert_layout(ep, span, n, r)
    edp, q = lay.edp_size, lay.edp_per_node
    for c, s in factors.items():
        if edp % s:
            raise ValueError(f"ep.{c}={s} does not divide the {edp} ranks that hold the same "
                             f"experts (N/ep = {n}/{ep}): use a divisor of {edp}")
        if q % s and s % q:
            raise ValueError(f"ep.{c}={s} neither divides nor is a multiple of the {q} ranks "
                             "holding the same experts per node (intra-node first): use a "
                             f"divisor or a multiple of {q}")
    if factors["g"] % factors["p"] or factors["os"] % factors["g"]:
        raise ValueError(f"expert factors must nest, ep.p | ep.g | ep.os: got ep.p="
                         f"{factors['p']}, ep.g={factors['g']}, ep.os={factors['os']}; make "
                         "each divide the next")


def expert_factor_options(ep: int, span: bool, num_ranks: int, ranks_per_node: int) -> list[int]:
    """Expert shard factors the rules allow at this degree and placement."""
    lay = expert_layout(ep, span, num_ranks, ranks_per_node)
    edp, q = lay.edp_size, lay.edp_per_node
    return [s for s in range(1, edp + 1) if edp % s == 0 and (q % s == 0 or s % q == 0)]


def ep_options(num_experts: int, num_ranks: int, ranks_per_node: int) -> list[tuple[int, bool]]:
    """(e, span) pairs a job admits: e divides E and N, both placements where they differ
    and the rules allow them (``check_ep``)."""
    out = []
    for e in range(1, min(num_experts, num_ranks) + 1):
        if num_experts % e or num_ranks % e:
            continue
        for span in (False, True):
            try:
                check_ep(e, span, {"p": 1, "g": 1, "os": 1}, num_ranks, ranks_per_node)
            except ValueError:
                continue
            out.append((e, span))
    return out


def nested_triples(factors) -> list[tuple[int, int, int]]:
    """Every (p, g, os) of `factors` with p | g | os: the expert triples a space searches."""
    return [t for t in itertools.product(factors, factors, factors)
            if t[1] % t[0] == 0 == t[2] % t[1]]
