"""``amsp explain`` on a mixture of experts: the "differs by" line names e, its placement and
the expert triple, and the token all-to-alls that separate two strategies are given per phase
(docs/moe.md)."""

from __future__ import annotations

import pytest
from test_moe_cost import A2A_CALL, S_IN, S_SPAN, job64

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.report.explain import a2a_differences
from amsp_planner.report.sensitivity import _diff
from amsp_planner.strategy import Strategy

GIB = 1024**3


def test_differs_by_names_the_degree_the_placement_and_the_expert_triple():
    a, b = Strategy.parse(S_IN), Strategy.parse(S_SPAN)
    assert _diff(a, b) == "EP placement in the node->spanning nodes"
    c = Strategy.parse("ep=4,p=64,g=64,os=64,ep.p=1,ep.g=2,ep.os=16,mb=1,ckpt")
    assert _diff(a, c) == "ep 8->4, expert P 8->1, expert G 8->2, expert OS 8->16"
    # a strategy without expert tokens shards the experts like the dense triple at e = 1
    d = Strategy.parse("p=64,g=64,os=64,mb=1,ckpt")
    assert _diff(a, d) == "ep 8->1, expert P 8->64, expert G 8->64, expert OS 8->64"
    dense = Strategy.parse("p=8,g=8,os=8,mb=1")
    assert "ep" not in _diff(dense, dense.with_(s_p=1))


def test_all_to_alls_separating_in_node_from_spanning_by_hand():
    job = job64()
    a, b = evaluate(job, Strategy.parse(S_IN)), evaluate(job, Strategy.parse(S_SPAN))
    got = {ph: (s, nic) for ph, s, nic in a2a_differences(a, b)}
    assert set(got) == {"forward", "backward", "recompute"}
    # 2 calls x 48 layers x 2 micro-batches per phase; spanning puts 7/8 of each on the NIC,
    # in the node none
    for ph in got:
        assert got[ph][1] == pytest.approx(2 * 48 * 2 * 7 / 8 * A2A_CALL / GIB)
        assert got[ph][0] > 0  # slower over the NICs
    # the same strategy: nothing separates them
    assert a2a_differences(a, a) == []
