"""The search over a mixture of experts' space (docs/moe.md): the ILP against the brute force
on randomised MoE instances, and the regimes the expert class adds."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solver import check_against_brute_force

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.solver import SearchSpace
from amsp_planner.solver import solve as _solve
from amsp_planner.solver.brute import brute_force
from amsp_planner.solver.space import FASTEST
from amsp_planner.specs import ModelSpec, TrainingSpec, load_cluster
from amsp_planner.strategy import Strategy

GIB = 1024**3
solve = functools.partial(_solve, preference=FASTEST)


def tiny_moe(layers=2, experts=4, k=2, shared=0, dense=(), h=256, fe=128) -> ModelSpec:
    return ModelSpec(name="tiny-moe", num_layers=layers, hidden_size=h, num_heads=4,
                     num_kv_heads=2, ffn_hidden_size=4 * h, vocab_size=1024, num_experts=experts,
                     experts_per_token=k, expert_ffn_hidden_size=fe,
                     shared_expert_ffn_hidden_size=shared, dense_layers=dense)


def moe_job(model, cluster, gpus, gpus_per_node, seqs_per_gpu=1, seq_len=512, **train):
    c = load_cluster(cluster, {"gpus_per_node": gpus_per_node})
    t = TrainingSpec(seq_len=seq_len, global_batch_seqs=gpus * seqs_per_gpu, **train)
    return Job.create(model, c, t, gpus)


instances = st.fixed_dictionaries({
    "experts": st.sampled_from([2, 4, 4, 8]),
    "k": st.sampled_from([1, 2]),
    "layers": st.sampled_from([1, 2]),
    "shared": st.sampled_from([0, 0, 256]),
    "first_dense": st.booleans(),
    "h": st.sampled_from([256, 1024]),
    "cluster": st.sampled_from(["dgx-h100-ndr", "dgx-a100-hdr", "eth-100g"]),
    "gpus_per_node": st.sampled_from([2, 4]),
    "nodes": st.sampled_from([1, 2]),
    "seqs_per_gpu": st.sampled_from([1, 1, 1, 2]),
    "limit_frac": st.floats(min_value=0.05, max_value=1.2),
    "objective": st.sampled_from(["time", "time", "comm"]),
    "imbalance": st.sampled_from([1.0, 1.0, 1.6]),
    "profile": st.sampled_from(["eager", "fused"]),
})


def instance_job(p, **train) -> Job:
    """The job of a randomised instance `p` (the keys of ``instances``)."""
    layers = p["layers"]
    dense = (0,) if p["first_dense"] and layers > 1 else ()
    model = tiny_moe(layers, p["experts"], p["k"], p["shared"], dense, p["h"])
    gpus = p["gpus_per_node"] * p["nodes"]
    return moe_job(model, p["cluster"], gpus, p["gpus_per_node"], p["seqs_per_gpu"],
                   expert_imbalance=p["imbalance"], **train)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_ilp_equals_brute_force_on_moe(p):
    job = instance_job(p, activation_profile=p["profile"])
    gpus = job.num_gpus
    # the space holds every (e, placement) the job admits, the expert factors with each
    space = SearchSpace.for_job(job)
    eps = {(sp.ep, sp.ep_span) for sp in space.by_tp()}
    assert {e for e, _ in eps} == {e for e in (1, 2, 4, 8) if e <= min(p["experts"], gpus)
                                   and p["experts"] % e == 0 and gpus % e == 0}
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * p["limit_frac"], False, p["objective"], None)


def test_partial_checkpointing_range_of_a_moe_model_matches_the_brute_force():
    # four layers: K = 1..4 blocks is one option with a slope (solver/tables.py), the
    # all-to-all buffers counted once; a limit that makes checkpointing bind
    # (and with a first dense layer: K = 1 apart, the range from K = 2, past which the
    # recomputed all-to-alls grow by one layer's per block)
    for dense in ((), (0,)):
        model = tiny_moe(layers=4 + len(dense), experts=4, h=1024, fe=512, dense=dense)
        job = moe_job(model, "dgx-h100-ndr", 8, 4, seqs_per_gpu=2, seq_len=2048)
        ddp = evaluate(job, Strategy(), float("inf")).memory.total
        for frac in (0.35, 0.5, 0.8):
            check_against_brute_force(job, ddp * frac, False, "time", None)


def qwen3_like(layers=48) -> ModelSpec:
    return ModelSpec(name="q3moe", num_layers=layers, hidden_size=2048, num_heads=32,
                     num_kv_heads=4, head_dim=128, ffn_hidden_size=6144, vocab_size=151936,
                     qk_norm="head", num_experts=128, experts_per_token=8,
                     expert_ffn_hidden_size=768)


def test_an_expert_triple_unlike_the_dense_one_is_the_optimum():
    # Qwen3-30B-A3B's shapes with 4 layers on 2 nodes of 8 H100s, one sequence of 4096 per
    # GPU. The brute force's optimum keeps the token all-to-alls inside each node (e = 8, 16
    # experts per layer on each rank) and the experts whole on the two ranks that hold the
    # same ones (one per node: expert triple (1, 1, 1), their gradients all-reduced across
    # the nodes once per step), while the dense class shards its optimizer state over all 16
    # ranks (once per step, nearly free) and keeps parameters and gradients whole. (e = 16
    # would send half of every all-to-all over the NICs, each rank at 1/8 of its node's.)
    job = moe_job(qwen3_like(4), "dgx-h100-ndr", 16, 8, seq_len=4096)
    space = SearchSpace.for_job(job, micro_batch=1)
    best = brute_force(job, space, job.cluster.memory_bytes)[0].strategy
    got = solve(job, micro_batch=1).best.strategy
    assert got == best
    assert (best.ep, best.ep_span, best.s_p, best.s_g, best.s_os) == (8, False, 1, 1, 16)
    assert (best.ep_p, best.ep_g, best.ep_os) == (1, 1, 1)
    assert (best.ep_p, best.ep_g, best.ep_os) != (best.s_p, best.s_g, best.s_os)


def test_expert_parallelism_inside_the_node_beats_spanning_nodes():
    # Qwen3-30B-A3B's shapes on 8 nodes of 8 H100s, 2 micro-batches of one 4096-token
    # sequence, full checkpointing; e = 8 either way. Each all-to-all call moves
    # b s k h x 2 B = 4096 x 8 x 2048 x 2 = 128 MiB, 7/8 of it to other ranks: inside the node
    # over NVLink, spanning the nodes over the NICs (one member per node). With 2 x 48 calls
    # per micro-batch in forward, backward and the recomputed forward, spanning puts
    # 3 x 96 x 2 x 7/8 x 128 MiB = 63 GiB per rank per step on the NICs, in-node none; the
    # gathers of the experts then cross nodes in-node (the 8 ranks holding the same experts
    # are one per node) but stay on NVLink spanning. The planner, pinned to e = 8, picks
    # in-node, and is faster than the best spanning plan.
    job = moe_job(qwen3_like(), "dgx-h100-ndr", 64, 8, seqs_per_gpu=2, seq_len=4096,
                  activation_checkpointing=True)
    res = solve(job, ep=8, micro_batch=1)
    assert res.best.strategy.ep == 8 and not res.best.strategy.ep_span
    span = [e for e in res.runners_up + [res.best] if e.strategy.ep_span]
    a2a_in = sum(e.inter_bytes_per_rank_per_step for e in res.best.schedule if e.group == "EP")
    assert a2a_in == 0
    from amsp_planner.solver.ilp import StrategyIlp

    sp = next(s for s in SearchSpace.for_job(job, micro_batch=1, ep=8).by_tp() if s.ep_span)
    sol = StrategyIlp(job, sp, job.cluster.memory_bytes * 0.999).solve()[0][0]
    spanning = evaluate(job, sol.strategy)
    a2a = sum(e.inter_bytes_per_rank_per_step for e in spanning.schedule if e.group == "EP")
    assert a2a == 3 * 96 * 2 * 7 / 8 * 128 * 2**20
    assert res.best.step_s < spanning.step_s
    assert not span or min(e.step_s for e in span) >= res.best.step_s


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_the_planners_rule_on_moe_matches_the_brute_force(p):
    # the default rule (band, headroom, least recompute, fewest process groups, least
    # memory): the ILP's choice is the brute force's first
    from amsp_planner.solver.space import Preference

    layers = p["layers"]
    model = tiny_moe(layers, p["experts"], p["k"], p["shared"], (), p["h"])
    gpus = p["gpus_per_node"] * p["nodes"]
    job = moe_job(model, p["cluster"], gpus, p["gpus_per_node"], p["seqs_per_gpu"],
                  expert_imbalance=p["imbalance"])
    pref = Preference.default(job=job)
    limit = evaluate(job, Strategy(), float("inf")).memory.total * p["limit_frac"]
    oracle = brute_force(job, SearchSpace.for_job(job), limit, preference=pref)
    for solver in ("highs", "exhaustive"):
        if not oracle:
            continue
        got = _solve(job, limit, preference=pref, solver=solver, runners_up=0).best
        assert got.strategy == oracle[0].strategy, (solver, got.strategy, oracle[0].strategy)
