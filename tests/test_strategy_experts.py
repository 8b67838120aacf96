"""The expert class in a strategy: its string form, its groups and its rules (docs/moe.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import Strategy
from amsp_planner.strategy_experts import ep_options, expert_factor_options, expert_layout


def test_the_issue_example_parses_and_round_trips():
    text = "ep=8,p=64,g=64,os=64,ep.p=8,ep.g=8,ep.os=8,mb=1,ckpt"
    s = Strategy.parse(text)
    assert (s.ep, s.ep_span, s.s_p, s.ep_p, s.ep_g, s.ep_os) == (8, False, 64, 8, 8, 8)
    assert str(s) == text
    s.check(64, 8)


def test_missing_expert_factors_are_one_and_span_is_a_token():
    s = Strategy.parse("ep=4,ep.span,p=8,g=8,os=8,ep.os=2")
    assert (s.ep, s.ep_span, s.ep_p, s.ep_g, s.ep_os) == (4, True, 1, 1, 2)
    assert str(s) == "ep=4,ep.span,p=8,g=8,os=8,ep.p=1,ep.g=1,ep.os=2,mb=1"
    assert Strategy.parse("ep.p=1").has_experts and Strategy.parse("ep=1").ep_os == 1


def test_without_expert_tokens_the_expert_class_follows_the_dense_triple():
    s = Strategy.parse("p=8,g=16,os=64,mb=1")
    assert not s.has_experts and str(s) == "p=8,g=16,os=64,mb=1"  # dense form unchanged
    assert [s.expert_factor(c) for c in ("p", "g", "os")] == [8, 16, 64]
    assert s.ep == 1


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 512), st.booleans(), st.integers(1, 512), st.integers(1, 512),
       st.integers(1, 512), st.integers(1, 64))
def test_expert_string_form_round_trips(ep, span, p, g, os_, p_dense):
    s = Strategy(s_p=p_dense, ep=ep, ep_span=span, ep_p=p, ep_g=g, ep_os=os_)
    assert Strategy.parse(str(s)) == s


@pytest.mark.parametrize("text, needle", [
    ("ep=0", "must be at least 1"),
    ("ep=", "needs a value"),
    ("ep.p=x", "'ep.p=x' is not an integer"),
    ("ep.span=1", "takes no value"),
    ("ep.q=2", "unknown token 'ep.q=2'"),
    ("ep=2,ep=4", "given twice"),
])
def test_bad_expert_tokens_are_one_line(text, needle):
    with pytest.raises(AmspUserError) as e:
        Strategy.parse(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


def _groups(n, r, ep, span):
    """The EP groups and the EDP groups as rank sets, from the definition: in the node, an EP
    group is e consecutive ranks; spanning, the ranks congruent mod N/e. A rank's EDP group is
    the ranks holding the same experts: the same position in their EP groups."""
    if span:
        ep_of = {x: frozenset(range(x % (n // ep), n, n // ep)) for x in range(n)}
    else:
        ep_of = {x: frozenset(range(x - x % ep, x - x % ep + ep)) for x in range(n)}
    pos = {x: sorted(ep_of[x]).index(x) for x in range(n)}
    edp_of = {x: frozenset(y for y in range(n) if pos[y] == pos[x]) for x in range(n)}
    return ep_of, edp_of


@pytest.mark.parametrize("n, r, ep, span", [
    (64, 8, 8, False), (64, 8, 8, True), (64, 8, 2, False), (64, 8, 2, True),
    (64, 8, 16, False), (64, 8, 16, True), (16, 8, 4, True), (16, 8, 1, False),
    (32, 4, 8, True), (8, 8, 8, False)])
def test_layout_matches_the_rank_sets(n, r, ep, span):
    lay = expert_layout(ep, span, n, r)
    ep_of, edp_of = _groups(n, r, ep, span)
    for x in range(n):
        # the (size, stride) of each group reproduces the rank sets of the definition
        first = min(ep_of[x])
        assert ep_of[x] == frozenset(first + i * lay.ep_stride for i in range(lay.ep_size))
        first = min(edp_of[x])
        assert edp_of[x] == frozenset(first + i * lay.edp_stride for i in range(lay.edp_size))
        assert len(ep_of[x] & edp_of[x]) == 1  # one rank per EP group holds each expert set
    # EDP ranks on rank 0's node
    assert lay.edp_per_node == sum(1 for y in edp_of[0] if y // r == 0)


def test_rules_by_hand_on_8_nodes_of_8():
    # in the node, ep=8 fills a node: the 8 ranks holding the same experts are one per node
    lay = expert_layout(8, False, 64, 8)
    assert (lay.edp_size, lay.edp_per_node, lay.mesh(4)) == (8, 1, (1, 4))
    assert expert_factor_options(8, False, 64, 8) == [1, 2, 4, 8]
    # spanning, they are the 8 ranks of one node
    assert expert_layout(8, True, 64, 8).mesh(4) == (4, 1)
    Strategy(ep=8, ep_span=True, ep_p=4, ep_g=4, ep_os=8).check(64, 8)
    # in the node at ep=2, 4 ranks per node hold the same experts: 8 (2 nodes) or 2, not 6
    assert expert_factor_options(2, False, 64, 8) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("s, n, r, needle", [
    (Strategy(ep=3, ep_p=1, ep_g=1, ep_os=1), 24, 8, "neither divides nor is a multiple of the 8"),
    (Strategy(ep=5, ep_p=1, ep_g=1, ep_os=1), 64, 8, "does not divide the 64 GPUs"),
    (Strategy(ep=1, ep_span=True, ep_p=1, ep_g=1, ep_os=1), 64, 8, "ep.span needs 1 < ep"),
    (Strategy(ep=64, ep_span=True, ep_p=1, ep_g=1, ep_os=1), 64, 8, "ep.span needs 1 < ep"),
    (Strategy(ep=8, ep_p=16, ep_g=16, ep_os=16), 64, 8, "ep.p=16 does not divide the 8"),
    (Strategy(ep=2, ep_p=2, ep_g=6, ep_os=6), 48, 8, "ep.g=6 neither divides nor"),
    (Strategy(ep=2, ep_p=4, ep_g=2, ep_os=4), 64, 8, "must nest"),
    (Strategy(tp=2, ep=2, ep_p=1, ep_g=1, ep_os=1), 64, 8, "tensor parallelism of a mixture"),
])
def test_check_rejects_bad_expert_points(s, n, r, needle):
    with pytest.raises(ValueError, match=needle):
        s.check(n, r)


def test_experts_must_divide_by_the_degree_and_dense_models_take_no_ep():
    Strategy(ep=4, ep_p=1, ep_g=1, ep_os=1).check_experts(128)
    with pytest.raises(ValueError, match="ep=3 does not divide the model's 8 routed experts"):
        Strategy(ep=3, ep_p=1, ep_g=1, ep_os=1).check_experts(8)
    with pytest.raises(ValueError, match="dense model"):
        Strategy(ep_p=1, ep_g=1, ep_os=1).check_experts(0)
    Strategy(s_p=8).check_experts(0)


def test_ep_options_by_hand():
    # E = 8 experts, 2 nodes of 8: e in {1, 2, 4, 8}; spanning differs from in-node for 2..8
    assert ep_options(8, 16, 8) == [(1, False), (2, False), (2, True), (4, False), (4, True),
                                    (8, False), (8, True)]
    # E = 6 on 16 GPUs: 3 and 6 do not divide 16
    assert ep_options(6, 16, 8) == [(1, False), (2, False), (2, True)]
