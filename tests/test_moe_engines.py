"""The expert search keeps to what the engine runs (engine_experts.py, docs/moe.md "Engines"):
every candidate of ``amsp plan --engine T`` is a setting T's export expresses exactly, and the
ILP still equals the brute force over the restricted space (and with the MoE job settings of
test_moe_dispatch.py)."""

from __future__ import annotations

import pytest
from amsp_testlib import assert_user_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_moe_solver import tiny_moe
from test_solver import check_against_brute_force

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.engines import ENGINES, profile
from amsp_planner.exports.moe import with_experts
from amsp_planner.solver import SearchSpace
from amsp_planner.specs import TrainingSpec, load_cluster
from amsp_planner.strategy import Strategy


def engine_job(engine, experts=4, gpus=8, per_node=4, layers=2, **training):
    c = load_cluster("dgx-h100-ndr", {"gpus_per_node": per_node})
    t = TrainingSpec(seq_len=512, global_batch_seqs=gpus, **training)
    return Job.create(tiny_moe(layers, experts), c, t, gpus, engine=engine)


def _dense(s: Strategy) -> Strategy:
    return s.with_(ep=1, ep_span=False, ep_p=None, ep_g=None, ep_os=None)


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "amsp"])
def test_every_candidate_is_a_setting_the_engines_export_expresses(engine):
    job = engine_job(engine)
    cands = list(SearchSpace.for_job(job).candidates(job))
    assert cands
    dense = list(dict.fromkeys(_dense(s) for s in cands))
    expressible = set(with_experts(engine, 4, 8, 4, dense))
    for s in cands:
        # at e = 1 an engine without its own expert mesh shards the experts as the rest
        plain = _dense(s) if s.ep == 1 and (s.ep_p, s.ep_g, s.ep_os) == (
            s.s_p, s.s_g, s.s_os) else s
        assert plain in expressible or s in expressible, (engine, s.to_string())


def test_each_engines_rule_by_hand():
    eps = {e: {(s.ep, s.ep_span) for s in SearchSpace.for_job(engine_job(e)).candidates(
        engine_job(e))} for e in ENGINES}
    # InternEvo: no expert parallelism here
    assert eps["internevo"] == {(1, False)}
    # torchtitan and Megatron-Core: EP groups of consecutive ranks only
    assert all(not span for _, span in eps["torchtitan"] | eps["megatron"])
    # DeepSpeed AutoEP and the bundled runtime: both placements (8 GPUs, 2 nodes of 4: e = 2
    # strided across the nodes exists)
    assert (2, True) in eps["deepspeed"] and (2, True) in eps["amsp"]
    tt = engine_job("torchtitan")
    for s in SearchSpace.for_job(tt).candidates(tt):  # experts (s/e)^3 under dense s^3
        assert (s.ep_p, s.ep_g, s.ep_os) == (s.s_p // s.ep,) * 3
    mg = engine_job("megatron")
    for s in SearchSpace.for_job(mg).candidates(mg):  # DDP or the distributed optimizer
        assert (s.s_p, s.s_g) == (1, 1) and s.ep_os == (1 if s.s_os == 1 else 8 // s.ep)


def test_a_pinned_degree_the_engine_does_not_run_is_one_line():
    code, out, err = run_cli(["plan", "--model", "qwen3-30b-a3b", "--gpus", "16",
                              "--engine", "internevo", "--ep", "8", "--activation-profile", "fused"])
    assert_user_error(code, out, err, "--ep 8", "InternEvo", "--engine")
    assert profile("internevo").expert_rule == "none"


instances = st.fixed_dictionaries({
    "engine": st.sampled_from(ENGINES),
    "experts": st.sampled_from([2, 4, 8]),
    "per_node": st.sampled_from([2, 4]),
    "nodes": st.sampled_from([1, 2]),
    "limit_frac": st.floats(min_value=0.05, max_value=1.2),
    "objective": st.sampled_from(["time", "comm"]),
    "dispatch": st.sampled_from(["copies", "ranks"]),
    "routing": st.sampled_from(["uniform", "round_robin"]),
    "master": st.booleans(),
})


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_ilp_equals_brute_force_within_each_engines_expert_rule(p):
    gpus = p["per_node"] * p["nodes"]
    # the MoE job settings too (docs/moe.md, "Dispatch, routing and state dtypes")
    job = engine_job(p["engine"], p["experts"], gpus, p["per_node"], layers=1,
                     expert_dispatch=p["dispatch"], expert_routing=p["routing"],
                     master_weights=p["master"])
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * p["limit_frac"], False, p["objective"], None)
