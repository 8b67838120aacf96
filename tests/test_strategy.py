"""Strategy: the string form, the AMSP space's rules, and the named baselines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import (
    Strategy,
    baseline,
    factor_options,
    parse_strategy_or_baseline,
)
from amsp_planner.strategy_baselines import named_baselines


# ----- string form ----------------------------------------------------------------------------
def test_parse_full_form():
    s = Strategy.parse("p=8,g=8,os=64,qwz,hpz=4,qgz,mb=2,ga=4,ckpt")
    assert (s.s_p, s.s_g, s.s_os) == (8, 8, 64)
    assert s.qwz and s.qgz and s.ckpt
    assert (s.hpz, s.micro_batch, s.grad_accum, s.quant_block) == (4, 2, 4, 256)
    assert Strategy.parse(" P = 2 , OS=4 ") == Strategy(s_p=2, s_os=4)
    assert Strategy.parse("qwz=64").quant_block == 64
    assert Strategy.parse("os=8,nockpt").ckpt is False


@st.composite
def any_strategy(draw):
    return Strategy(
        s_p=draw(st.integers(1, 4096)), s_g=draw(st.integers(1, 4096)),
        s_os=draw(st.integers(1, 4096)), qwz=draw(st.booleans()),
        quant_block=draw(st.sampled_from([8, 16, 32, 64, 128, 256])),
        hpz=draw(st.integers(1, 64)), qgz=draw(st.booleans()),
        micro_batch=draw(st.integers(1, 64)),
        grad_accum=draw(st.none() | st.integers(1, 64)), ckpt=draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(any_strategy())
def test_string_form_round_trips(s):
    back = Strategy.parse(str(s))
    if not s.qwz:  # the block is only written with qwz
        back = back.with_(quant_block=s.quant_block)
    assert back == s


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("p=", "needs a value"),
    ("p=x", "'p=x' is not an integer"),
    ("p=0", "must be at least 1"),
    ("p=-8", "must be at least 1"),
    ("p=2.5", "not an integer"),
    ("p=8,p=8", "given twice"),
    ("sp=2", "unknown token 'sp=2'"),
    ("zero4", "unknown token"),
    ("qgz=1", "takes no value"),
    ("ckpt=yes", "ckpt=yes: use a block count K"),
    ("qwz=48", "must divide 256"),
    ("qwz=4", "at least 8"),
    ("p=8,,g=8", "unknown token ''"),
])
def test_parse_rejects_with_one_line_naming_the_token(text, needle):
    with pytest.raises(AmspUserError) as e:
        Strategy.parse(text)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert msg.startswith("--strategy")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="pgoswzhqckmba=,0123456789-. x", max_size=30))
def test_parse_never_crashes(text):
    try:
        s = Strategy.parse(text)
    except AmspUserError as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(s, Strategy)


# ----- the AMSP space -------------------------------------------------------------------------
@pytest.mark.parametrize("n, r", [(1, 8), (8, 8), (16, 8), (24, 8), (64, 8), (48, 4), (4, 4)])
def test_factor_options_intra_node_first(n, r):
    # Brute force of DESIGN.md 1: divisors of N that divide R or are a multiple of R.
    want = [s for s in range(1, n + 1) if n % s == 0 and (s <= r and r % s == 0 or s % r == 0)]
    assert factor_options(n, r) == want


def test_factor_options_excludes_partial_nodes():
    # 24 GPUs on 8-GPU nodes: 12 = 1.5 nodes is not allowed, 3 does not divide 8.
    opts = factor_options(24, 8)
    assert 12 not in opts and 3 not in opts and 6 not in opts
    assert opts == [1, 2, 4, 8, 24]


def test_mesh_is_intra_node_first():
    s = Strategy(s_p=4, s_g=8, s_os=32)
    assert s.mesh("p", 8) == (4, 1)
    assert s.mesh("g", 8) == (8, 1)
    assert s.mesh("os", 8) == (8, 4)


@pytest.mark.parametrize("s, needle", [
    (Strategy(s_p=5), "does not divide the GPU count"),
    (Strategy(s_os=12), "intra-node first"),  # divides 48 but neither divides nor fills nodes
    (Strategy(s_p=4, s_g=2, s_os=8), "must nest"),
    (Strategy(s_g=16, s_os=8), "must nest"),
    (Strategy(s_p=16, s_g=16, s_os=16, hpz=16), "must divide the node size"),
    (Strategy(s_p=8, s_g=8, s_os=8, hpz=8), "needs p > hpz"),
    (Strategy(s_p=16, s_g=16, s_os=16, hpz=3), "must divide the node size"),
    (Strategy(qwz=True), "drop qwz"),
    (Strategy(qgz=True), "drop qgz"),
])
def test_check_rejects_invalid_points(s, needle):
    with pytest.raises(ValueError, match=needle):
        s.check(48, 8)


def test_check_accepts_amsp_points():
    for s in (Strategy(), Strategy(s_os=8), Strategy(s_p=2, s_g=8, s_os=16),
              Strategy(s_p=16, s_g=16, s_os=48, qwz=True, hpz=8, qgz=True)):
        s.check(48, 8)


def test_n_micro_and_pinned_accumulation():
    s = Strategy(micro_batch=2)
    assert s.n_micro(batch_seqs=1024, num_gpus=64) == 8
    with pytest.raises(ValueError, match="not a multiple"):
        s.n_micro(batch_seqs=96, num_gpus=64)
    with pytest.raises(ValueError, match="ga=4 does not match"):
        s.with_(grad_accum=4).n_micro(batch_seqs=1024, num_gpus=64)


# ----- named baselines (DESIGN.md 1) ----------------------------------------------------------
def test_named_baselines_are_points_of_the_space():
    n, r = 64, 8
    b = named_baselines(n, r)
    assert [(b[k].s_p, b[k].s_g, b[k].s_os) for k in ("ddp", "zero1", "zero2", "zero3")] == [
        (1, 1, 1), (1, 1, 64), (1, 64, 64), (64, 64, 64)]
    assert (b["hsdp"].s_p, b["hsdp"].s_os) == (8, 8)  # shard in the node, replicate across
    assert (b["mics"].s_p, b["mics"].s_os) == (16, 16)  # MiCS: groups of two nodes
    zpp = b["zeropp"]
    assert (zpp.s_p, zpp.qwz, zpp.hpz, zpp.qgz) == (64, True, 8, True)
    for s in b.values():
        s.check(n, r)


def test_mics_is_dropped_where_it_equals_hsdp_or_zero3():
    assert "mics" not in named_baselines(16, 8)  # 2R = N: that is ZeRO-3
    assert "mics" in named_baselines(32, 8)


def test_baseline_aliases_and_options():
    assert baseline("fsdp", 32, 8) == baseline("zero3", 32, 8)
    assert baseline("mics-8", 32, 8).s_p == 8
    s = parse_strategy_or_baseline("zero3,mb=2,ckpt", 32, 8)
    assert (s.s_p, s.micro_batch, s.ckpt) == (32, 2, True)
    assert parse_strategy_or_baseline("p=2,g=8,os=16", 32, 8) == Strategy(s_p=2, s_g=8, s_os=16)
    with pytest.raises(AmspUserError, match="unknown baseline"):
        baseline("zero4", 32, 8)


@pytest.mark.parametrize("n", [24, 40, 56, 8, 16, 1024])
def test_default_mics_adapts_to_jobs_two_nodes_do_not_divide(n):
    s = baseline("mics", n, 8)
    s.check(n, 8)  # every named baseline can run on the job
    assert s.s_p == (16 if n % 16 == 0 else min(n, 8))


@pytest.mark.parametrize("text, canonical, value", [
    ("p=8,g=8,os=8,mb=1,ckpt=12", "p=8,g=8,os=8,mb=1,ckpt=12", 12),
    ("p=8,g=8,os=8,mb=1,ckpt=op", "p=8,g=8,os=8,mb=1,ckpt=op", "op"),
    ("p=8,g=8,os=8,mb=1,ckpt=full", "p=8,g=8,os=8,mb=1,ckpt", True),
    ("p=8,g=8,os=8,mb=1,ckpt=none", "p=8,g=8,os=8,mb=1", False),
    ("p=8,g=8,os=8,mb=1,ckpt=0", "p=8,g=8,os=8,mb=1", False),
    ("p=8,g=8,os=8,mb=1,ckpt", "p=8,g=8,os=8,mb=1,ckpt", True),
])
def test_checkpointing_forms_round_trip(text, canonical, value):
    s = Strategy.parse(text)
    assert str(s) == canonical and s.ckpt_value == value and type(s.ckpt_value) is type(value)
    assert Strategy.parse(str(s)) == s


def test_a_baseline_keeps_partial_checkpointing():
    from amsp_planner.strategy import parse_strategy_or_baseline

    assert str(parse_strategy_or_baseline("zero3,ckpt=5", 16, 8)) == "p=16,g=16,os=16,mb=1,ckpt=5"
