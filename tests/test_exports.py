"""Exports: each target's own parser accepts what we write, the DeepSpeed round trip prices the
same, and the closest expressible strategy and its stated differences are what the cost model says.

    pytest tests/test_exports.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from amsp_testlib import assert_user_error, make_job, run_cli

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.errors import AmspUserError
from amsp_planner.exports import TARGETS, fsdp2, internevo, megatron, target_module, torchtitan
from amsp_planner.exports import deepspeed as ds
from amsp_planner.exports.common import rank_key, try_evaluate
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy, baseline

N, R = 64, 8


@pytest.fixture(scope="module")
def job():
    """llama-7b on 64 A100s (8 per node), 4096-token sequences, 1024 sequences per step."""
    return make_job(N, model=load_model("llama-7b"), seq_len=4096, batch_seqs=1024)


def same_costs(job, a: Strategy, b: Strategy) -> None:
    ea, eb = evaluate(job, a), evaluate(job, b)
    assert ea.step_s == eb.step_s
    assert ea.memory == eb.memory
    assert ea.schedule == eb.schedule


# ----- DeepSpeed ------------------------------------------------------------------------------
DS_EXACT = ["ddp", "zero1", "zero2", "zero3", "zeropp", "p=64,g=64,os=64,hpz=8,mb=2",
            "p=64,g=64,os=64,qwz,mb=1,ckpt", "p=64,g=64,os=64,hpz=4,qgz,mb=4",
            "p=64,g=64,os=64,mb=1,ckpt=12"]


def _strategy(text: str) -> Strategy:
    from amsp_planner.strategy import parse_strategy_or_baseline

    return parse_strategy_or_baseline(text, N, R)


@pytest.mark.parametrize("text", DS_EXACT)
def test_deepspeed_exact_round_trip_prices_the_same(job, text):
    s = _strategy(text)
    r = ds.export(job, s)
    assert r.exact and r.closest == s
    # an amsp plan on DeepSpeed: the same strategy, executed as DeepSpeed does (its execution
    # profile), which the export says and prices
    *changes, cost = r.differences
    assert len(changes) == 1 and changes[0].startswith("DeepSpeed 0.19 executes ")
    assert cost.startswith("cost model: step time")
    back = ds.strategy_from_ds_config(json.loads(r.text), N, R, ckpt=s.ckpt_value)
    assert back.with_(grad_accum=None) == s.with_(grad_accum=None)
    assert back.grad_accum == job.n_micro(s)
    same_costs(job, s, back)


@pytest.mark.parametrize("text", DS_EXACT)
def test_deepspeed_parses_what_we_write(job, text):
    pytest.importorskip("deepspeed")
    s = _strategy(text)
    cfg = json.loads(ds.export(job, s).text)
    got = ds.parse_with_deepspeed(cfg, N)
    assert got == {
        "stage": ds.stage_of(s, N), "hpz": s.hpz if got["stage"] == 3 else 1,
        "qwz": s.qwz, "qgz": s.qgz, "micro_batch": s.micro_batch,
        "grad_accum": job.n_micro(s), "bf16": True, "grad_accum_dtype": "bf16",
        "buffers": ds.buffers(job, got["stage"]) if got["stage"] else {},
    }


def test_deepspeed_batch_identity_is_checked(job):
    pytest.importorskip("deepspeed")
    cfg = json.loads(ds.export(job, baseline("zero3", N, R)).text)
    cfg["train_batch_size"] += 64
    with pytest.raises(ValueError, match="train_batch_size"):
        ds.parse_with_deepspeed(cfg, N)


def test_current_deepspeed_rejects_mics(job):
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = json.loads(ds.export(job, baseline("zero3", N, R)).text)
    cfg.pop("train_batch_size")
    cfg["zero_optimization"]["mics_shard_size"] = 16
    with pytest.raises(Exception, match="mics_shard_size"):
        DeepSpeedConfig(cfg)
    assert deepspeed.__version__


def test_deepspeed_mics_plan_exports_closest_and_prices_it(job):
    plan = _strategy("mics-16")
    r = ds.export(job, plan)
    assert not r.exact
    # the closest is the cost model's best among all DeepSpeed can express, by enumeration,
    # each priced as DeepSpeed executes it (its execution profile)
    tjob = job.for_engine("deepspeed")
    evals = [e for e in (try_evaluate(tjob, c, None) for c in ds.candidates(job, plan)) if e]
    best = min(evals, key=rank_key)
    assert r.closest == best.strategy and r.closest.s_p in (1, N)
    # the stated differences are real: each knob line and the cost line's numbers
    pe, ce = evaluate(job, plan), evaluate(tjob, r.closest)
    for name, a, b in (("s_P", plan.s_p, r.closest.s_p), ("s_OS", plan.s_os, r.closest.s_os)):
        assert any(d.startswith(f"{name} {a} -> {b}") for d in r.differences) == (a != b)
    cost = r.differences[-1]
    assert f"{pe.step_s:.4f} s -> {ce.step_s:.4f} s" in cost
    assert f"{pe.memory.total / 2**30:.2f} -> {ce.memory.total / 2**30:.2f} GiB" in cost
    assert any("--to fsdp2" in n for n in r.notes)
    # and what we wrote is the closest strategy, as the reader sees it
    same_costs(job, r.closest, ds.strategy_from_ds_config(json.loads(r.text), N, R))


def test_deepspeed_candidates_all_round_trip(job):
    plan = Strategy(micro_batch=2)
    for c in ds.candidates(job, plan):
        if try_evaluate(job, c, None) is None:
            continue
        back = ds.strategy_from_ds_config(json.loads(ds.render(job, c)), N, R)
        assert back.with_(grad_accum=None) == c, c


def test_deepspeed_stage0_not_offered_with_fp32_grad_accum():
    j = make_job(16, grad_accum_dtype="fp32")
    r = ds.export(j, Strategy())
    assert not r.exact and r.closest.s_os == 16  # DeepSpeed: no bf16 + fp32-accum stage 0
    assert json.loads(r.text)["data_types"] == {"grad_accum_dtype": "fp32"}


def test_partial_optimizer_sharding_is_not_expressible_in_deepspeed(job):
    plan = Strategy(s_os=8)  # AMSP's (1, 1, R)
    r = ds.export(job, plan)
    assert not r.exact
    os_diff = [d for d in r.differences if d.startswith("s_OS 8 -> ")]
    assert os_diff and "over all GPUs" in os_diff[0]


# ----- ds_config reader -----------------------------------------------------------------------
def test_reader_stages_and_batch_rules():
    rd = ds.strategy_from_ds_config
    assert rd({"zero_optimization": {"stage": 1}, "train_batch_size": 256}, N, R) == \
        Strategy(s_os=N, micro_batch=4, grad_accum=1)
    assert rd({"zero_optimization": {"stage": 2}, "train_batch_size": 256,
               "train_micro_batch_size_per_gpu": 2}, N, R) == \
        Strategy(s_g=N, s_os=N, micro_batch=2, grad_accum=2)
    assert rd({"train_batch_size": 512, "gradient_accumulation_steps": 4}, N, R) == \
        Strategy(micro_batch=2, grad_accum=4)
    # "auto" (Hugging Face Trainer) leaves the batch to the job
    assert rd({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8},
               "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, N, R,
              micro_batch=2) == Strategy(s_p=N, s_g=N, s_os=N, hpz=8, micro_batch=2)
    # hpZ over all GPUs is no hpZ; DeepSpeed ignores ZeRO++ switches below stage 3
    assert rd({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": N}}, N, R).hpz == 1
    assert rd({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, N, R) == \
        Strategy(s_g=N, s_os=N)


@pytest.mark.parametrize("cfg, needle", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
     "zero_optimization.zero_hpz_partition_size' 3 does not divide the 64 GPUs"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 16}},
     "does not divide the node size 8"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 16}}, "--strategy mics-16"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 3}},
     "a shard group of 3 does not divide the 64 GPUs; price MiCS with --strategy mics-P"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 128}},
     "a shard group of 128 does not divide the 64 GPUs"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": "yes"}},
     "zero_optimization.zero_quantized_weights"),
    ({"zero_optimization": 3}, "'zero_optimization' must be an object"),
    ({"train_batch_size": 100}, "train_batch_size"),
    ({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 2}, "train_batch_size' 512 != micro-batch 2"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
])
def test_reader_errors_name_the_field(cfg, needle):
    with pytest.raises(AmspUserError) as e:
        ds.strategy_from_ds_config(cfg, N, R)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_reader_malformed_json(tmp_path):
    p = tmp_path / "ds_config.json"
    p.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(AmspUserError, match=r"malformed JSON at line 1"):
        ds.strategy_from_ds_config(p, N, R)
    p.write_text("[1, 2]")
    with pytest.raises(AmspUserError, match="JSON object"):
        ds.strategy_from_ds_config(p, N, R)


# ----- FSDP2 ----------------------------------------------------------------------------------
def test_fsdp2_expresses_hsdp_and_hpz_exactly(job):
    for text in ("mics-16", "zero3", "ddp", "p=16,g=16,os=16,hpz=8,mb=2", "hsdp,ckpt"):
        s = _strategy(text)
        r = fsdp2.export(job, s)
        assert r.exact, text
        mod = fsdp2.load_module(r.text)
        assert mod.MESH_SHAPE == (N // s.s_p, s.s_p) == mod.mesh_shape(N)
        assert mod.RESHARD_AFTER_FORWARD == (s.hpz if s.hpz > 1 else True)
        assert mod.GRAD_ACCUM == job.n_micro(s) and mod.ACTIVATION_CHECKPOINTING == s.ckpt


def test_fsdp2_closest_for_zero1_and_zeropp(job):
    for plan in (Strategy(s_os=8), baseline("zeropp", N, R)):
        r = fsdp2.export(job, plan)
        c = r.closest
        assert not r.exact and c.s_p == c.s_g == c.s_os and not (c.qwz or c.qgz)
        # priced as FSDP2 runs them (fp32 master parameters: cost/memory.py)
        tjob = job.for_engine("fsdp2")
        evals = [try_evaluate(tjob, x, None) for x in fsdp2.candidates(job, plan)]
        assert c == min((e for e in evals if e), key=rank_key).strategy
    assert any(d.startswith("qwz on -> off: FSDP2 has no quantized") for d in r.differences)


_FSDP2_CHECK = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from amsp_planner.exports import fsdp2
    results = []
    for text in json.load(sys.stdin):
        out = fsdp2.check_with_torch(text)       # creates and destroys its own 1-rank group
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            fsdp2.load_module(text).apply(torch.nn.Linear(4, 4), init_device_mesh("cpu", (1, 1)))
            out["strict"] = "accepted"
        except ValueError as e:
            out["strict"] = str(e)
        dist.destroy_process_group()
        results.append(out)
    print(json.dumps(results))
""")
FSDP2_CASES = ["p=16,g=16,os=16,hpz=8,mb=2", "zero3,ckpt", "ddp", "zero3,ckpt=1",
               "p=16,g=16,os=16,ckpt=op"]
FSDP2_WRAPPED = {"zero3,ckpt": [True, True], "zero3,ckpt=1": [True, False],
                 "p=16,g=16,os=16,ckpt=op": [True, True]}
"""Which of the check model's two blocks each case wraps with checkpoint_wrapper."""


def test_fsdp2_module_applies_fully_shard_on_cpu(job):
    """One process, one rank, gloo, mesh (1, 1): fully_shard with the generated settings."""
    pytest.importorskip("torch")
    plans = [_strategy(t) for t in FSDP2_CASES]
    texts = [fsdp2.export(job, s).text for s in plans]
    proc = subprocess.run([sys.executable, "-c", _FSDP2_CHECK], input=json.dumps(texts),
                          text=True, capture_output=True, timeout=180,
                          env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29631"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for text, s, got in zip(FSDP2_CASES, plans, results, strict=True):
        assert got["all_dtensor"] and got["grads"], s
        assert got["checkpointed"] == FSDP2_WRAPPED.get(text, [False, False]), text
        assert got["selective"] == [s.ckpt_op] * 2, text
        assert got["mesh_shape"] == [1, 1] and got["placements"] == ["R", "S(0)"]  # HSDP mesh
        assert got["module_mesh_for_plan"] == [N // s.s_p, s.s_p]
        assert got["reshard_after_forward"] == (s.hpz if s.hpz > 1 else True)
        assert "is not the plan's (replicate, shard)" in got["strict"]


# ----- torchtitan, InternEvo ------------------------------------------------------------------
def test_torchtitan_overrides_parse_and_match_the_plan(job):
    s = _strategy("mics-16")
    r = torchtitan.export(job, s)
    assert r.exact
    doc = torchtitan.check(r.text, N)
    assert doc["parallelism"]["data_parallel_replicate_degree"] == 4
    assert doc["parallelism"]["data_parallel_shard_degree"] == 16
    tr = doc["training"]
    assert tr["global_batch_size"] // (tr["local_batch_size"] * N) == job.n_micro(s)
    r = torchtitan.export(job, baseline("zeropp", N, R))
    assert not r.exact and r.closest.hpz == 1
    torchtitan.check(r.text, N)


def test_torchtitan_check_catches_wrong_fields(job):
    text = torchtitan.export(job, baseline("zero3", N, R)).text
    with pytest.raises(ValueError, match="not a torchtitan field"):
        torchtitan.check(text.replace("seq_len", "sequence_length"), N)
    with pytest.raises(ValueError, match="replicate x shard degree"):
        torchtitan.check(text, 128)


@pytest.mark.parametrize("strategy", ["mics-16", "zero3,ckpt", "ddp", "zero3,ckpt=op"])
def test_torchtitan_own_config_manager_parses_the_export(job, strategy):
    pytest.importorskip("torchtitan")
    text = torchtitan.export(job, _strategy(strategy)).text
    assert torchtitan.check_with_torchtitan(text) == torchtitan.check(text, N)
    with pytest.raises(ValueError, match="invalid choice 'sometimes'"):
        torchtitan.check_with_torchtitan(text.replace("=always", "=sometimes"))
    with pytest.raises(ValueError, match="torchtitan refused it"):
        torchtitan.check_with_torchtitan(text.replace("seq_len", "sequence_length"))


def test_partial_and_op_checkpointing_in_every_target(job):
    L = job.model.num_layers
    s = _strategy("zero3,ckpt=12")
    cfg = json.loads(ds.export(job, s).text)
    assert ds.export(job, s).exact and cfg["activation_checkpointing"]["number_checkpoints"] == 12
    r = internevo.export(job, s)
    frac = internevo.check(r.text, N, 1024)["model"]["checkpoint"]
    assert r.exact and int(L * frac) == 12  # InternEvo checkpoints its first int(f L) blocks
    assert int(L * internevo.checkpoint_value(s.with_(ckpt_blocks=7), L)) == 7
    r = torchtitan.export(job, s)  # torchtitan 0.3: every block or none
    assert not r.exact and r.closest.ckpt_value in (True, False, "op")
    assert any(d.startswith("checkpointing the first 12 blocks -> ") and "torchtitan 0.3" in d
               for d in r.differences), r.differences
    torchtitan.check(r.text, N)
    op = _strategy("zero3,ckpt=op")
    r = torchtitan.export(job, op)
    assert r.exact and f"{torchtitan.AC}:selective" in r.text
    assert torchtitan.check(r.text, N)["activation_checkpoint"] == "selective"
    for target in (ds, internevo):  # no op-level form: the best of the others, priced
        r = target.export(job, op)
        assert not r.exact and r.closest.ckpt_value != "op"
        assert any(d.startswith("checkpointing op-level -> ") for d in r.differences)


def test_internevo_zero1_and_fsdp(job):
    r = internevo.export(job, Strategy(s_os=8, micro_batch=2))
    assert r.exact
    got = internevo.check(r.text, N, 1024)
    assert got["parallel"]["zero1"] == {"size": 8, "fsdp": False}
    assert got["data"]["micro_num"] == 8 and got["data"]["micro_bsz"] == 2
    r = internevo.export(job, _strategy("mics-16"))
    assert r.exact and internevo.check(r.text, N, 1024)["parallel"]["zero1"] == \
        {"size": 16, "fsdp": True}
    r = internevo.export(job, Strategy(s_g=8, s_os=64))
    assert not r.exact and r.closest.s_g in (1, r.closest.s_os)
    with pytest.raises(ValueError, match="micro_num"):
        internevo.check(r.text, N, 2048)


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_renders_every_candidate(job, target):
    mod = target_module(target)
    for c in mod.candidates(job, Strategy(micro_batch=2)):
        if try_evaluate(job, c, None) is None:
            continue
        text = mod.render(job, c)
        if target == "torchtitan":
            torchtitan.check(text, N)
        elif target == "internevo":
            internevo.check(text, N, 1024)
        elif target == "megatron":
            got = megatron.check(text, N, 1024)
            assert (got["tp"], got["os"], got["micro_batch"]) == (c.tp, c.s_os, c.micro_batch)
        elif target == "fsdp2":
            assert fsdp2.load_module(text).MESH_SHAPE == (N // c.s_p, c.s_p)


def test_exports_do_not_import_torch_or_deepspeed():
    code = ("import sys\n"
            "from amsp_planner.exports import export, TARGETS\n"
            "from amsp_planner.exports.deepspeed import strategy_from_ds_config\n"
            "from amsp_planner.strategy import baseline\n"
            "from amsp_testlib import make_job\n"
            "job = make_job(16)\n"
            "[export(t, job, baseline('zeropp', 16, 8)) for t in TARGETS]\n"
            "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]\n"
            "assert not bad, bad\n")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=here, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----- CLI ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "--strategy",
                              "mics-16,mb=2", "-o", str(path)])
    assert code == 0, err
    return path


def test_cli_export_writes_and_explains(plan_file, tmp_path):
    out_file = tmp_path / "ds_config.json"
    code, out, err = run_cli(["export", str(plan_file), "--to", "deepspeed", "-o",
                              str(out_file)])
    assert code == 0, err
    assert out.startswith(f"wrote {out_file} (deepspeed): the plan is not expressible")
    assert "differs: s_P 16 -> " in out and "cost model: step time" in out
    cfg = json.loads(out_file.read_text())
    assert cfg["zero_optimization"]["stage"] in (0, 1, 2, 3)
    code, out, err = run_cli(["export", str(plan_file), "--to", "fsdp2"])
    assert code == 0 and "MESH_SHAPE = (4, 16)" in out
    assert err.startswith("fsdp2 config (fsdp2): expresses the plan exactly")


def test_cli_export_dash_prints_to_stdout(plan_file, tmp_path, monkeypatch):
    # `-o -` is standard output, as for `amsp plan -o -`: no file named "-"
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["export", str(plan_file), "--to", "fsdp2", "-o", "-"])
    assert code == 0 and "MESH_SHAPE = (4, 16)" in out, err
    assert err.startswith("fsdp2 config (fsdp2):") and not (tmp_path / "-").exists()


def test_cli_export_bad_input(plan_file, tmp_path):
    code, out, err = run_cli(["export", str(tmp_path / "nope.json"), "--to", "deepspeed"])
    assert_user_error(code, out, err, "nope.json")
    code, out, err = run_cli(["export", str(plan_file), "--to", "colossalai"])
    assert_user_error(code, out, err, "colossalai")


def test_cli_compare_strategy_from(tmp_path, job):
    cfg = json.loads(ds.export(job, baseline("zeropp", N, R)).text)
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps(cfg))
    args = ["compare", "--model", "llama-7b", "--gpus", "64", "--global-batch-seqs", "1024",
            "--strategy-from", str(p), "--json"]
    code, out, err = run_cli(args)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    assert rows["ds_config"]["strategy"] == rows["zeropp"]["strategy"] + ",ga=16"
    assert rows["ds_config"]["time"] == rows["zeropp"]["time"]
    code, out, err = run_cli(args[:-1] + ["--global-batch-seqs", "2048"])
    assert_user_error(code, out, err, "gradient_accumulation_steps 16", "--global-batch-seqs 1024")


@pytest.mark.parametrize("target, needle", [
    ("torchtitan", "check: torchtitan's ConfigManager parsed the overrides"),
    ("internevo", "check: exec'd it"),
    ("megatron", "check: parsed the arguments back"),
    ("deepspeed", "check: DeepSpeedConfig/DeepSpeedZeroConfig accepted it: {'stage': "),
])
def test_cli_export_check(plan_file, tmp_path, target, needle):
    if target in ("deepspeed", "torchtitan"):
        pytest.importorskip(target)
    code, out, err = run_cli(["export", str(plan_file), "--to", target, "-o",
                              str(tmp_path / "out"), "--check"])
    assert code == 0, err
    assert needle in out


_FSDP2_HF = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from amsp_planner.exports.fsdp2 import load_module
    mod = load_module(sys.stdin.read())
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg)
    found = [id(b) for b in mod.default_blocks(model)]
    mod.apply(model, mesh, strict=False)
    model(torch.randint(0, 128, (2, 8))).logits.float().sum().backward()
    out = {"found_hf_layers": found == [id(b) for b in model.model.layers],
           "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
           "block_units": sum(isinstance(b, FSDPModule) for b in model.model.layers)}
    try:
        mod.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh, strict=False)
    except ValueError as e:
        out["no_blocks"] = str(e)
    print(json.dumps(out), flush=True)
    os._exit(0)
""")


def test_fsdp2_module_finds_hugging_face_blocks(job):
    """LlamaForCausalLM keeps its blocks at model.model.layers: each is its own FSDP unit."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    text = fsdp2.export(job, _strategy("zero3")).text
    proc = subprocess.run([sys.executable, "-c", _FSDP2_HF], input=text, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["found_hf_layers"] and got["block_units"] == 3
    assert got["units"] == 4  # three blocks and the root
    assert "no transformer blocks found" in got["no_blocks"]


def test_fsdp2_check_exits_cleanly_every_time(plan_file):
    """`export --to fsdp2 --check` once aborted at exit (134) after printing its result."""
    pytest.importorskip("torch")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", "export",
                            str(plan_file), "--to", "fsdp2", "--check"], text=True,
                           capture_output=True, timeout=300)
        assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr
        assert "check: fully_shard applied it" in r.stderr


def test_megatron_distributed_optimizer_tp_and_recompute():
    job = make_job(64, model=load_model("llama-7b"), seq_len=4096, batch_seqs=1024)
    s = Strategy(s_os=8, micro_batch=2, tp=2, ckpt_blocks=5)
    r = megatron.export(job, s)
    assert r.exact and r.closest == s
    got = megatron.check(r.text, 64, 1024)
    # 64 GPUs / tp 2 = 32 data-parallel ranks; optimizer sharded over 8: 4 instances
    assert got == {"tp": 2, "micro_batch": 2, "dp": 32, "os": 8, "recompute_layers": 5}
    assert "--num-distributed-optimizer-instances 4" in r.text
    assert "--sequence-parallel" in r.text and "--recompute-method block" in r.text
    # ZeRO-3 is not expressible: parameters whole, the closest is a (1, 1, s) point, priced
    r = megatron.export(job, Strategy(s_p=64, s_g=64, s_os=64, micro_batch=1))
    assert not r.exact and (r.closest.s_p, r.closest.s_g) == (1, 1)
    assert any("keeps parameters whole" in d for d in r.differences)
    assert any("float32" in d for d in r.differences)  # bf16 gradients -> fp32 on Megatron


def test_internevo_tensor_parallelism_with_zero1():
    # InternLM's published 7B runs: tp=2 with zero1=4 over 32 GPUs = 16 data-parallel ranks
    job = make_job(32, model=load_model("llama-7b"), seq_len=2048, batch_seqs=256)
    s = Strategy(s_os=4, micro_batch=4, tp=2)
    r = internevo.export(job.for_engine("internevo"), s)
    assert r.exact and r.closest == s
    got = internevo.check(r.text, 32, 256)
    assert got["parallel"]["tensor"] == {"size": 2, "mode": "msp"}
    assert got["parallel"]["zero1"] == {"size": 4, "fsdp": False}
    # 256 sequences over 16 data-parallel ranks: 16 each, micro-batches of 4
    assert got["data"]["micro_num"] == 4 and got["data"]["micro_bsz"] == 4
    with pytest.raises(ValueError, match="tensor.mode"):  # no sequence parallelism: not priced
        internevo.check(r.text.replace("'msp'", "'mtp'"), 32, 256)
    with pytest.raises(ValueError, match="zero1.size 32"):
        internevo.check(r.text.replace("size=4", "size=32"), 32, 256)


@pytest.mark.parametrize("ckpt,target,words", [
    ("8", "torchtitan", "checkpointing the first 8 blocks -> "),
    ("op", "megatron", "checkpointing op-level -> "),
    ("op", "internevo", "checkpointing op-level -> "),
    ("op", "deepspeed", "checkpointing op-level -> "),
])
def test_export_translates_checkpointing_the_target_does_not_run(tmp_path, ckpt, target, words):
    """A plan's --activation-checkpointing K or op, which the target does not run, is changed
    to the closest setting it runs and the change named with the target's reason (the
    exporters crashed with a KeyError, ValueError or TypeError: the plan's pinned setting was
    taken as the target's)."""
    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64",
                            "--activation-checkpointing", ckpt, "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["export", str(plan), "--to", target, "-o", str(tmp_path / "x")])
    assert code == 0, err
    text = out + err
    assert words in text and target_module(target).WHY["checkpointing"] in text, text


@pytest.mark.parametrize("engine,ckpt", [("torchtitan", "8"), ("deepspeed", "op"),
                                         ("megatron", "op"), ("internevo", "op")])
def test_plan_refuses_checkpointing_its_engine_does_not_run(tmp_path, engine, ckpt):
    """--activation-checkpointing pins what the search may choose: one the engine does not run
    would make a plan it cannot run (the plan was written, then its export crashed)."""
    out = tmp_path / "p.json"
    assert_user_error(*run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "--engine",
                                engine, "--activation-checkpointing", ckpt, "-o", str(out)]),
                      f"--activation-checkpointing {ckpt}:", "does not run it (it runs ")
    assert not out.exists()


def test_plan_warns_of_a_given_strategy_its_engine_does_not_run(tmp_path):
    code, _, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "--engine",
                            "torchtitan", "--strategy", "zero1", "-o", str(tmp_path / "p.json")])
    assert code == 0, err
    assert ("warning: torchtitan 0.3 does not run p=1,g=1,os=64,mb=1 (its shards are P = G = "
            "OS): priced as given") in err, err


def test_whatif_refuses_checkpointing_its_engine_does_not_run():
    assert_user_error(*run_cli(["whatif", "--model", "llama-7b", "--gpus", "64", "--engine",
                                "deepspeed", "--activation-checkpointing", "op"]),
                      "--activation-checkpointing op: DeepSpeed 0.19 does not run it (it runs "
                      "off, on, a block count K)")
