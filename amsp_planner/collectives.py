"""Collectives as NCCL runs them: its algorithms, protocols, and latency/bandwidth model.

NCCL (``src/graph/tuning.cc`` at commit 5067397c, 2026-06) prices every (algorithm, protocol)
of a collective as ``time = latency + bytes / algorithm bandwidth`` and runs the fastest one;
this module does the same with NCCL's own constants. The bandwidths come from the topology
(``Topology.fabric``: the bus bandwidth one rank of the group sees, which for a group
spanning nodes is its share of the node's NICs); NCCL's graph search finds the same figure as
``nChannels x bw``.

Which algorithms each collective may use (NCCL's list; SHARP ones only when the cluster enables
them):

=============  =================================================================
broadcast      ring (algorithm bandwidth = bus bandwidth: one buffer down the ring)
all_gather     ring; PAT when every member is on its own node; NVLS (NVLink
reduce_scatter SHARP) inside one node
all_reduce     ring, tree; NVLS inside one node, NVLS-tree across nodes (NVLink
               SHARP); CollNet-direct (InfiniBand SHARP)
all_to_all     pairwise point-to-point sends (NCCL has no collective algorithm)
=============  =================================================================

Per algorithm and protocol (LL, LL128, Simple), with m ranks on g nodes, k per node:

- ring: nsteps = 2(m-1) for all-reduce, m-1 for all-gather/reduce-scatter, m for broadcast;
  inter-node steps 2(g-1) / g-1 / g; latency = base + (nsteps - inter) x intraLat + inter x interLat; bus bandwidth
  B for Simple, min(llMax, B/2) for LL, 0.92 B for LL128 (NVLink systems only); algorithm
  bandwidth = bus x m / nsteps. Simple all-reduce across nodes: latency x 1.4 ("plateau").
- tree (all-reduce): latency = base + 2((k-1) intraLat + floor(log2 g) interLat); bus 0.92 B
  (LL: further / 3.8, capped at llMax; LL128: x 7/9 in a node, x 120/128 across); algorithm
  bandwidth = bus / 2, times NCCL's ``treeCorrectionFactor`` by message size.
- PAT: latency = 8 + floor(log2 g) x 14/3.5 + 2.8 m; bandwidth 0.75 B (Simple only).
- NVLS: bus = 0.85 B (Hopper) x 2 for all-reduce, x (k-1)/k for all-gather/reduce-scatter;
  latency 25 us. NVLS-tree: min(NVLS bus, net bus x (2 if g <= 2)), latency 25 + 2 log2(g) x 20.9.
- CollNet-direct: the switch reduces, so each node's NICs carry the buffer once each way; the
  in-node reduce-scatter + all-gather runs on NVLink (a bytes model; latency from NCCL's table).

Simplifications, each toward NCCL's behaviour on large NVSwitch nodes: per-channel bandwidth
caps (``perChMax*``) and the channel count are not modelled (the node's bus bandwidth is
reached), the host CPU is taken as x86 Intel (network post overhead 1 us, x3 for Simple) and
the network plugin adds no latency of its own (``latencyInter`` 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# ----- NCCL's tuning constants (src/graph/tuning.cc @ 5067397c) ------------------------------
PROTOCOLS = ("LL", "LL128", "Simple")

BASE_LATENCY_US = {  # baseLatencies[algo][proto]
    "tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "collnet_direct": (0.0, 0.0, 0.0),
    "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0), "pat": (8.0, 8.0, 8.0),
}
HW_LATENCY_US = {  # hwLatencies[hw][algo][proto]
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0, 0, 3.7),
               "nvls": (0, 0, 25.0), "nvls_tree": (0, 0, 25.0), "pat": (0, 0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0, 0, 3.7),
            "nvls": (0, 0, 0.0), "nvls_tree": (0, 0, 0.0), "pat": (0, 0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0, 0, 31.0),
            "nvls": (0, 0, 18.0), "nvls_tree": (0, 0, 20.9), "pat": (0, 0, 14.0)},
}
LL_MAX_BW_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
"""llMaxBws for one node, GB/s, by GPU generation."""
LL_MAX_BW_NODES = {2: 39.0, 3: 20.4}
"""llMaxBws across nodes (x86 Intel hosts), GB/s: 2 nodes, more than 2."""
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}
NET_OVERHEAD_US = 1.0  # getNetOverhead: x86 Intel
TREE_CORRECTION = {  # treeCorrectionFactor[proto][log2(bytes / 64)]
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9,
              .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8,
               .9, .9, .9),
}
RING_PLATEAU = {"volta": 1.9}  # ring/Simple all-reduce latency factor across nodes; 1.4 from Ampere
ALGORITHMS = {
    "all_gather": ("ring", "pat", "nvls"),
    "reduce_scatter": ("ring", "pat", "nvls"),
    "all_reduce": ("ring", "tree", "nvls", "nvls_tree", "collnet_direct"),
    "broadcast": ("ring",),
}


@dataclass(frozen=True)
class Network:
    """What a network type does to NCCL's collectives beyond NCCL's own model."""

    efficiency: float
    """Bus bandwidth a ring reaches as a fraction of the NICs' line rate (two nodes)."""
    loss_per_doubling: float
    """Fraction of that bandwidth a ring over nodes loses per doubling of its nodes beyond two:
    every step waits for the slowest of its links, and more flows collide in the fabric."""
    source: str


NETWORKS = {
    "infiniband": Network(0.90, 0.03, "fitted to the H100 reduce-scatter bus bandwidths at 4-128 "
                          "nodes of NVIDIA/nccl#1229 (360 down to 260 GB/s on 8x 400 Gb/s) and "
                          "the two-node DGX-A100 all-reduces of NVIDIA/nccl#812, #1048"),
    "roce": Network(0.65, 0.03, "fitted to the 32-node H100 all-gather over RoCE of "
                    "NVIDIA/nccl#1218 (200 GB/s on 8x 400 Gb/s); loss as InfiniBand's"),
    "efa": Network(0.62, 0.03, "fitted to the 3- and 4-node p4d all-reduces of NVIDIA/nccl#527 "
                   "(31.8, 29.6 GB/s on 4x 100 Gb/s EFA); loss as InfiniBand's"),
    "ethernet": Network(0.65, 0.03, "TCP/RoCE without tuning: RoCE's figures"),
}
"""Per network type (``ClusterSpec.network``); every figure fitted to presets/nccl_tests.yaml."""


def scale_factor(network: str, nodes: int) -> float:
    """The share of its two-node bandwidth a ring over `nodes` nodes keeps:
    1 - loss x log2(nodes / 2), at least a half (``Network.loss_per_doubling``)."""
    if nodes <= 2:
        return 1.0
    return max(0.5, 1.0 - NETWORKS[network].loss_per_doubling * math.log2(nodes / 2))


@dataclass(frozen=True)
class Fabric:
    """What NCCL's tuner knows about a rank group: its shape and the hardware under it."""

    ranks: int
    nodes: int
    per_node: int
    bus_bw: float
    """Bus bandwidth of one rank in the group, bytes/s (ring, Simple, large messages)."""
    intra_bw: float
    """In-node bus bandwidth of one rank, bytes/s."""
    net_bw: float
    """Bytes/s one rank's share of the node's NICs carries (0 in one node)."""
    arch: str = "ampere"
    nvlink: bool = True
    """NVLink/NVSwitch inside the node (else PCIe: no LL128, PCIe latencies)."""
    nvlink_sharp: bool = False
    ib_sharp: bool = False


@dataclass(frozen=True)
class Choice:
    algorithm: str
    protocol: str
    seconds: float


def _log2i(x: float) -> int:
    return int(math.floor(math.log2(x))) if x >= 1 else -1


def _proto(p: str) -> int:
    return PROTOCOLS.index(p)


def _ll_max(f: Fabric) -> float:
    if f.nodes == 1:
        return LL_MAX_BW_ONE_NODE.get(f.arch, 87.7) * 1e9
    return LL_MAX_BW_NODES[min(f.nodes, 3)] * 1e9


def _latencies(f: Fabric, algo: str, p: str) -> tuple[float, float]:
    """(intraLat, interLat) in microseconds."""
    i = _proto(p)
    intra = HW_LATENCY_US["nvlink" if f.nvlink else "pci"][algo][i]
    inter = HW_LATENCY_US["net"]["tree" if f.per_node == 1 else algo][i]
    return intra, inter


def _ring(op: str, f: Fabric, p: str, nbytes: float) -> float | None:
    m, g = f.ranks, f.nodes
    nsteps = 2 * (m - 1) if op == "all_reduce" else m if op == "broadcast" else m - 1
    bus = f.bus_bw
    if p == "LL":
        bus = min(_ll_max(f), bus * 0.5)
    elif p == "LL128":
        if not f.nvlink:
            return None
        bus *= 0.92
    intra, inter = _latencies(f, "ring", p)
    if g > 1:
        intra = max(intra, NET_OVERHEAD_US * (3 if p == "Simple" else 1))
    n_inter = 0 if g == 1 else (2 * (g - 1) if op == "all_reduce" else g if op == "broadcast"
                                else g - 1)
    lat = BASE_LATENCY_US["ring"][_proto(p)] + (nsteps - n_inter) * intra + n_inter * inter
    if op == "all_reduce" and p == "Simple" and g > 1:
        lat *= RING_PLATEAU.get(f.arch, 1.4)
    return lat * 1e-6 + nbytes / (bus * m / nsteps)


def _tree(f: Fabric, p: str, nbytes: float) -> float | None:
    bus = f.bus_bw * 0.92
    if p == "LL":
        bus = min(bus / 3.8, _ll_max(f))
    elif p == "LL128":
        if not f.nvlink:
            return None
        bus *= 7.0 / 9.0 if f.nodes == 1 else 120.0 / 128.0
    log_size = _log2i(nbytes / 64)
    if 0 <= log_size < 23:
        bus *= TREE_CORRECTION[p][log_size]
    intra, inter = _latencies(f, "tree", p)
    lat = BASE_LATENCY_US["tree"][_proto(p)] + 2 * (
        (f.per_node - 1) * intra + _log2i(f.nodes) * inter)
    return lat * 1e-6 + nbytes / (bus * 0.5)


def _pat(f: Fabric, nbytes: float) -> float | None:
    if f.per_node != 1 or f.nodes < 2:
        return None
    inter = HW_LATENCY_US["net"]["tree"][_proto("Simple")]
    lat = BASE_LATENCY_US["pat"][2] + _log2i(f.nodes) * inter / 3.5 + f.ranks * 2.8
    return lat * 1e-6 + nbytes / (0.75 * f.bus_bw)


def _nvls_bus(op: str, f: Fabric) -> float:
    bw = f.intra_bw * NVLS_EFFICIENCY[f.arch]
    return bw * 2 if op == "all_reduce" else bw * (f.per_node - 1) / f.per_node


def _nvls(op: str, f: Fabric, nbytes: float) -> float | None:
    if not (f.nvlink_sharp and f.arch in NVLS_EFFICIENCY) or f.nodes > 1 or f.per_node < 2:
        return None
    nsteps = 2 * (f.ranks - 1) if op == "all_reduce" else f.ranks - 1
    lat = HW_LATENCY_US["nvlink"]["nvls"][2]
    return lat * 1e-6 + nbytes / (_nvls_bus(op, f) * f.ranks / nsteps)


def _nvls_tree(f: Fabric, nbytes: float) -> float | None:
    if not (f.nvlink_sharp and f.arch in NVLS_EFFICIENCY) or f.nodes < 2 or f.per_node < 2:
        return None
    bus = min(_nvls_bus("all_reduce", f), f.net_bw * (2 if f.nodes <= 2 else 1))
    lat = HW_LATENCY_US["nvlink"]["nvls_tree"][2] + 2 * _log2i(f.nodes) * HW_LATENCY_US[
        "net"]["nvls_tree"][2]
    return lat * 1e-6 + nbytes / (bus * f.ranks / (2 * (f.ranks - 1)))


def _collnet(f: Fabric, nbytes: float) -> float | None:
    if not f.ib_sharp or f.nodes < 2:
        return None
    k = f.per_node
    intra, inter = _latencies(f, "collnet_direct", "Simple")
    lat = 2 * (min(1, k - 1) * intra + (k - 1) * 0.4) + inter
    node_out = nbytes / (f.net_bw * k)  # the node's NICs send the buffer once, receive it once
    in_node = 2 * (k - 1) / k * nbytes / f.intra_bw if k > 1 else 0.0
    eff = 0.85 if f.arch in ("hopper", "blackwell") else 1.0
    return lat * 1e-6 + max(node_out, in_node) / eff


def candidates(op: str, f: Fabric, nbytes: float) -> list[Choice]:
    """Every (algorithm, protocol) NCCL may run for one call of `nbytes` (the full tensor)."""
    out = []
    for algo in ALGORITHMS[op]:
        for p in PROTOCOLS:
            if algo in ("pat", "nvls", "nvls_tree", "collnet_direct") and p != "Simple":
                continue
            if algo == "ring":
                t = _ring(op, f, p, nbytes)
            elif algo == "tree":
                t = _tree(f, p, nbytes)
            elif algo == "pat":
                t = _pat(f, nbytes)
            elif algo == "nvls":
                t = _nvls(op, f, nbytes)
            elif algo == "nvls_tree":
                t = _nvls_tree(f, nbytes)
            else:
                t = _collnet(f, nbytes)
            if t is not None:
                out.append(Choice(algo, p, t))
    return out


def best(op: str, f: Fabric, nbytes: float) -> Choice:
    """What NCCL's tuner runs: the fastest candidate (all-to-all: point-to-point sends)."""
    if f.ranks <= 1:
        return Choice("none", "-", 0.0)
    if op == "all_to_all":
        return _all_to_all(f, nbytes)
    return min(candidates(op, f, nbytes), key=lambda c: c.seconds)


def _all_to_all(f: Fabric, nbytes: float) -> Choice:
    """Pairwise sends, all peers at once: each rank sends (m-1)/m of its buffer, (g-1)/g of it
    out of the node over its NIC share and (k-1)/m inside at the in-node bandwidth. The k
    members of a node send at once through the group's share of the node's NICs (``net_bw``,
    k/R of them): each rank gets net_bw / k (a ring's one stream per node gets it whole)."""
    m, g, k = f.ranks, f.nodes, f.per_node
    out = (g - 1) / g * nbytes * k / f.net_bw if g > 1 else 0.0
    inside = (k - 1) / m * nbytes / f.intra_bw
    hw = HW_LATENCY_US["net" if g > 1 else ("nvlink" if f.nvlink else "pci")]["ring"][2]
    lat = BASE_LATENCY_US["ring"][2] + hw
    return Choice("p2p", "Simple", lat * 1e-6 + max(out, inside))
