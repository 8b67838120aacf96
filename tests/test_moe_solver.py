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


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_ilp_equals_brute_force_on_moe(p):
    layers = p["layers"]
    dense = (0,) if p["first_dense"] and layers > 1 else ()
    model = tiny_moe(layers, p["experts"], p["k"], p["shared"], dense, p["h"])
    gpus = p["gpus_per_node"] * p["nodes"]
    job = moe_job(model, p["cluster"], gpus, p["gpus_per_node"], p["seqs_per_gpu"],
                  expert_imbalance=p["imbalance"], activation_profile=p["profile"])
    # the space holds every (e, placement) the job admits, the expert factors with each
    space = SearchSpace.for_job(job)
    eps = {(sp.ep, sp.ep_span) for sp in space.by_tp()}
    assert {e for e, _ in eps} == {e for e in (1, 2, 4, 8) if e <= min(p["experts"], gpus)
                                   and p["experts"] % e == 0 and gpus % e == 0}
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    check_against_brute_force(job, ddp * p["limit_frac"], False, p["objective"], None)
