"""What an engine's MoE kernels change in the price: a dispatch that sends a token once per
destination rank (DeepEP), the routing pattern it meets, a model held without an fp32 master
copy, and the fused SwiGLU of the experts (docs/moe.md, "Dispatch, routing and state dtypes").
Every figure is derived by hand or by enumeration here."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
from amsp_testlib import make_job, run_cli
from pydantic import ValidationError
from test_moe_cost import A2A_CALL, EXPERTS_PER_RANK_E8, S_IN, TOKENS, job64

from amsp_planner.cost.compute import _rates, block_compute
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.moe_compute import moe_layer_elementwise
from amsp_planner.cost.moe_schedule import dispatch_copies
from amsp_planner.specs import ModelSpec, TrainingSpec
from amsp_planner.strategy import Strategy


def tiny(E: int, k: int) -> ModelSpec:
    return ModelSpec(name="t", num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                     vocab_size=256, num_experts=E, experts_per_token=k,
                     expert_ffn_hidden_size=32)


def ranks_job(E: int, k: int, routing: str):
    return make_job(8, tiny(E, k), expert_dispatch="ranks", expert_routing=routing)


def _ranks_of(experts, local):
    return len({x // local for x in experts})


@pytest.mark.parametrize("E,k,ep", [(8, 2, 4), (8, 3, 2), (16, 4, 8), (6, 2, 2), (8, 8, 8)])
def test_uniform_routing_reaches_the_enumerated_mean_of_distinct_ranks(E, k, ep):
    # the oracle: every k-subset of the E experts, equally likely; rank = expert // (E/ep)
    subsets = list(itertools.combinations(range(E), k))
    want = Fraction(sum(_ranks_of(c, E // ep) for c in subsets), len(subsets))
    assert dispatch_copies(ranks_job(E, k, "uniform"), ep) == pytest.approx(float(want))


def test_round_robin_routing_by_hand():
    # E=6, k=2, ep=2 (3 experts per rank): token 0 -> {0,1}: rank 0; token 1 -> {2,3}: ranks
    # 0 and 1; token 2 -> {4,5}: rank 1; then it repeats: (1 + 2 + 1) / 3
    assert dispatch_copies(ranks_job(6, 2, "round_robin"), 2) == pytest.approx(4 / 3)
    # E=8, k=2, ep=4: every token's two experts are one rank's pair
    assert dispatch_copies(ranks_job(8, 2, "round_robin"), 4) == 1.0
    # Qwen3-30B-A3B at ep=8 (16 experts a rank, 8 consecutive from a multiple of 8): one rank
    j = job64(expert_dispatch="ranks", expert_routing="round_robin")
    assert dispatch_copies(j, 8) == 1.0
    # at ep=32 (4 a rank) the 8 consecutive experts cover 2 ranks
    assert dispatch_copies(j, 32) == 2.0


def test_copies_are_k_and_no_expert_parallelism_sends_nothing_more():
    assert dispatch_copies(job64(), 8) == 8
    assert dispatch_copies(ranks_job(8, 2, "uniform"), 1) == 2  # e = 1: no all-to-all at all


def test_a_per_rank_dispatch_sends_one_copy_of_each_token_under_the_round_robin_gate():
    s = Strategy.parse(S_IN)
    ev = evaluate(job64(expert_dispatch="ranks", expert_routing="round_robin"), s)
    a = {(e.phase, e.op): e for e in ev.schedule}["forward", "all_to_all"]
    # b s h x 2 bytes per call: 1/8 of the per-copy buffer (k = 8)
    assert a.full_bytes_per_step == a.calls_per_step * TOKENS * 2048 * 2
    assert a.full_bytes_per_step * 8 == a.calls_per_step * A2A_CALL
    assert ev.memory.dispatch_buffers == 2 * TOKENS * 2048 * 2


def test_without_master_weights_every_state_is_in_the_parameters_dtype():
    s = Strategy.parse(S_IN)  # expert triple 8, 8, 8 over the EDP group of 8
    # fp32 gradient reduction on the wire does not make the bf16 gradient shard fp32
    mem = evaluate(job64(master_weights=False, grad_accum_dtype="fp32"), s).memory
    per_rank = EXPERTS_PER_RANK_E8 / 8
    assert mem.expert_params == per_rank * 2
    assert mem.expert_grads == per_rank * 2
    assert mem.expert_optimizer == per_rank * 4  # Adam's m and v in bf16
    dense = sum(job64().units) / 64
    assert (mem.params, mem.grads, mem.optimizer) == (dense * 2, dense * 2, dense * 4)
    base = evaluate(job64(grad_accum_dtype="fp32"), s).memory
    assert base.expert_optimizer == per_rank * 12 and base.expert_grads == per_rank * 4


def test_fused_profiles_run_the_expert_swiglu_as_one_kernel():
    # per routed copy: SwiGLU 5 f_e eager, 3 f_e fused (read gate and up, write the product),
    # and the permutation copies 4 h; Qwen3-30B-A3B: k 8, f_e 768, h 2048
    assert moe_layer_elementwise(job64()) == 8 * (5 * 768 + 4 * 2048)
    assert moe_layer_elementwise(job64(), fused=True) == 8 * (3 * 768 + 4 * 2048)
    # and the block's forward prices it: the fused job's is the faster by exactly that
    # traffic, 2 x 768 elements x k x 2 bytes per token at the HBM rate, per MoE layer
    eager = block_compute(job64(activation_profile="eager"), 1, False, ep=8).forward
    fused = block_compute(job64(activation_profile="fused"), 1, False, ep=8).forward
    r = _rates(job64())
    assert eager - fused == pytest.approx(TOKENS * 2 * 768 * 8 * 2 / r.hbm)


def test_a_per_rank_dispatch_permutes_its_received_copies_into_the_expert_rows():
    # DeepEP delivers c copies of a token (c = 1 under the round-robin gate at e = 8); the
    # permutation expands them into the k = 8 expert rows and sums them back: 2 (1 + 8) h per
    # token instead of 4 k h = 32 h
    j = job64(expert_dispatch="ranks", expert_routing="round_robin")
    assert moe_layer_elementwise(j, ep=8) == 8 * 5 * 768 + 2 * (1 + 8) * 2048
    assert moe_layer_elementwise(job64(), ep=8) == 8 * 5 * 768 + 4 * 8 * 2048
    assert moe_layer_elementwise(j, ep=1) == 8 * 5 * 768 + 4 * 8 * 2048  # no dispatch


def test_defaults_stay_out_of_the_dump_and_bad_values_are_refused():
    t = TrainingSpec(seq_len=128, global_batch_seqs=8)
    dumped = t.model_dump()
    assert not {"expert_dispatch", "expert_routing", "master_weights"} & set(dumped)
    t2 = TrainingSpec(seq_len=128, global_batch_seqs=8, expert_dispatch="ranks",
                      master_weights=False)
    assert t2.model_dump()["expert_dispatch"] == "ranks"
    assert TrainingSpec(**t2.model_dump()) == t2
    with pytest.raises(ValidationError):
        TrainingSpec(seq_len=128, global_batch_seqs=8, expert_dispatch="deepep")


def test_an_all_to_all_over_whole_nodes_shares_the_nodes_nics_among_their_ranks():
    # 16 ranks on 2 nodes of 8 (an EP group of whole nodes): every rank sends half its buffer
    # to the other node at once, so each gets 1/8 of its node's NIC bandwidth, not all of it
    job = job64()
    topo = job.topology
    B = 2**30
    per_rank = topo.node_bw / 8
    want = 0.5 * B / per_rank  # plus NCCL's latency, tens of microseconds
    assert 0 < topo.collective_time("all_to_all", 16, 1, B) - want < 50e-6
    # one rank per node (the spanning placement) gets its own NIC: the same bytes, same time
    assert 0 < topo.collective_time("all_to_all", 2, 8, B) - want < 50e-6


def test_the_cli_sets_them_and_the_plan_file_keeps_them(tmp_path):
    out = tmp_path / "p.json"
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--cluster", "dgx-h100-ndr",
            "--engine", "fsdp2", "--global-batch-seqs", "64", "--seq-len", "4096",
            "--micro-batch", "1", "--activation-checkpointing", "on", "--ep", "8"]
    code, _, err = run_cli([*base, "--expert-dispatch", "ranks", "--expert-routing",
                            "round_robin", "--no-master-weights", "-o", str(out)])
    assert code == 0, err
    t = json.loads(out.read_text())["inputs"]["training"]
    assert (t["expert_dispatch"], t["expert_routing"], t["master_weights"]) == (
        "ranks", "round_robin", False)
    code, _, err = run_cli(["validate", str(out)])
    assert code == 0, err
