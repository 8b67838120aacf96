"""Exports of mixture-of-experts plans (issue #26 part 5): each engine's expert-parallel
setting, read back by the engine's own code where it installs here, its groups against the
engines' documented layouts, and the closest plan with its priced differences where the engine
cannot run the plan's expert setting."""

from __future__ import annotations

import json

import pytest

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.exports import deepspeed as ds
from amsp_planner.exports import export, fsdp2, megatron, torchtitan
from amsp_planner.exports.common import expressible, rank_key
from amsp_planner.exports.moe import RULES, expert_groups
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

N, R = 16, 8


@pytest.fixture(scope="module")
def job():
    return Job.create(load_model("qwen3-30b-a3b"), load_cluster("dgx-h100-ndr"),
                      TrainingSpec(seq_len=4096, global_batch_seqs=512), N)


def _s(text: str) -> Strategy:
    return Strategy.parse(text)


# ----- the engines' rules, by hand -------------------------------------------------------------
def test_deepspeed_applies_one_stage_to_both_classes():
    """Stage 0-3 over N ranks -> the same stage over the N/e expert-data-parallel ranks."""
    dense = {0: (1, 1, 1), 1: (1, 1, 16), 2: (1, 16, 16), 3: (16, 16, 16)}
    experts = {0: (1, 1, 1), 1: (1, 1, 4), 2: (1, 4, 4), 3: (4, 4, 4)}
    for stage, (p, g, o) in dense.items():
        c = Strategy(s_p=p, s_g=g, s_os=o)
        assert RULES["deepspeed"](c, 4, False, N, R) == [experts[stage]]
        assert RULES["deepspeed"](c, 4, True, N, R) == [experts[stage]]
    # AutoEP with ZeRO-3 refuses hpZ and qgZ (engine.py _validate_zero3_moe_compatibility)
    assert RULES["deepspeed"](Strategy(s_p=16, s_g=16, s_os=16, hpz=8), 4, False, N, R) == []
    assert RULES["deepspeed"](Strategy(s_p=4, s_g=4, s_os=4), 4, False, N, R) == []  # no stage


def test_torchtitan_shards_experts_over_shard_degree_over_ep():
    """efsdp = data_parallel_shard_degree / ep; EP innermost: never spanning."""
    assert RULES["torchtitan"](Strategy(s_p=16, s_g=16, s_os=16), 4, False, N, R) == [(4, 4, 4)]
    assert RULES["torchtitan"](Strategy(s_p=8, s_g=8, s_os=8), 4, False, N, R) == [(2, 2, 2)]
    assert RULES["torchtitan"](Strategy(s_p=8, s_g=8, s_os=8), 16, False, N, R) == []
    assert RULES["torchtitan"](Strategy(s_p=16, s_g=16, s_os=16), 4, True, N, R) == []


def test_megatron_distributed_optimizer_shards_expert_states_over_edp():
    assert RULES["megatron"](Strategy(s_os=16), 8, False, N, R) == [(1, 1, 2)]
    assert RULES["megatron"](Strategy(), 8, False, N, R) == [(1, 1, 1)]
    assert RULES["megatron"](Strategy(s_os=8), 8, False, N, R) == []  # distopt instances


def test_groups_match_the_engines_documented_layouts():
    """DeepSpeed's E + D example (utils/groups.py, 16 ranks, ep 2): EP [0,1], [2,3], ...; EDP
    [0,2,...,14], [1,3,...,15]; its D + E (use_data_before_expert_parallelism): EP strided by
    N/e. torchtitan's sparse mesh (dp_replicate, efsdp, ep): EP the innermost 4 ranks."""
    g = expert_groups(_s("ep=2,p=16,g=16,os=16,ep.p=8,ep.g=8,ep.os=8"), N, R)
    assert g["ep"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["edp"] == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    g = expert_groups(_s("ep=2,ep.span,p=16,g=16,os=16,ep.p=8,ep.g=8,ep.os=8"), N, R)
    assert g["ep"] == [[i, i + 8] for i in range(8)]
    assert g["edp"] == [list(range(8)), list(range(8, 16))]
    g = expert_groups(_s("ep=4,p=16,g=16,os=16,ep.p=4,ep.g=4,ep.os=4"), N, R)
    assert g["ep"][1] == [4, 5, 6, 7] and g["edp"][0] == [0, 4, 8, 12]


# ----- exact exports, read back by the engines --------------------------------------------------
def test_torchtitan_expert_parallel_degree_parsed_by_torchtitan(job):
    pytest.importorskip("torchtitan")
    s = _s("ep=8,p=16,g=16,os=16,ep.p=2,ep.g=2,ep.os=2,mb=4,ckpt")
    r = export("torchtitan", job.for_engine("torchtitan"), s)
    assert r.exact and r.closest == s and not r.differences
    got = torchtitan.check_with_torchtitan(r.text)
    assert got == torchtitan.check(r.text, N)
    assert got["parallelism"]["expert_parallel_degree"] == 8 and got["efsdp"] == s.ep_p
    dense = export("torchtitan", job.for_engine("torchtitan"), _s("p=16,g=16,os=16,mb=4,ckpt"))
    assert "expert_parallel_degree" not in dense.text


@pytest.mark.parametrize("text, stage, span", [
    ("ep=8,p=1,g=16,os=16,ep.p=1,ep.g=2,ep.os=2,mb=4,ckpt", 2, False),
    ("ep=4,ep.span,p=16,g=16,os=16,ep.p=4,ep.g=4,ep.os=4,mb=4,ckpt", 3, True),
    ("ep=16,p=1,g=1,os=16,ep.p=1,ep.g=1,ep.os=1,mb=4,ckpt", 1, False),
])
def test_deepspeed_autoep_parsed_and_validated_by_deepspeed(job, text, stage, span):
    pytest.importorskip("deepspeed")
    s = _s(text)
    r = export("deepspeed", job.for_engine("deepspeed"), s)
    assert r.exact and r.closest == s
    cfg = json.loads(r.text)
    got = ds.parse_with_deepspeed(cfg, N)
    assert (got["stage"], got["ep"], got["ep_span"], got["enabled"]) == (stage, s.ep, span, True)
    assert any("AutoEP" in n for n in r.notes)
    bad = {**cfg, "expert_parallel": {**cfg["expert_parallel"], "combine_impl": "bogus"}}
    with pytest.raises(ValueError, match="combine_impl"):
        ds.parse_with_deepspeed(bad, N)


def test_megatron_expert_model_parallel_size_with_distributed_optimizer(job):
    s = _s("ep=8,p=1,g=1,os=16,ep.p=1,ep.g=1,ep.os=2,mb=4,ckpt")
    r = export("megatron", job.for_engine("megatron"), s)
    assert r.exact and "--expert-model-parallel-size 8" in r.text
    got = megatron.check(r.text, N, 512)
    assert (got["ep"], got["edp"], got["os"]) == (8, 2, 16)
    with pytest.raises(ValueError, match="expert-model-parallel-size"):
        megatron.check(r.text.replace("parallel-size 8", "parallel-size 3"), N, 512)


@pytest.mark.parametrize("text", ["ep=4,ep.span,p=16,g=16,os=16,ep.p=2,ep.g=2,ep.os=2,mb=4",
                                  "ep=8,p=16,g=16,os=16,ep.p=1,ep.g=1,ep.os=1,mb=4"])
def test_fsdp2_module_builds_the_plans_expert_groups(job, text):
    s = _s(text)
    r = export("fsdp2", job.for_engine("fsdp2"), s)
    assert r.exact
    mod = fsdp2.load_module(r.text)
    grid = mod.expert_rank_grid()
    groups = expert_groups(s, N, R)
    assert sorted(grid) == groups["ep"]
    assert sorted(map(list, zip(*grid, strict=True))) == groups["edp"]
    assert (mod.EP_SIZE, mod.EXPERT_SHARD_SIZE, mod.EXPERT_REPLICATE_SIZE) == (
        s.ep, s.ep_p, N // s.ep // s.ep_p)


def test_fsdp2_module_shards_experts_on_their_own_mesh_with_torch(job):
    pytest.importorskip("torch")
    s = _s("ep=4,ep.span,p=16,g=16,os=16,ep.p=2,ep.g=2,ep.os=2,mb=4,ckpt")
    got = fsdp2.check_in_child(export("fsdp2", job.for_engine("fsdp2"), s).text)
    assert got["expert_mesh_dims"] == ["('ereplicate', 'eshard')"]
    assert got["dense_mesh_dims"] == ["('replicate', 'shard')"]
    assert got["grads"] and got["checkpointed"] == [True, True]


# ----- what an engine cannot express: the closest plan, priced ---------------------------------
def test_torchtitan_closest_to_a_spanning_plan_is_the_best_it_runs(job):
    plan = _s("ep=4,ep.span,p=16,g=16,os=16,ep.p=4,ep.g=4,ep.os=4,mb=4,ckpt")
    tjob = job.for_engine("torchtitan")
    r = export("torchtitan", tjob, plan)
    assert not r.exact and not r.closest.ep_span
    text = "\n".join(r.differences)
    assert "EP placement spanning nodes -> in the node" in text
    assert "innermost" in text and r.differences[-1].startswith("cost model: step time")
    cands = expressible(tjob, plan)
    assert r.closest in cands and plan not in cands
    best = min((evaluate(tjob, c) for c in cands), key=rank_key)
    assert rank_key(evaluate(tjob, r.closest)) == rank_key(best)
    torchtitan.check(r.text, N)


def test_internevo_exports_the_experts_following_the_dense_triple(job):
    plan = _s("ep=8,p=16,g=16,os=16,ep.p=2,ep.g=2,ep.os=2,mb=4,ckpt")
    r = export("internevo", job.for_engine("internevo"), plan)
    assert not r.exact and not r.closest.has_experts
    assert any(line.startswith("ep 8 -> 1") for line in r.differences)


@pytest.mark.parametrize("target", ["deepspeed", "torchtitan", "fsdp2", "megatron"])
def test_every_moe_candidate_is_valid_and_renders(job, target):
    """Every expert setting a target offers passes the strategy rules and its own check."""
    plan = _s("ep=2,p=16,g=16,os=16,ep.p=8,ep.g=8,ep.os=8,mb=4,ckpt")
    tjob = job.for_engine(target)
    cands = expressible(tjob, plan)
    moe = [c for c in cands if c.has_experts and c.ep > 1]
    assert moe, target
    mod = {"deepspeed": ds, "torchtitan": torchtitan, "fsdp2": fsdp2, "megatron": megatron}
    for c in moe:
        tjob.check(c)
        text = mod[target].render(tjob, c)
        if target == "torchtitan":
            assert torchtitan.check(text, N)["efsdp"] == c.ep_p
        elif target == "megatron":
            assert megatron.check(text, N, 512)["ep"] == c.ep
        elif target == "deepspeed":
            assert json.loads(text)["expert_parallel"]["autoep_size"] == c.ep
        else:
            assert fsdp2.load_module(text).EP_SPAN == c.ep_span


_FSDP2_HF_MOE = """
import json, os, sys
import torch, torch.distributed as dist, transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from amsp_planner.exports.fsdp2 import load_module
mod = load_module(sys.stdin.read())
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
cfg = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, num_experts=4, num_experts_per_tok=2, vocab_size=128)
model = transformers.Qwen3MoeForCausalLM(cfg)
mod.apply(model, mesh, strict=False)
model(torch.randint(0, 128, (2, 8))).logits.float().sum().backward()
meshes = {n: p.device_mesh.mesh_dim_names for n, p in model.named_parameters()
          if isinstance(p, DTensor)}
out = {"experts": sorted({str(v) for n, v in meshes.items() if ".experts." in n}),
       "dense": sorted({str(v) for n, v in meshes.items() if ".experts." not in n}),
       "all_sharded": len(meshes) == len(list(model.parameters())),
       "grads": all(p.grad is not None for p in model.parameters())}
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_fsdp2_module_finds_hugging_face_qwen3_moe_experts(job):
    """The module's EXPERT_MODULES ('experts') is transformers' Qwen3-MoE naming: on a tiny
    Qwen3MoeForCausalLM the experts get the expert mesh, the rest the dense one."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    s = _s("ep=4,p=16,g=16,os=16,ep.p=4,ep.g=4,ep.os=4,mb=4,ckpt")
    text = export("fsdp2", job.for_engine("fsdp2"), s).text
    proc = subprocess.run([sys.executable, "-c", _FSDP2_HF_MOE], input=text, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"experts": ["('ereplicate', 'eshard')"], "dense": ["('replicate', 'shard')"],
                   "all_sharded": True, "grads": True}


def _plan_and_export(tmp_path, strategy: str, target: str, *extra: str) -> str:
    """amsp plan -s `strategy` for Qwen3-30B-A3B on 16 GPUs, then amsp export --to `target`:
    the export's output."""
    from amsp_testlib import run_cli

    plan = tmp_path / "plan.json"
    code, out, err = run_cli(["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--strategy",
                              strategy, "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["export", str(plan), "--to", target, "-o",
                              str(tmp_path / "out"), *extra])
    assert code == 0, err
    return out


def test_cli_exports_an_moe_plan_with_the_engines_check(tmp_path):
    pytest.importorskip("deepspeed")
    out = _plan_and_export(tmp_path, "ep=8,p=1,g=16,os=16,ep.p=1,ep.g=2,ep.os=2,mb=1,ckpt",
                           "deepspeed", "--check")
    assert "expresses the plan exactly" in out and "'ep': 8, 'ep_span': False" in out
    assert json.loads((tmp_path / "out").read_text())["expert_parallel"]["autoep_size"] == 8


def test_export_never_recommends_an_expert_setting_the_target_cannot_run(tmp_path):
    """The export's engine note compares with the target's own plan as the target runs it:
    InternEvo has no expert parallelism, so no note may point to an ep= plan for it."""
    out = _plan_and_export(tmp_path, "ep=16,p=16,g=16,os=16,ep.p=1,ep.g=1,ep.os=1,mb=1,ckpt",
                           "internevo")
    assert "ep 16 -> 1" in out
    assert not [ln for ln in out.splitlines() if "note:" in ln and "ep=" in ln]
