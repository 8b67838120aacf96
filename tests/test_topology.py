"""Topology: bus factors, group layouts against brute force, graph bandwidths, collective times."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amsp_planner.specs import load_cluster
from amsp_planner.topology import BUS_FACTOR, GroupLayout, Topology, split_bytes

A100 = load_cluster("dgx-a100-hdr")  # 8 GPUs/node, NVLink 3 300 GB/s, 8 x HDR 200 Gb/s, eff 0.8


# ----- nccl-tests bus-bandwidth factors (DESIGN.md 4) -----------------------------------------
@pytest.mark.parametrize("n", [2, 3, 8, 64, 1000])
def test_bus_factors_are_nccl_tests(n):
    assert BUS_FACTOR["all_reduce"](n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert BUS_FACTOR[op](n) == pytest.approx((n - 1) / n)
    assert BUS_FACTOR["broadcast"](n) == 1.0


def test_bus_factor_values_at_eight():
    # nccl-tests README: all-reduce busbw = algbw * 2(n-1)/n = 1.75 at n = 8; all-gather 0.875.
    assert BUS_FACTOR["all_reduce"](8) == 1.75
    assert BUS_FACTOR["all_gather"](8) == 0.875


# ----- layouts: brute force over the actual rank sets -----------------------------------------
def brute_layout(num_gpus: int, r: int, size: int, stride: int) -> tuple[int, int]:
    """(members per node, nodes touched) of every group, from the actual rank sets.

    The groups partition the ranks: each aligned block of size*stride consecutive ranks holds
    `stride` groups, the ranks of the block congruent mod stride.
    """
    seen = set()
    block = size * stride
    for start in range(0, num_gpus, block):
        for offset in range(stride):
            members = [start + offset + j * stride for j in range(size)]
            per_node = Counter(m // r for m in members)
            seen.add((max(per_node.values()), len(per_node)))
    assert len(seen) == 1, seen  # every group lies on the nodes the same way
    return seen.pop()


@st.composite
def group_shapes(draw):
    """(N, R, size, stride) as the schedule makes them: size * stride divides N, stride | ..."""
    r = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.sampled_from([1, 2, 3, 4, 8]))
    n = r * nodes
    opts = [s for s in range(1, n + 1) if n % s == 0 and (r % s == 0 or s % r == 0)]
    inner = draw(st.sampled_from(opts))  # the stride is itself a shard factor
    outer = draw(st.sampled_from([s for s in opts if s % inner == 0]))
    return n, r, outer // inner, inner


@settings(max_examples=200, deadline=None)
@given(group_shapes())
def test_layout_matches_brute_force(shape):
    n, r, size, stride = shape
    lay = Topology(load_cluster("dgx-a100-hdr", {"gpus_per_node": r}), n).layout(size, stride)
    assert (lay.members_per_node, lay.nodes) == brute_layout(n, r, size, stride)


def test_layout_spans_leaves_only_past_a_leaf():
    topo = Topology(A100, 8 * 64)  # 64 nodes, 16 per leaf
    assert not topo.layout(16 * 8, 1).spans_leaves  # 16 nodes: one leaf
    assert topo.layout(17 * 8, 1).spans_leaves  # 17 nodes
    assert topo.layout(32 * 8, 1).spans_leaves
    assert not topo.layout(8, 1).spans_leaves


# ----- split_bytes: intra + inter is the ring convention -------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]),
       st.integers(1, 16), st.integers(1, 64), st.integers(1, 10**12))
def test_split_bytes_sums_to_bus_factor(op, k, g, full):
    lay = GroupLayout(size=k * g, stride=1, members_per_node=k, nodes=g, spans_leaves=False)
    intra, inter = split_bytes(op, full, lay)
    m = k * g
    expected = BUS_FACTOR[op](m) * full if m > 1 else 0.0
    assert intra + inter == pytest.approx(expected, rel=1e-12, abs=1e-6)
    assert intra >= 0 and inter >= 0
    if g == 1:
        assert inter == 0
    if k == 1:
        assert intra == 0


def test_split_bytes_hand_values():
    # All-gather of F = 1600 B over 16 ranks, 8 per node on 2 nodes (hierarchical):
    # in-node phase 7/8 F = 1400; cross-node phase each rank exchanges its node-peer's 1/16: 100.
    lay = GroupLayout(16, 1, 8, 2, False)
    assert split_bytes("all_gather", 1600, lay) == (1400, 100)
    assert split_bytes("all_reduce", 1600, lay) == (2800, 200)
    # All-to-all of 1600 B: a rank sends 1/16 to each of 15 peers, 7 in-node, 8 on the other node.
    assert split_bytes("all_to_all", 1600, lay) == (700, 800)


# ----- graph bandwidths (max flows) -----------------------------------------------------------
def test_graph_bandwidths_by_hand():
    topo = Topology(A100, 64)
    # One GPU's NVSwitch port: 300 GB/s x 0.8.
    assert topo.intra_bw == pytest.approx(240e9)
    # Node to node under one leaf: 8 NICs x 200 Gb/s / 8 x 0.9 (InfiniBand) = 180 GB/s.
    assert topo.node_bw == pytest.approx(180e9)
    # Non-blocking fat tree: crossing the spine costs nothing extra.
    assert Topology(A100, 8 * 32).node_bw_cross_leaf == pytest.approx(180e9)


def test_oversubscribed_spine_halves_cross_leaf_bandwidth():
    c = load_cluster("dgx-a100-hdr", {"oversubscription": 2.0, "nodes_per_leaf": 4})
    topo = Topology(c, 8 * 8)  # two leaves of 4 nodes
    assert topo.node_bw == pytest.approx(180e9)
    assert topo.node_bw_cross_leaf == pytest.approx(90e9)


# ----- collective time -------------------------------------------------------------------------
def test_measured_table_overrides_alpha_beta():
    c = A100.model_validate({**A100.model_dump(), "measured": [
        {"op": "all_gather", "scope": "intra", "points": [
            {"size_bytes": 2**20, "busbw_gbyte_per_s": 10},
            {"size_bytes": 2**30, "busbw_gbyte_per_s": 100}]}]})
    topo = Topology(c, 8)
    # At a measured point: calls * (m-1)/m * size / busbw.
    assert topo.collective_time("all_gather", 8, 1, 2**30) == pytest.approx(7 / 8 * 2**30 / 100e9)
    # Below the table: flat at the first point.
    assert topo.collective_time("all_gather", 8, 1, 1024) == pytest.approx(7 / 8 * 1024 / 10e9)
    # Geometric middle (2^25): log-linear interpolation gives the mean bandwidth, 55 GB/s.
    assert topo.collective_time("all_gather", 8, 1, 2**25) == pytest.approx(7 / 8 * 2**25 / 55e9)
    # Not covered (reduce-scatter): the alpha-beta model as before.
    assert topo.collective_time("reduce_scatter", 8, 1, 2**30) == pytest.approx(
        Topology(A100, 8).collective_time("reduce_scatter", 8, 1, 2**30))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]),
       group_shapes(), st.floats(1e3, 1e11), st.floats(1.0, 8.0), st.floats(1.0, 8.0))
def test_more_bandwidth_never_slower_for_a_collective(op, shape, full, nic_x, nvl_x):
    n, r, size, stride = shape
    base = load_cluster("dgx-a100-hdr", {"gpus_per_node": r})
    fast = load_cluster("dgx-a100-hdr", {"gpus_per_node": r, "nic_gbit_per_s": 200 * nic_x,
                                         "intra_gbyte_per_s": 300 * nvl_x})
    t0 = Topology(base, n).collective_time(op, size, stride, full)
    t1 = Topology(fast, n).collective_time(op, size, stride, full)
    assert t1 <= t0 * (1 + 1e-12)


def test_gpus_must_fill_nodes():
    with pytest.raises(ValueError, match="multiple of 8"):
        Topology(A100, 12)
