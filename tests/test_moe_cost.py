"""The mixture-of-experts cost model: both classes' schedules, the token all-to-alls, memory per
class and the expert matmuls, against hand-derived figures (docs/moe.md)."""

from __future__ import annotations

import pytest
from amsp_testlib import make_job

from amsp_planner.cost.compute import _rates, block_compute
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import ModelSpec
from amsp_planner.strategy import Strategy


def qwen3_like(**changes) -> ModelSpec:
    """Qwen3-30B-A3B's shapes (48 layers, h 2048, 128 experts of width 768, top-8)."""
    f = dict(name="q3moe", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
             head_dim=128, ffn_hidden_size=6144, vocab_size=151936, qk_norm="head",
             num_experts=128, experts_per_token=8, expert_ffn_hidden_size=768)
    f.update(changes)
    return ModelSpec(**f)


def job64(**training):
    return make_job(64, qwen3_like(), cluster="dgx-h100-ndr", seq_len=4096, batch_seqs=128,
                    **training)


S_IN = "ep=8,p=64,g=64,os=64,ep.p=8,ep.g=8,ep.os=8,mb=1,ckpt"
S_SPAN = "ep=8,ep.span,p=64,g=64,os=64,ep.p=8,ep.g=8,ep.os=8,mb=1,ckpt"

# Hand counts. One expert: 3 x 2048 x 768 = 4,718,592. A layer's 128: 603,979,776; a rank's 16
# at e = 8: 75,497,472 = 36,864 x 2,048 (8 EDP ranks x 256), so no padding; 48 layers:
EXPERTS_PER_RANK_E8 = 48 * 75_497_472  # 3,623,878,656
TOKENS = 4096  # one sequence per micro-batch
A2A_CALL = TOKENS * 8 * 2048 * 2  # b s k h x 2 bytes = 134,217,728


def _entries(ev):
    return {(e.phase, e.op, e.group): e for e in ev.schedule}


def test_expert_units_are_a_ranks_experts_padded_over_its_edp_group():
    job = job64()
    assert sum(job.expert_units(8)) == EXPERTS_PER_RANK_E8
    # e = 1: every expert, 603,979,776 per layer = 36,864 x 16,384 (64 ranks x 256): exact
    assert sum(job.expert_units(1)) == 48 * 603_979_776
    # the dense class is everything else, padded to 64 x 256 per unit
    m = job.model
    dense = m.num_params - 48 * 603_979_776
    assert 0 <= sum(job.units) - dense < (m.num_layers + 2) * 64 * 256


def test_all_to_all_entries_by_hand():
    job = job64()
    n_micro = 2  # 128 sequences over 64 ranks, mb=1
    e = _entries(evaluate(job, Strategy.parse(S_IN)))
    for phase in ("forward", "backward", "recompute"):  # full checkpointing recomputes all 48
        a = e[phase, "all_to_all", "EP"]
        assert a.calls_per_step == 2 * 48 * n_micro
        assert a.full_bytes_per_step == 2 * 48 * n_micro * A2A_CALL
        # in the node: 7/8 of each buffer to the 7 peers over NVLink, none over the NIC
        assert a.intra_bytes_per_rank_per_step == pytest.approx(7 / 8 * a.full_bytes_per_step)
        assert a.inter_bytes_per_rank_per_step == 0
        assert (a.group_size, a.stride, a.members_per_node) == (8, 1, 8)
    span = _entries(evaluate(job, Strategy.parse(S_SPAN)))["forward", "all_to_all", "EP"]
    # spanning 8 nodes, one member each: 7/8 leaves the node
    assert (span.stride, span.members_per_node) == (8, 1)
    assert span.inter_bytes_per_rank_per_step == pytest.approx(7 / 8 * span.full_bytes_per_step)
    assert span.intra_bytes_per_rank_per_step == 0
    assert span.time_s > 3 * e["forward", "all_to_all", "EP"].time_s  # NIC vs NVLink


def test_imbalance_scales_the_all_to_all_and_its_buffers():
    s = Strategy.parse(S_IN)
    ev1, ev2 = evaluate(job64(), s), evaluate(job64(expert_imbalance=1.5), s)
    a1 = _entries(ev1)["forward", "all_to_all", "EP"]
    a2 = _entries(ev2)["forward", "all_to_all", "EP"]
    assert a2.full_bytes_per_step == 1.5 * a1.full_bytes_per_step
    assert ev1.memory.dispatch_buffers == 2 * A2A_CALL
    assert ev2.memory.dispatch_buffers == 2 * 1.5 * A2A_CALL
    assert ev2.time.compute_s > ev1.time.compute_s  # the busiest rank's expert matmuls


def test_expert_class_entries_run_over_the_edp_group():
    job = job64()
    e = _entries(evaluate(job, Strategy.parse(S_IN)))
    ag = e["forward", "all_gather", "EP_P"]
    # in-node EP of 8: the 8 ranks holding the same experts are one per node (stride 8)
    assert (ag.group_size, ag.stride, ag.members_per_node) == (8, 8, 1)
    assert ag.calls_per_step == 48 * 2
    assert ag.full_bytes_per_step == 2 * EXPERTS_PER_RANK_E8 * 2
    assert ag.inter_bytes_per_rank_per_step == pytest.approx(7 / 8 * ag.full_bytes_per_step)
    # spanning: they are the 8 ranks of one node, so the gathers stay on NVLink
    sp = _entries(evaluate(job, Strategy.parse(S_SPAN)))["forward", "all_gather", "EP_P"]
    assert (sp.stride, sp.members_per_node, sp.inter_bytes_per_rank_per_step) == (1, 8, 0)
    # the dense class keeps its own groups over all 64 ranks
    p = e["forward", "all_gather", "P"]
    assert (p.group_size, p.stride) == (64, 1) and p.calls_per_step == 50 * 2


def test_replicated_experts_sync_once_per_step():
    s = Strategy.parse("ep=8,p=64,g=64,os=64,ep.p=1,ep.g=1,ep.os=1,mb=1")
    e = _entries(evaluate(job64(), s))
    assert ("forward", "all_gather", "EP_P") not in e
    ar = e["grad_sync", "all_reduce", "EP_OS_replica"]
    assert (ar.group_size, ar.stride, ar.calls_per_step) == (8, 8, 48)
    assert ar.full_bytes_per_step == EXPERTS_PER_RANK_E8 * 2


def test_memory_per_class_by_hand():
    ev = evaluate(job64(), Strategy.parse(S_IN))
    mem = ev.memory
    assert mem.expert_params == EXPERTS_PER_RANK_E8 / 8 * 2
    assert mem.expert_grads == EXPERTS_PER_RANK_E8 / 8 * 2
    assert mem.expert_optimizer == EXPERTS_PER_RANK_E8 / 8 * 12
    u = 75_497_472  # the largest expert unit: gather + gradient buffers, two of each
    assert mem.expert_buffers == 2 * u * 2 + 2 * u * 2
    # the dense class's states on the dense triple
    assert mem.params == sum(job64().units) / 64 * 2


def test_expert_matmuls_run_below_large_matrix_efficiency_with_few_rows():
    job = job64()
    r = _rates(job)
    # the expert part's FLOPs per micro-batch: 2 x T k x 3 h f_e, forward
    flops = 2 * TOKENS * 8 * 3 * 2048 * 768
    ideal = flops / r.flop
    m8 = block_compute(job, 1, False, ep=8).forward
    m1 = block_compute(job, 1, False, ep=1).forward
    # e = 1: 128 experts of 256 rows each on the rank; e = 8: 16 experts of 2048 rows. The
    # same FLOPs, but the weight reads of 8x as many experts: slower, above the ideal.
    assert m1 - m8 > 0.3 * ideal  # e=1 pays for reading 8x the expert weights
    # and the imbalance multiplies the busiest rank's rows
    big = block_compute(job64(expert_imbalance=2.0), 1, False, ep=8).forward
    assert big > m8


def test_dense_strategy_on_moe_model_shards_experts_like_the_dense_triple():
    ev = evaluate(job64(), Strategy.parse("p=64,g=64,os=64,mb=1"))
    assert ev.memory.expert_params == 48 * 603_979_776 / 64 * 2
    assert "dispatch_buffers" not in ev.memory.to_dict()


@pytest.mark.parametrize("text, needle", [
    ("ep=3,p=64,g=64,os=64,mb=1", "ep=3"),
    ("ep=8,p=64,g=64,os=64,qwz,mb=1", "ZeRO++"),
])
def test_bad_moe_strategies_are_one_line(text, needle):
    with pytest.raises(AmspUserError) as e:
        job64().check(Strategy.parse(text))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_ep_on_a_dense_model_is_refused():
    job = make_job(8)
    with pytest.raises(AmspUserError, match="dense model"):
        job.check(Strategy.parse("ep=2,p=8,g=8,os=8,mb=1"))
