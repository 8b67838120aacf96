"""The collective model against published nccl-tests bus bandwidths (presets/nccl_tests.yaml):
InfiniBand at 2 to 128 nodes, RoCE, AWS EFA; and the effects that only show at scale, by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from amsp_planner import collectives
from amsp_planner.specs import load_cluster
from amsp_planner.topology import Topology

ROWS = yaml.safe_load((Path(__file__).resolve().parent.parent / "amsp_planner" / "presets"
                       / "nccl_tests.yaml").read_text())["rows"]
TOLERANCE = 0.10
"""Every published row in scope is predicted within 10 % of its bus bandwidth."""


def predicted(row) -> float:
    cluster = load_cluster(row["cluster"], row.get("set"))
    n = row["nodes"] * cluster.gpus_per_node
    return Topology(cluster, n).bus_bandwidth(row["op"], n, 1, row["size_bytes"]) / 1e9


def test_rows_cover_networks_ops_and_scales():
    inscope = [r for r in ROWS if "scope" not in r]
    assert {r["op"] for r in inscope} == {"all_gather", "reduce_scatter", "all_reduce"}
    assert {load_cluster(r["cluster"]).network for r in inscope} == {"infiniband", "roce", "efa"}
    assert max(r["nodes"] for r in inscope) >= 128
    assert all(r["source"].startswith("https://") for r in ROWS)


@pytest.mark.parametrize("row", [r for r in ROWS if "scope" not in r], ids=lambda r: r["id"])
def test_published_bus_bandwidth_within_tolerance(row):
    got = predicted(row)
    assert abs(got / row["busbw"] - 1) <= TOLERANCE, (row["id"], got, row["busbw"])


def test_published_decline_with_nodes_is_kept():
    # the reduce-scatter rows of one cluster, 4 to 128 nodes: strictly falling, as published
    rows = sorted((r for r in ROWS if r["id"].startswith("ib-h100-rs-")), key=lambda r: r["nodes"])
    got = [predicted(r) for r in rows]
    assert [r["busbw"] for r in rows] == sorted((r["busbw"] for r in rows), reverse=True)
    assert got == sorted(got, reverse=True) and got[0] > got[-1] * 1.25


def test_efa_is_not_infiniband():
    # the same nodes and NIC line rate: EFA's ring carries less than InfiniBand's
    efa = load_cluster("aws-p4d")
    ib = load_cluster("aws-p4d", {"network": "infiniband"})
    n = 4 * 8
    a, b = (Topology(c, n).bus_bandwidth("all_gather", n, 1, 2**30) for c in (efa, ib))
    assert a / b == pytest.approx(collectives.NETWORKS["efa"].efficiency
                                  / collectives.NETWORKS["infiniband"].efficiency, rel=0.02)


def test_scale_factor_by_hand():
    loss = collectives.NETWORKS["infiniband"].loss_per_doubling
    assert collectives.scale_factor("infiniband", 2) == 1.0
    assert collectives.scale_factor("infiniband", 64) == pytest.approx(1 - 5 * loss)
    assert collectives.scale_factor("infiniband", 2**40) == 0.5  # floor: half


def test_ring_latency_grows_with_ranks_and_small_calls_lose_bandwidth():
    # the same 1 MiB all-gather over 16 and over 1,024 ranks: NCCL's per-step latency makes the
    # large ring's bus bandwidth a fraction of the small one's; 1 GiB hides most of it
    c = load_cluster("dgx-a100-hdr")
    small, large = Topology(c, 16), Topology(c, 1024)
    bw = {(t.num_gpus, s): t.bus_bandwidth("all_gather", t.num_gpus, 1, s)
          for t in (small, large) for s in (2**20, 2**30)}
    assert bw[1024, 2**20] < 0.2 * bw[16, 2**20]
    assert bw[1024, 2**30] > 0.5 * bw[16, 2**30]
    assert math.isfinite(bw[1024, 2**20])
