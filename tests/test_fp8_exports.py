"""FP8 plans exported: torchtitan's Float8 converter (checked against torchtitan 0.3's own
Config class), the FSDP2 module's torchao conversion, Megatron's FP8 arguments; DeepSpeed and
InternEvo refuse in one line (exports/fp8.py)."""

from __future__ import annotations

import sys
import types

import pytest
from amsp_testlib import assert_user_error, run_cli

from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.exports import export, megatron, torchtitan
from amsp_planner.exports.fp8 import check_torchtitan_code, torchtitan_code
from amsp_planner.exports.fsdp2 import load_module
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

N = 64


def _job(engine, recipe=None, gather="auto"):
    t = TrainingSpec(seq_len=4096, global_batch_seqs=1024, precision="fp8", fp8_recipe=recipe,
                     fp8_all_gather=gather)
    return Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"), t, N, engine)


def test_torchtitan_rowwise_export_carries_the_float8_converter():
    r = export("torchtitan", _job("torchtitan"), Strategy.parse("p=64,g=64,os=64,mb=1"))
    doc = torchtitan.check(r.text, N)
    # auto is torchtitan's default recipe, named; the LM head kept bf16; compiled
    assert doc["fp8"] == {"converter": "Float8LinearConverter",
                          "keywords": {"recipe_name": "rowwise", "filter_fqns": ["lm_head"],
                                       "model_compile_enabled": True}}
    assert doc["compile_enable"] is True
    assert doc["training"]["mixed_precision_param"] == "bfloat16"  # FP8 is bf16 + FP8 linears
    code = torchtitan_code(r.text)
    assert "def amsp_fp8():" in code and "model_registry(" in code
    with pytest.raises(ValueError, match="needs --compile.enable"):
        torchtitan.check(r.text.replace("--compile.enable\n", ""), N)


def test_torchtitan_03_parses_the_fp8_export_and_its_converter_names():
    pytest.importorskip("torchtitan")
    from amsp_planner.exports.fp8 import check_torchtitan_converter

    text = export("torchtitan", _job("torchtitan", "rowwise"),
                  Strategy.parse("p=64,g=64,os=64,mb=1")).text
    assert torchtitan.check_with_torchtitan(text) == torchtitan.check(text, N)
    # torchtitan 0.3's Float8LinearConverter.Config takes rowwise or rowwise_with_gw_hp only:
    # the tensorwise recipe the planner prices for older torchtitan is not there
    found = check_torchtitan_code(text)
    for bad, needle in ((dict(recipe_name="tensorwise"), "rowwise_with_gw_hp"),
                        (dict(enable_fsdp_float8_all_gather=True), "no field")):
        with pytest.raises(ValueError, match=needle):
            check_torchtitan_converter({**found, "keywords": {**found["keywords"], **bad}})


def test_torchtitan_refuses_tensorwise_and_te_recipes():
    s = Strategy.parse("p=64,g=64,os=64,mb=1")
    with pytest.raises(AmspUserError, match="no tensorwise Float8 recipe"):
        export("torchtitan", _job("torchtitan", "tensorwise"), s)
    with pytest.raises(AmspUserError, match="recipe delayed is not one torchtitan runs"):
        export("torchtitan", _job("megatron"), Strategy.parse("tp=2,p=1,g=1,os=32,mb=1"))


def _fake_torchao(calls):
    """torchao.float8 stand-in recording what the generated module calls (torchao is not
    installed here; its names are checked against torchao 36027d8 in exports/fp8.py)."""
    f8 = types.ModuleType("torchao.float8")

    class Float8LinearConfig:
        def __init__(self, **kw):
            calls.append(("Float8LinearConfig", kw))

        @staticmethod
        def from_recipe_name(name):
            calls.append(("from_recipe_name", name))

    def convert_to_float8_training(model, *, module_filter_fn=None, config=None):
        calls.append(("convert", module_filter_fn))
        return model

    f8.Float8LinearConfig = Float8LinearConfig
    f8.convert_to_float8_training = convert_to_float8_training
    f8.precompute_float8_dynamic_scale_for_fsdp = lambda m: calls.append(("precompute", m))
    return f8


@pytest.mark.parametrize("recipe,gather,fp8ag", [
    ("tensorwise", "on", False), ("tensorwise", "off", False), ("rowwise", "auto", False),
    ("tensorwise", "auto", True)])  # the search chose the FP8 all-gather (fp8ag)
def test_fsdp2_module_converts_with_torchao_before_sharding(monkeypatch, recipe, gather, fp8ag):
    nn = pytest.importorskip("torch.nn")
    text = export("fsdp2", _job("fsdp2", recipe, gather),
                  Strategy.parse("p=64,g=64,os=64,mb=1" + ",fp8ag" * fp8ag)).text
    mod = load_module(text)
    gathers = gather == "on" or fp8ag
    assert (mod.FP8_RECIPE, mod.FP8_ALL_GATHER, mod.PARAM_DTYPE) == \
        (recipe, gathers, "bfloat16")
    calls = []
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", _fake_torchao(calls))
    mod._apply_without_fp8 = lambda model, mesh, **kw: calls.append(("shard", mesh))
    mod.apply("model", "mesh")
    assert [c[0] for c in calls] == [
        "Float8LinearConfig" if recipe == "tensorwise" else "from_recipe_name", "convert",
        "shard"]
    if recipe == "tensorwise":
        assert calls[0][1] == {"enable_fsdp_float8_all_gather": gathers}
    keep = calls[1][1]
    assert keep(nn.Linear(64, 32), "layers.0.attention.wq")
    assert not keep(nn.Linear(64, 32), "output") and not keep(nn.Linear(64, 32), "lm_head")
    assert not keep(nn.Linear(64, 24), "layers.0.feed_forward.w1")  # 24: not a multiple of 16
    calls.clear()
    mod.after_optimizer_step("model")
    assert calls == ([("precompute", "model")] if gathers else [])


@pytest.mark.parametrize("fqn,moe_keeps", [
    ("layers.0.attention.wq", True), ("layers.0.self_attn.q_proj", True),
    ("layers.0.mlp.gate", False),  # Mixtral / Qwen-MoE routers
    ("layers.0.moe.router.gate", False), ("layers.0.block_sparse_moe.experts.3.w1", False),
    ("layers.0.mlp.experts.7.gate_proj", False), ("layers.0.mlp.shared_expert.up_proj", False),
    ("layers.0.moe.shared_experts.w2", False), ("layers.0.mlp.gate_proj", True), ("lm_head", False),
])
def test_fsdp2_module_keeps_a_mixture_of_experts_moe_layer_in_bf16(monkeypatch, fqn, moe_keeps):
    """The plan prices an MoE's router and experts in bf16 (cost/moe_compute.py): the FSDP2
    module's torchao filter leaves them, and converts the attention (and a dense MLP) as a
    dense plan's does; a dense plan's filter is unchanged (an MLP's gate_proj converts)."""
    nn = pytest.importorskip("torch.nn")
    t = TrainingSpec(seq_len=4096, global_batch_seqs=1024, precision="fp8",
                     fp8_recipe="rowwise")
    job = Job.create(load_model("qwen3-30b-a3b"), load_cluster("dgx-h100-ndr"), t, N, "fsdp2")
    s = Strategy.parse("ep=8,p=64,g=64,os=64,ep.p=8,ep.g=8,ep.os=8,mb=1")
    moe = load_module(export("fsdp2", job, s).text)
    dense = load_module(export("fsdp2", _job("fsdp2", "rowwise"),
                               Strategy.parse("p=64,g=64,os=64,mb=1")).text)
    lin = nn.Linear(64, 32)
    assert moe.fp8_filter(lin, fqn) is moe_keeps
    assert dense.fp8_filter(lin, fqn) is (fqn != "lm_head")


def test_megatron_fp8_arguments_parse_back():
    s = Strategy.parse("tp=2,p=1,g=1,os=32,mb=1")
    text = export("megatron", _job("megatron", gather="on"), s).text
    got = megatron.check(text, N, 1024)
    assert got["fp8"] == {"format": "hybrid", "recipe": "delayed", "param_gather": True}
    assert "--fp8-amax-history-len 1" in text and "--bf16" in text
    text = export("megatron", _job("megatron", "tensorwise"), s).text
    assert megatron.check(text, N, 1024)["fp8"] == {"format": "hybrid", "recipe": "tensorwise",
                                                    "param_gather": False}
    for bad, needle in (("--fp8-recipe tensorwise", "--fp8-recipe rowwise"),
                        ("--fp8-format hybrid", "--fp8-format e5m2"),
                        ("--bf16", "--fp16")):
        with pytest.raises(ValueError, match=needle.split()[0] if bad != "--bf16" else "--bf16"):
            megatron.check(text.replace(bad, needle), N, 1024)


@pytest.mark.parametrize("target,needle", [
    ("deepspeed", "DeepSpeed's ZeRO engine has no FP8"),
    ("internevo", "InternEvo's configuration has no FP8"),
])
def test_engines_without_fp8_refuse_in_one_line(tmp_path, target, needle):
    plan = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--cluster",
                            "dgx-h100-ndr", "--engine", "torchtitan", "--precision", "fp8",
                            "-o", str(plan)])
    assert code == 0, err
    assert_user_error(*run_cli(["export", str(plan), "--to", target]), needle, "--precision bf16")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp2_tp_plan_gathers_fp8_where_the_plan_prices_fp8_tp_gathers(monkeypatch, recipe):
    # tensorwise tensor parallelism is priced with FP8 all-gathers (cost/fp8_bytes.py
    # fp8_tp_wire): the module must use torchao's Float8 TP styles then, torch's otherwise
    nn = pytest.importorskip("torch.nn")
    job = _job("fsdp2", recipe, "off")
    mod = load_module(export("fsdp2", job, Strategy.parse("tp=2,p=32,g=32,os=32,mb=1")).text)
    tp = types.ModuleType("torchao.float8.float8_tensor_parallel")
    made = []
    for name in ("Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"):
        tp.__dict__[name] = type(name, (), {"__init__": lambda self, *a, n=name, **k:
                                            made.append(n)})
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", types.ModuleType("torchao.float8"))
    monkeypatch.setitem(sys.modules, "torchao.float8.float8_tensor_parallel", tp)
    block = nn.Module()
    block.attention = nn.Module()
    block.attention.wq, block.attention.wo = nn.Linear(16, 16), nn.Linear(16, 16)
    block.attention_norm = nn.LayerNorm(16)
    plan = mod.tp_plan(block)
    kinds = {k: type(v).__name__ for k, v in plan.items()}
    if recipe == "tensorwise":
        assert kinds == {"attention": "PrepareFloat8ModuleInput",
                         "attention.wq": "Float8ColwiseParallel",
                         "attention.wo": "Float8RowwiseParallel",
                         "attention_norm": "SequenceParallel"}
    else:
        assert kinds == {"attention": "PrepareModuleInput", "attention.wq": "ColwiseParallel",
                         "attention.wo": "RowwiseParallel", "attention_norm": "SequenceParallel"}
        assert not made


def test_fsdp2_tp_input_layouts_follow_the_attention_signature():
    # torchtitan (v0.2.2) calls attention(x, freqs_cis, attention_masks, positions): one layout
    # per positional input, only x gathered; Hugging Face calls self_attn(hidden_states=...):
    # the keyword's layout; an MLP takes x alone
    nn = pytest.importorskip("torch.nn")
    job = _job("fsdp2", "rowwise", "off")
    mod = load_module(export("fsdp2", job, Strategy.parse("tp=2,p=32,g=32,os=32,mb=1")).text)

    class Titan(nn.Module):
        def forward(self, x, freqs_cis, attention_masks, positions=None):
            return x

    class HF(nn.Module):
        def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
            return hidden_states

    class MLP(nn.Module):
        def forward(self, x):
            return x

    assert mod.input_layouts(Titan(), "S", "R") == {
        "input_layouts": ("S", None, None, None), "desired_input_layouts": ("R", None, None, None)}
    assert mod.input_layouts(HF(), "S", "R") == {
        "input_kwarg_layouts": {"hidden_states": "S"},
        "desired_input_kwarg_layouts": {"hidden_states": "R"}}
    assert mod.input_layouts(MLP(), "S", "R") == {"input_layouts": ("S",),
                                                   "desired_input_layouts": ("R",)}


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_torchtitan_moe_export_converts_what_the_plan_prices_in_fp8(recipe):
    """A mixture of experts' FP8 plan prices the attention's linears (and dense layers' MLP) in
    FP8 and the router, shared and routed experts in bf16 (docs/fp8.md): the exported
    converter, applied by torchtitan 0.3's own rule to its own MoE model configs, converts
    exactly those."""
    pytest.importorskip("torchtitan")
    from torchtitan.components.quantization.utils import module_filter_fn
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.deepseek_v3 import deepseekv3_configs
    from torchtitan.models.qwen3 import qwen3_configs

    from amsp_planner.exports.fp8 import torchtitan_converter

    t = TrainingSpec(seq_len=4096, global_batch_seqs=1024, precision="fp8", fp8_recipe=recipe)
    # the converter reads the model and the recipe only (mxfp8 plans need a Blackwell cluster)
    cls, kw = torchtitan_converter(types.SimpleNamespace(
        model=load_model("qwen3-30b-a3b"), training=t, engine="torchtitan"))
    for cfg in (qwen3_configs["debugmodel_moe"]("flex"),
                deepseekv3_configs["debugmodel"]("flex", "standard")):
        linears = [(fqn, c) for fqn, c, *_ in cfg.traverse(Linear.Config)]
        if cls == "Float8LinearConverter":
            converted = {f for f, c in linears if module_filter_fn(c, f, kw["filter_fqns"])}
        else:  # MXFP8LinearConverter.convert: a Linear whose fqn contains one of `fqns`
            converted = {f for f, _ in linears if any(x in f for x in kw["fqns"])}
        priced_fp8 = {f for f, _ in linears if ".attention." in f or ".feed_forward." in f}
        assert converted == priced_fp8 and any(".moe." in f for f, _ in linears)


def test_an_amsp_fp8_plan_exports_only_where_its_gpu_and_recipe_can_run(tmp_path):
    """The bundled runtime's FP8 (its gathers) plans on any GPU; an engine with FP8 matmuls
    refuses that plan on an A100 naming the GPU, and the tensorwise refusal of torchtitan names
    the engine to plan with (amsp's recipe is tensorwise only)."""
    a100, h100 = tmp_path / "a.json", tmp_path / "h.json"
    for path, cluster in ((a100, "eth-100g"), (h100, "dgx-h100-ndr")):
        code, _, err = run_cli(["plan", "--model", "llama3-8b", "--gpus", "64", "--cluster",
                                cluster, "--precision", "fp8", "-o", str(path)])
        assert code == 0, err
    for target in ("torchtitan", "fsdp2", "megatron"):
        assert_user_error(*run_cli(["export", str(a100), "--to", target]),
                          f"{target} runs the plan's linears in FP8", "A100-SXM4-80GB, ampere",
                          "--precision bf16")
    assert_user_error(*run_cli(["export", str(h100), "--to", "torchtitan"]),
                      "plan with --engine torchtitan --fp8-recipe rowwise")
