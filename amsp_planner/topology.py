"""The cluster as a graph, and what a rank group's collectives see on it.

Ranks are node-major: rank = node * R + local. A group of m members at stride d (the members of
the group of rank r are r, r+d, ..., all congruent mod d) puts k = min(m, max(1, R // d))
members on each node it touches and touches g = m / k nodes (DESIGN.md 3a).

The graph (networkx) has GPUs joined to their node's switch (NVSwitch/NVLink/PCIe, capacity =
per-GPU bus bandwidth), the node switch joined to the node's NICs, NICs to their leaf switch,
and leaves to one spine with capacity (nodes per leaf x node NIC bandwidth) / oversubscription.
The bandwidths the cost model uses are max-flows on that graph (computed in closed form on the
planner's path, so that it needs no graph library at start-up; ``graph_bandwidths`` computes them
with networkx and tests check both agree):

- ``intra_bw``: one GPU to the others of its node;
- ``node_bw``: one node to another under the same leaf (all its NICs);
- ``node_bw_cross_leaf``: a node's share when every node of a leaf sends across the spine.

A collective's inter-node traffic is shared by all R ranks of a node (every rank runs the same
collective at the same time), so a rank's inter-node bytes move at node_bw / R.

Collective time on GPU clusters is NCCL's own model (``collectives.py``): the algorithms NCCL
has for each op, with its latency and bandwidth tables, the fastest chosen as its tuner does.
The bus bandwidth a rank of a group sees (``fabric``): in one node, its NVLink/PCIe link; across
nodes, min(its in-node link, its share of the node's NICs), the share being node_bw x k / R since
the R/k groups active on the node at once each put their ring bytes through the node's exit.

On CPU processes (gloo, ``intra_fabric: shm``) without measured tables, the faster of two
alpha-beta forms:

- hierarchical: the in-node phase on the intra fabric, then the cross-node phase on the NICs,
  one after the other: t = a_intra*(k-1) + a_inter*(g-1) + intra_bytes/intra_bw
  + inter_bytes/(node_bw/R);
- ring: one ring over all m members; every edge carries the ring bytes, the node's exit edges
  share the NICs with the R/k concurrent groups: t = a*(m-1) + max(ring/intra_bw,
  (R/k)*ring/node_bw) with a the slowest hop's latency.

All-reduce doubles the steps of all-gather/reduce-scatter; all-to-all is sent directly (no
hierarchy): inter bytes (g-1)/g of the buffer, intra (k-1)/m of it.

[Note: measured tables] `amsp calibrate` measures bus bandwidth by message size: 'intra' on a
group of one whole node, 'inter' on a group of one rank per node (the others idle), so the
inter figure is what one node's link carries per second of the library's own algorithm (gloo
sending twice the ring bytes for a reduce-scatter shows up as half the bus bandwidth). A group
inside one node takes its time from the intra table as measured. A group spanning nodes is
priced as the ring the libraries run: every in-node edge carries the ring bytes at the intra
bandwidth, and each node's exit carries them for each of the R/k groups crossing at once, at
the inter bandwidth: t = max(ring/intra, (R/k) * ring/inter); all-to-all: the node sends
R (g-1)/g of the buffer out. Without this layout step a one-rank-per-node figure would price the
R concurrent stride-R groups of a replica all-reduce R times too fast, and a whole-world ring
would be priced like a stride-R one. A table that is missing falls back to the spec's bandwidth
for its part (intra) or to the alpha-beta model (inter).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property

from amsp_planner import collectives
from amsp_planner.specs.cluster import ClusterSpec

# nccl-tests bus bandwidth factors: ring bytes per rank = factor * full size.
BUS_FACTOR = {
    "all_gather": lambda m: (m - 1) / m,
    "reduce_scatter": lambda m: (m - 1) / m,
    "all_to_all": lambda m: (m - 1) / m,
    "all_reduce": lambda m: 2 * (m - 1) / m,
    "broadcast": lambda m: 1.0,
}


@dataclass(frozen=True)
class GroupLayout:
    """How a rank group of `size` members at `stride` lies on the nodes."""

    size: int
    stride: int
    members_per_node: int
    nodes: int
    spans_leaves: bool


def split_bytes(op: str, full: float, layout: GroupLayout) -> tuple[float, float]:
    """(intra, inter) bytes per rank for one collective of `full` bytes (hierarchical).

    all-gather / reduce-scatter: inter (g-1)/g * full/k, intra (k-1)/k * full; sum (m-1)/m * full.
    all-reduce: twice that. all-to-all: inter (g-1)/g * full, intra (k-1)/m * full.
    """
    m, k, g = layout.size, layout.members_per_node, layout.nodes
    if m <= 1:
        return 0.0, 0.0
    if op == "all_to_all":
        return (k - 1) / m * full, (g - 1) / g * full
    inter = (g - 1) / g * full / k
    intra = (k - 1) / k * full
    if op == "all_reduce":
        return 2 * intra, 2 * inter
    return intra, inter


class Topology:
    """A ClusterSpec with N GPUs: group layouts, bandwidths and collective times."""

    def __init__(self, cluster: ClusterSpec, num_gpus: int):
        if num_gpus % cluster.gpus_per_node and num_gpus > cluster.gpus_per_node:
            raise ValueError(
                f"--gpus {num_gpus} is not a whole number of {cluster.gpus_per_node}-GPU nodes: "
                f"use a multiple of {cluster.gpus_per_node}"
            )
        self.cluster = cluster
        self.num_gpus = num_gpus
        self.gpus_per_node = min(cluster.gpus_per_node, num_gpus)
        self.num_nodes = max(1, num_gpus // cluster.gpus_per_node)
        self._choices: dict[tuple, collectives.Choice] = {}
        self._layouts: dict[tuple[int, int], GroupLayout] = {}
        self._times: dict[tuple, float] = {}

    # ----- the graph ------------------------------------------------------------------------
    @cached_property
    def graph(self):
        """The cluster graph, with at most two leaves' worth of nodes (the rest repeat them)."""
        import networkx as nx

        c = self.cluster
        g = nx.DiGraph()
        nodes = min(self.num_nodes, 2 * c.nodes_per_leaf)
        nic_bw = c.nic_gbit_per_s * 1e9 / 8 * c.nic_fraction
        uplink = c.nodes_per_leaf * c.node_nic_bytes_per_s / c.oversubscription
        for node in range(nodes):
            leaf = f"leaf{node // c.nodes_per_leaf}"
            sw = f"n{node}/switch"
            for local in range(self.gpus_per_node):
                gpu = f"n{node}/gpu{local}"
                g.add_edge(gpu, sw, capacity=c.intra_bytes_per_s)
                g.add_edge(sw, gpu, capacity=c.intra_bytes_per_s)
            for nic in range(c.nics_per_node):
                name = f"n{node}/nic{nic}"
                g.add_edge(sw, name, capacity=math.inf)
                g.add_edge(name, sw, capacity=math.inf)
                g.add_edge(name, leaf, capacity=nic_bw)
                g.add_edge(leaf, name, capacity=nic_bw)
        for leaf in {f"leaf{i // c.nodes_per_leaf}" for i in range(nodes)}:
            g.add_edge(leaf, "spine", capacity=uplink)
            g.add_edge("spine", leaf, capacity=uplink)
        return g

    def _flow(self, sources: list[str], sinks: list[str]) -> float:
        import networkx as nx

        g = self.graph.copy()
        for s in sources:
            g.add_edge("SRC", s, capacity=math.inf)
        for t in sinks:
            g.add_edge(t, "SNK", capacity=math.inf)
        return nx.maximum_flow_value(g, "SRC", "SNK")

    def graph_bandwidths(self) -> dict[str, float]:
        """The three bandwidths as max-flows on the networkx graph (slow; tests/test_topology_graph.py
        checks that they equal the closed forms the planner uses)."""
        r, c = self.gpus_per_node, self.cluster
        out = {"intra_bw": self._flow(["n0/gpu0"], [f"n0/gpu{i}" for i in range(1, r)])
               if r > 1 else self.intra_bw}
        if self.num_nodes > 1 and c.nodes_per_leaf > 1:
            out["node_bw"] = self._flow([f"n0/gpu{i}" for i in range(r)],
                                        [f"n1/gpu{i}" for i in range(r)])
        if self.num_nodes >= 2 * c.nodes_per_leaf:  # two full leaves in the graph
            per = c.nodes_per_leaf
            src = [f"n{i}/gpu{j}" for i in range(per) for j in range(r)]
            dst = [f"n{per + i}/gpu{j}" for i in range(per) for j in range(r)]
            out["node_bw_cross_leaf"] = self._flow(src, dst) / per
        return out

    # Closed forms of the max-flows above (equal by construction of the graph; tested):
    @cached_property
    def intra_bw(self) -> float:
        """Bytes/s one GPU sends to the rest of its node (its link to the node switch)."""
        return self.cluster.intra_bytes_per_s

    @cached_property
    def node_bw(self) -> float:
        """Bytes/s one node sends to another under the same leaf: min(its NICs, its GPUs' links)."""
        c = self.cluster
        bw = min(c.node_nic_bytes_per_s, self.gpus_per_node * c.intra_bytes_per_s)
        if self.num_nodes > 1 and c.nodes_per_leaf == 1:
            return self.node_bw_cross_leaf
        return bw

    @cached_property
    def node_bw_cross_leaf(self) -> float:
        """A node's share of the spine when every node of its leaf sends to another leaf:
        min(its NICs, uplink / nodes per leaf) = NICs / oversubscription."""
        c = self.cluster
        nic = min(c.node_nic_bytes_per_s, self.gpus_per_node * c.intra_bytes_per_s)
        uplink = c.nodes_per_leaf * c.node_nic_bytes_per_s / c.oversubscription
        return min(nic, uplink / c.nodes_per_leaf)

    # ----- groups ---------------------------------------------------------------------------
    def layout(self, size: int, stride: int) -> GroupLayout:
        hit = self._layouts.get((size, stride))
        if hit is None:
            hit = self._layouts[size, stride] = self._layout(size, stride)
        return hit

    def _layout(self, size: int, stride: int) -> GroupLayout:
        r = self.gpus_per_node
        k = min(size, max(1, r // stride)) if stride < r else 1
        nodes = max(1, size // k)
        node_span = ((size - 1) * stride) // r + 1 if size > 1 else 1
        spans = nodes > 1 and node_span > self.cluster.nodes_per_leaf
        return GroupLayout(size, stride, k, nodes, spans)

    def inter_bw_per_rank(self, layout: GroupLayout) -> float:
        bw = self.node_bw_cross_leaf if layout.spans_leaves else self.node_bw
        return bw / self.gpus_per_node

    # ----- time -----------------------------------------------------------------------------
    def fabric(self, layout: GroupLayout) -> collectives.Fabric:
        """What NCCL's tuner sees for a group: its shape and the bus bandwidth of one rank."""
        c = self.cluster
        net = 0.0
        if layout.nodes > 1:
            node = self.node_bw_cross_leaf if layout.spans_leaves else self.node_bw
            net = (node * layout.members_per_node / self.gpus_per_node
                   * collectives.scale_factor(c.network, layout.nodes))
        bus = min(self.intra_bw, net) if layout.nodes > 1 else self.intra_bw
        return collectives.Fabric(
            ranks=layout.size, nodes=layout.nodes, per_node=layout.members_per_node,
            bus_bw=bus, intra_bw=self.intra_bw, net_bw=net, arch=c.gpu.arch,
            nvlink=c.intra_fabric in ("nvswitch", "nvlink"), nvlink_sharp=c.nvlink_sharp,
            ib_sharp=c.ib_sharp)

    def algorithm(self, op: str, size: int, stride: int, per_call: float) -> collectives.Choice:
        """The algorithm and protocol NCCL runs for one call, with its seconds (memoised: the
        planner prices the same calls for many strategies)."""
        key = (op, size, stride, per_call)
        hit = self._choices.get(key)
        if hit is None:
            hit = collectives.best(op, self.fabric(self.layout(size, stride)), per_call)
            self._choices[key] = hit
        return hit

    def collective_time(self, op: str, size: int, stride: int, full_bytes: float,
                        calls: int = 1) -> float:
        """Seconds for `calls` collectives moving `full_bytes` in total over one rank group
        (memoised, as ``algorithm``)."""
        if size <= 1 or calls == 0:
            return 0.0
        key = (op, size, stride, full_bytes, calls)
        hit = self._times.get(key)
        if hit is None:
            hit = self._times[key] = self._collective_time(op, size, stride, full_bytes, calls)
        return hit

    def bus_bandwidth(self, op: str, size: int, stride: int, full_bytes: float) -> float:
        """Bus bandwidth (bytes/s, the nccl-tests convention: the ring bytes of a rank over the
        time) of one collective of `full_bytes` over a group: what nccl-tests prints as busbw."""
        return BUS_FACTOR[op](size) * full_bytes / self.collective_time(op, size, stride,
                                                                          full_bytes)

    def _collective_time(self, op: str, size: int, stride: int, full_bytes: float,
                         calls: int) -> float:
        lay = self.layout(size, stride)
        per_call = full_bytes / calls
        intra = self.cluster.table(op, "intra")
        inter = self.cluster.table(op, "inter") if lay.nodes > 1 else None
        if intra is not None and lay.nodes == 1:
            return calls * BUS_FACTOR[op](size) * per_call / _interp(intra, per_call)
        if inter is not None:
            return calls * self._measured_ring(op, lay, per_call, intra, inter)
        if self.cluster.collective_library == "nccl":
            return calls * self.algorithm(op, size, stride, per_call).seconds
        return calls * min(self._hierarchical(op, lay, per_call), self._ring(op, lay, per_call))

    def _measured_ring(self, op: str, lay: GroupLayout, per_call: float, intra, inter) -> float:
        """A group spanning nodes, priced from measured tables ([Note: measured tables])."""
        r = self.gpus_per_node
        in_bw = _interp(intra, per_call) if intra is not None else self.intra_bw
        out_bw = _interp(inter, per_call)
        if op == "all_to_all":  # direct sends: a node's ranks send (g-1)/g of their buffer out
            t_out = r * (lay.nodes - 1) / lay.nodes * per_call / out_bw
            t_in = (lay.members_per_node - 1) / lay.size * per_call / in_bw
            return max(t_out, t_in)
        ring = BUS_FACTOR[op](lay.size) * per_call
        return max(ring / in_bw, (r / lay.members_per_node) * ring / out_bw)

    def _hierarchical(self, op: str, lay: GroupLayout, per_call: float) -> float:
        c = self.cluster
        steps = 2 if op == "all_reduce" else 1
        intra, inter = split_bytes(op, per_call, lay)
        alpha = steps * ((lay.members_per_node - 1) * c.intra_latency_us
                         + (lay.nodes - 1) * c.inter_latency_us) * 1e-6
        t = intra / self.intra_bw
        if inter:
            t += inter / self.inter_bw_per_rank(lay)
        return alpha + t

    def _ring(self, op: str, lay: GroupLayout, per_call: float) -> float:
        c = self.cluster
        steps = 2 if op == "all_reduce" else 1
        ring = BUS_FACTOR[op](lay.size) * per_call
        if op == "all_to_all":  # direct sends: same traffic as the hierarchical split
            return self._hierarchical(op, lay, per_call)
        hop = c.inter_latency_us if lay.nodes > 1 else c.intra_latency_us
        alpha = steps * (lay.size - 1) * hop * 1e-6
        t = ring / self.intra_bw
        if lay.nodes > 1:
            concurrent = self.gpus_per_node / lay.members_per_node
            bw = self.node_bw_cross_leaf if lay.spans_leaves else self.node_bw
            t = max(t, concurrent * ring / bw)
        return alpha + t


def _interp(table, size: float) -> float:
    """Bus bandwidth (bytes/s) at `size`, log-linear between measured points, flat outside."""
    pts = table.points
    sizes = [p.size_bytes for p in pts]
    bws = [p.busbw_gbyte_per_s * 1e9 for p in pts]
    if size <= sizes[0]:
        return bws[0]
    if size >= sizes[-1]:
        return bws[-1]
    i = bisect.bisect_right(sizes, size)
    x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
    w = (math.log(size) - x0) / (x1 - x0)
    return bws[i - 1] + w * (bws[i] - bws[i - 1])
