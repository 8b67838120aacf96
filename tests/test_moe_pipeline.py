"""Pipeline stages of a mixture of experts (pp=P with ep=e): the charged (last) stage holds its
own layers, re-indexed, its experts and their all-to-alls stay inside the stage's N/P ranks,
against hand counts; the planner's --pp search and the Megatron export (docs/moe.md,
"Pipeline stages")."""

from __future__ import annotations

import json

import pytest
from amsp_testlib import make_job, run_cli
from test_moe_cost import A2A_CALL, qwen3_like

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.pipeline import stage_job, stage_model
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy

ONE_EXPERT = 4_718_592  # 3 x 2048 x 768 (test_moe_cost's hand count)


def test_the_stage_model_is_the_last_layers_re_indexed():
    # DeepSeek-V3: 62 blocks (61 and the MTP module), dense layers 0-2: the last stage of four
    # holds blocks 46-61, none dense, the MTP module its last
    ds = stage_model(load_model("deepseek-v3"), 16)
    assert (ds.num_layers, ds.dense_layers, ds.mtp_layers, ds.num_moe_layers) == (16, (), 1, 16)
    # gpt-oss-120b: 36 blocks, the even ones sliding; the last 9 are 27-35, of which 28, 30,
    # 32, 34 slide: the stage's blocks 1, 3, 5, 7
    go = stage_model(load_model("gpt-oss-120b"), 9)
    assert (go.num_layers, go.sliding_layers) == (9, (1, 3, 5, 7))
    # a stage reaching into the dense layers keeps them at their new index
    m = qwen3_like(num_layers=8, dense_layers=(0, 1, 2, 3, 4))
    assert stage_model(m, 4).dense_layers == (0,)  # block 4 is the stage's first
    assert stage_model(m, 4).num_moe_layers == 3


def _job(layers=8, dense=(0, 1), gpus=16, batch=32, **training):
    return make_job(gpus, qwen3_like(num_layers=layers, dense_layers=dense),
                    cluster="dgx-h100-ndr", seq_len=4096, batch_seqs=batch, **training)


def _entry(ev, phase, op, group):
    (e,) = [x for x in ev.schedule if (x.phase, x.op, x.group) == (phase, op, group)]
    return e


def test_the_stage_routes_only_its_own_layers_tokens():
    # 16 GPUs, pp=2: a stage is 8 GPUs, EP 8 inside it, DP 8; batch 32, mb=1: m = 4 micro-
    # batches of one 4096-token sequence. The last stage's 4 blocks are all MoE layers (the
    # model's dense ones, 0 and 1, sit in the first stage): per micro-batch 4 layers x 2
    # all-to-alls (dispatch, combine) of b s k h x 2 bytes each.
    job = _job()
    ev = evaluate(job, Strategy.parse("pp=2,ep=8,p=1,g=1,os=8,ep.p=1,ep.g=1,ep.os=1,mb=1"))
    assert ev.n_micro == 4
    a = _entry(ev, "forward", "all_to_all", "EP")
    assert (a.group_size, a.members_per_node) == (8, 8)
    assert a.calls_per_step == 2 * 4 * 4
    assert a.full_bytes_per_step == 2 * 4 * 4 * A2A_CALL


def test_the_stage_holds_its_layers_experts():
    # the same job: a rank holds E/e = 16 experts of each of the stage's 4 MoE layers, whole
    # (ep.p = 1, ep.g = 1, ep.os = 1: the stage's 8 ranks are one EP group): bf16 parameters
    # and gradients, 12 bytes of fp32 master weights and Adam moments per parameter
    job = _job()
    ev = evaluate(job, Strategy.parse("pp=2,ep=8,p=1,g=1,os=8,ep.p=1,ep.g=1,ep.os=1,mb=1"))
    per_rank = 4 * 16 * ONE_EXPERT
    assert ev.memory.expert_params == per_rank * 2
    assert ev.memory.expert_grads == per_rank * 2
    assert ev.memory.expert_optimizer == per_rank * 12
    # unpipelined on the same 16 GPUs the rank holds all 6 MoE layers' 16 experts: 6/4 as much
    flat = evaluate(job, Strategy.parse("ep=8,p=1,g=1,os=16,ep.p=1,ep.g=1,ep.os=2,mb=1"))
    assert flat.memory.expert_params == 6 * 16 * ONE_EXPERT * 2


def test_the_bubble_is_p_minus_1_over_m_of_the_stages_micro_batch_work():
    # 1F1B (Narayanan et al. 2021, sec. 2.2.1): (P - 1) micro-batches of the stage's work,
    # the all-to-alls included (they sit on the compute stream)
    job = _job()
    t = evaluate(job, Strategy.parse("pp=2,ep=8,p=1,g=1,os=8,ep.p=1,ep.g=1,ep.os=1,mb=1")).time
    assert t.ep_comm_s > 0
    per_mb = (t.compute_s + t.kernel_s + t.tp_comm_s + t.ep_comm_s + t.exposed_forward_s) / 4
    assert t.bubble_s == pytest.approx(1 * per_mb, rel=1e-12)


def test_stage_job_keeps_the_engine_batch_and_the_experts():
    job = _job()
    sj = stage_job(job, Strategy(pp=2))
    assert sj.num_gpus == 8 and sj.model.num_experts == 128
    assert sj.training.global_batch_seqs == job.training.global_batch_seqs


def test_plan_with_pp_searches_a_moe_model_and_exports_to_megatron(tmp_path):
    plan = tmp_path / "plan.json"
    code, out, err = run_cli(["plan", "--model", "gpt-oss-120b", "--gpus", "64", "--pp", "4",
                              "--engine", "megatron", "--cluster", "dgx-h100-ndr", "-o",
                              str(plan)])
    assert code == 0, err
    doc = json.loads(plan.read_text())
    s = Strategy.parse(doc["predictions"]["strategy"])
    assert s.pp == 4 and s.ep > 1 and doc["predictions"]["fits"]
    # the MoE runs' band, not the dense one, on every number of a MoE plan
    from amsp_planner.validation import error_bands

    moe = error_bands()["moe"]["step_time"]["p90_abs_error"]
    assert doc["predictions"]["bands"]["step_time"] >= moe
    code, out, err = run_cli(["export", str(plan), "--to", "megatron"])
    assert code == 0, err
    assert "--pipeline-model-parallel-size 4" in out
    assert f"--expert-model-parallel-size {s.ep}" in out


def test_the_search_bisects_on_the_memory_evaluate_gives():
    # pipeline_memory is what the --pp search bisects on: evaluate's memory, without the
    # schedule and step time, for MoE and dense stages, at block checkpointing K = L too
    from amsp_planner.cost.pipeline import pipeline_memory

    moe = _job()
    dense = make_job(16, load_model("llama-7b"), cluster="dgx-h100-ndr", seq_len=2048,
                     batch_seqs=64)
    for job, s in ((moe, "pp=2,ep=8,p=1,g=1,os=8,ep.p=1,ep.g=1,ep.os=1,mb=1"),
                   (moe, "pp=2,ep=4,p=8,g=8,os=8,ep.p=2,ep.g=2,ep.os=2,mb=2,ckpt=2"),
                   (moe, "pp=2,ep=8,p=1,g=1,os=8,ep.p=1,ep.g=1,ep.os=1,mb=1,ckpt=4"),
                   (dense, "tp=2,pp=2,p=4,g=4,os=4,mb=1,ckpt=8"),
                   (dense, "pp=4,vpp=2,p=1,g=1,os=4,mb=2,ckpt")):
        st = Strategy.parse(s)
        assert pipeline_memory(job, st).total == evaluate(job, st).memory.total, s


def test_a_search_too_large_to_enumerate_is_one_line_exit_2(monkeypatch):
    # gpt-oss-120b's stage on the amsp engine holds 280,280 candidates (every nested expert
    # triple under every dense one): past the deadline the search stops and names the pins
    from amsp_testlib import assert_user_error

    from amsp_planner.solver import pipeline_search

    monkeypatch.setattr(pipeline_search, "SEARCH_DEADLINE_S", 0.0)
    code, out, err = run_cli(["plan", "--model", "gpt-oss-120b", "--gpus", "64", "--pp", "4",
                              "--cluster", "dgx-h100-ndr"])
    assert_user_error(code, out, err, "--pp 4", "--ep E", "--micro-batch B")


def test_the_stage_space_is_counted_without_building_it():
    # the refusal before the enumeration counts dense candidates x nested expert triples:
    # the same number the enumeration yields (the amsp engine pairs every triple with all)
    from amsp_planner.solver.pipeline_search import _counted
    from amsp_planner.solver.space import SearchSpace

    job = _job()
    sj = stage_job(job, Strategy(pp=2))
    space = SearchSpace.for_job(sj)
    assert _counted(space, sj) == space.size(sj) > 1000
