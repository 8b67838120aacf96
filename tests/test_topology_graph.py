"""The closed-form bandwidths the planner uses equal max-flows on the networkx cluster graph."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from amsp_planner.specs import ClusterSpec, GpuSpec
from amsp_planner.topology import Topology

clusters = st.builds(
    lambda r, nics, nic, intra, per_leaf, over: ClusterSpec(
        name="random", gpu=GpuSpec(name="g", memory_gib=80, peak_bf16_tflop_per_s=300),
        gpus_per_node=r, nics_per_node=nics, nic_gbit_per_s=nic, intra_gbyte_per_s=intra,
        nodes_per_leaf=per_leaf, oversubscription=over),
    st.sampled_from([1, 2, 4, 8]), st.integers(1, 8), st.sampled_from([25, 100, 200, 400, 3200]),
    st.sampled_from([2, 16, 50, 300]), st.integers(1, 6), st.sampled_from([1.0, 1.5, 2.0, 4.0]),
)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(clusters, st.sampled_from([1, 2, 3, 5, 16]))
def test_closed_forms_equal_graph_max_flows(cluster, nodes):
    topo = Topology(cluster, cluster.gpus_per_node * nodes)
    for name, flow in topo.graph_bandwidths().items():
        assert math.isclose(flow, getattr(topo, name), rel_tol=1e-9), name


def test_oversubscription_only_slows_groups_that_span_leaves():
    c = ClusterSpec(name="c", gpu=GpuSpec(name="g", memory_gib=80, peak_bf16_tflop_per_s=300),
                    gpus_per_node=8, nics_per_node=8, nic_gbit_per_s=200, intra_gbyte_per_s=300,
                    nodes_per_leaf=4, oversubscription=2.0)
    topo = Topology(c, 8 * 16)
    inside = topo.layout(32, 1)     # 4 nodes: one leaf
    across = topo.layout(64, 1)     # 8 nodes: two leaves
    assert not inside.spans_leaves and across.spans_leaves
    assert topo.inter_bw_per_rank(across) * 2 == topo.inter_bw_per_rank(inside)
