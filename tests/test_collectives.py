"""Collective times as NCCL's tuner prices them (amsp_planner/collectives.py), by hand.

Constants from NCCL src/graph/tuning.cc (5067397c): base latency ring (LL, LL128, Simple) =
(6.6, 14, 8.4) us, tree (6.8, 14, 8.4); NVLink hop ring (0.6, 1.9, 3.4), tree (0.6, 1.25, 4);
network hop ring (2.7, 4, 14), tree (5, 8.5, 14); PAT base 8, 2.8 us per rank.
DGX A100 preset: NVLink 300 GB/s x 0.8 = 240 GB/s per GPU, 8 x 200 Gb/s x 0.8 = 160 GB/s per node.
"""

from __future__ import annotations

import pytest

from amsp_planner.specs import load_cluster
from amsp_planner.topology import Topology

A100 = load_cluster("dgx-a100-hdr")


def test_in_node_all_gather_is_ring_simple_for_large_messages():
    topo = Topology(A100, 8)
    full = 8 * 2**30
    # ring / Simple: 8.4 + 7 x 3.4 = 32.2 us; algorithm bandwidth 240 GB/s x 8/7.
    # (LL128: 14 + 7 x 1.9 = 27.3 us but 0.92 x the bandwidth: slower at 8 GiB.)
    expected = 32.2e-6 + 7 / 8 * full / 240e9
    assert topo.collective_time("all_gather", 8, 1, full) == pytest.approx(expected)
    c = topo.algorithm("all_gather", 8, 1, full)
    assert (c.algorithm, c.protocol) == ("ring", "Simple")
    # Two calls of half the size: twice the latency, same bandwidth term.
    assert topo.collective_time("all_gather", 8, 1, full, calls=2) == pytest.approx(
        2 * 32.2e-6 + 7 / 8 * full / 240e9)
    assert topo.collective_time("all_gather", 1, 1, full) == 0.0


def test_cross_node_replica_all_reduce_by_hand():
    topo = Topology(A100, 16)
    full = 2**30
    # 2 members at stride 8 (one per node): 8 such groups share each node's 180 GB/s (8 HDR
    # NICs at InfiniBand's 0.9), so a rank's bus bandwidth is 22.5 GB/s. Ring/Simple: 2 steps,
    # both across nodes, each at the tree's network latency (one rank per node): 8.4 + 2 x 14 =
    # 36.4 us, x 1.4 (the ring all-reduce plateau across nodes) = 50.96 us; algorithm
    # bandwidth 22.5 GB/s x 2/2.
    assert topo.collective_time("all_reduce", 2, 8, full) == pytest.approx(
        50.96e-6 + full / 22.5e9)


def test_small_all_reduce_over_the_world_takes_the_tree():
    topo = Topology(A100, 1024)
    # 8 bytes over 128 nodes x 8: tree/LL latency 6.8 + 2 (7 x 0.6 + log2(128) x 5) = 85.2 us
    # (the ring would pay 6.6 + 1,792 x 1 + 254 x 2.7 = 2,484 us); LL bandwidth capped at
    # llMax 20.4 GB/s (more than 2 nodes), algorithm bandwidth half of it.
    c = topo.algorithm("all_reduce", 1024, 1, 8)
    assert (c.algorithm, c.protocol) == ("tree", "LL")
    assert c.seconds == pytest.approx(85.2e-6 + 8 / (20.4e9 * 0.5))


def test_world_all_gather_pays_the_ring_latency():
    topo = Topology(A100, 1024)
    # 1 MB per call over 1024 ranks: ring/LL128 latency 14 + 896 x 1.9 + 127 x 4 = 2,224.4 us
    # (in-node hops at max(1.9, 1 us network overhead)); LL: 6.6 + 896 x 1 + 127 x 2.7 = 1,245.5 us
    # but at most 20.4 GB/s; NCCL has no tree for all-gather.
    c = topo.algorithm("all_gather", 1024, 1, 1e6)
    ll = 1245.5e-6 + 1e6 * 1023 / 1024 / 20.4e9
    ll128 = 2224.4e-6 + 1e6 * 1023 / 1024 / (0.92 * 180e9 * 0.82)  # 128 nodes: 0.82 of 180
    assert c.seconds == pytest.approx(min(ll, ll128))
    assert c.algorithm == "ring"


def test_one_rank_per_node_all_gather_takes_pat():
    topo = Topology(A100, 1024)
    # 128 members at stride 8 (one per node), 4 KiB: PAT 8 + log2(128) x 14 / 3.5 + 128 x 2.8
    # = 394.4 us at 0.75 x a rank's 22.5 GB/s x (1 - 0.03 x log2(128 / 2)) = 0.82 of it over
    # 128 nodes; ring/LL would pay 6.6 + 127 x 5 = 641.6 us.
    c = topo.algorithm("all_gather", 128, 8, 4096)
    assert c.algorithm == "pat"
    assert c.seconds == pytest.approx(394.4e-6 + 4096 / (0.75 * 22.5e9 * 0.82))


def test_nvlink_sharp_is_an_option_and_only_helps():
    h100 = load_cluster("dgx-h100-ndr")
    sharp = load_cluster("dgx-h100-ndr", {"nvlink_sharp": True})
    plain, fast = Topology(h100, 8), Topology(sharp, 8)
    full = 2**30
    assert fast.algorithm("all_reduce", 8, 1, full).algorithm == "nvls"
    assert plain.algorithm("all_reduce", 8, 1, full).algorithm in ("ring", "tree")
    # NVLS all-reduce: 25 us + F / (2 x 0.85 x 360 GB/s x 8 / 14)
    assert fast.collective_time("all_reduce", 8, 1, full) == pytest.approx(
        25e-6 + full / (2 * 0.85 * 360e9 * 8 / 14))
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        for size in (1e3, 1e6, 1e9):
            assert fast.collective_time(op, 8, 1, size) <= plain.collective_time(op, 8, 1, size)


def test_bus_bandwidth_grows_with_message_size():
    topo = Topology(A100, 64)
    sizes = [2**k for k in range(10, 32, 3)]
    bus = [7 / 8 * s / topo.collective_time("all_gather", 8, 1, s) for s in sizes]
    assert bus == sorted(bus) and bus[-1] > 0.95 * 240e9 and bus[0] < 0.05 * 240e9
