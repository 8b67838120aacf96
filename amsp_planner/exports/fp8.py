"""The FP8 part of the exports (docs/fp8.md, docs/exports.md): what each engine is told so that
the blocks' linears run in FP8 as the plan prices them. No torch.

torchtitan 0.3 (pyproject's interop pin, the version the overrides target): FP8 is a model
converter set in the config function's ``model_spec`` (``Trainer.Config.model_spec`` is
suppressed from the command line), ``Float8LinearConverter.Config(recipe_name, filter_fqns,
model_compile_enabled)`` with ``recipe_name`` in ("rowwise", "rowwise_with_gw_hp"), or
``MXFP8LinearConverter.Config(fqns, model_compile_enabled)``
(torchtitan/components/quantization/float8.py and mx.py; the same at pytorch/torchtitan
b5bcd76). The export writes that config function as ``#fp8 `` comment lines of the overrides
file. torchtitan 0.3 has no tensorwise recipe and no ``enable_fsdp_float8_all_gather`` /
``precompute_float8_dynamic_scale_for_fsdp`` settings: pytorch/torchtitan 6348d93 ("quantize
on config instead of on model") removed the ``[float8]`` section that had them, so a
tensorwise plan is refused for torchtitan, pointing to the FSDP2 export.

FSDP2 (torchao at 36027d8, torchao/float8/__init__.py): ``convert_to_float8_training(model,
module_filter_fn=..., config=Float8LinearConfig(...))`` before ``fully_shard``, with
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` for the tensorwise FP8 all-gather
(config.py) or ``Float8LinearConfig.from_recipe_name("rowwise")``, and
``precompute_float8_dynamic_scale_for_fsdp(model)`` after each optimizer step when gathering in
FP8 (fsdp_utils.py).

Megatron-LM (d98e8a6, megatron/core/transformer/transformer_config.py, arguments generated
from it): ``--fp8-format`` (the ``fp8`` field: e4m3 | hybrid), ``--fp8-recipe`` (tensorwise |
delayed | mxfp8 | blockwise | custom; default delayed), ``--fp8-amax-history-len`` (1) and
``--fp8-amax-compute-algo`` (most_recent) for delayed scaling, ``--fp8-param-gather``
(megatron/training/arguments.py: the parameter all-gather in FP8; needs the distributed
optimizer).

DeepSpeed and InternEvo have no FP8 training path here (engines.py: no FP8 family): their
exports refuse FP8 plans in one line.
"""

from __future__ import annotations

from amsp_planner.errors import AmspUserError

NO_FP8 = {
    "deepspeed": "DeepSpeed's ZeRO engine has no FP8 matmul path of its own (FP8 there comes "
                 "from Transformer Engine modules in the user's model, which the planner does "
                 "not price)",
    "internevo": "InternEvo's configuration has no FP8 training setting",
}
"""Targets that cannot run an FP8 plan, and why (one line)."""

FP8_FORMAT = "hybrid"
"""Megatron --fp8-format: E4M3 for activations and weights, E5M2 for the gradients (the format
of NVIDIA's published Megatron FP8 rows; e4m3 everywhere is the other choice)."""

MEGATRON_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
"""TransformerConfig.fp8_recipe's choices at d98e8a6."""
MEGATRON_FORMATS = ("e4m3", "hybrid")
"""TransformerConfig.fp8's choices at d98e8a6 (--fp8-format)."""

BF16_FQNS = ["lm_head"]
"""torchtitan 0.3's LM head module (filter_fqns of its llama3_405b config); the embedding is
not a Linear."""

MOE_BF16_FQNS = ["router.gate", "shared_experts"]
"""A mixture of experts' linears the plan prices in bf16 (cost/moe_compute.py has no FP8) that
torchtitan 0.3's Float8LinearConverter would otherwise convert: the router's gate (its
deepseek_v3_671b_float8 config filters it too) and the shared experts (a FeedForward of
Linears). The routed experts are GroupedExperts parameters, which that converter leaves."""

MOE_MX_FQNS = ["attention", "feed_forward"]
"""MXFP8LinearConverter's include list for a mixture of experts: the attention's linears and
the dense layers' MLP (torchtitan's TransformerBlock.attention and .feed_forward), not the
MoE layer (.moe: router, shared and routed experts), as the plan prices them."""

FSDP2_MOE_PARENTS = ("experts", "shared_experts", "shared_expert")
"""FSDP2 module, mixture of experts: Linears under these modules (the routed experts, which
exports/fsdp2_moe.py expects in ``.experts``, and the shared experts) stay bf16, as do the
router's (FSDP2_MOE_MODULES)."""
FSDP2_MOE_MODULES = ("gate", "router")


def recipe(job) -> str:
    from amsp_planner.cost.fp8 import default_recipe

    return job.training.fp8_recipe or default_recipe(job.engine)


def refuse(target: str, job) -> None:
    """One line when `target` cannot run this FP8 plan (no-op for bf16/fp32 plans)."""
    if job.training.precision != "fp8":
        return
    if target in NO_FP8:
        raise AmspUserError(f"amsp export --to {target}: this is an FP8 plan and {NO_FP8[target]}; "
                            "export it --to torchtitan, fsdp2 or megatron, or plan with "
                            "--precision bf16")
    r = recipe(job)
    from amsp_planner.cost.fp8 import RECIPE, family_of

    arch = job.cluster.gpu.arch
    if arch not in RECIPE["tensorwise"].archs:  # an amsp plan's FP8 gathers run on any GPU
        raise AmspUserError(f"amsp export --to {target}: {target} runs the plan's linears in "
                            f"FP8, which this plan's GPU ({job.cluster.gpu.name}, {arch}) "
                            "cannot: export a --precision bf16 plan, or plan for a hopper or "
                            "blackwell cluster")

    if family_of(target) not in RECIPE[r].families:
        raise AmspUserError(f"amsp export --to {target}: the plan's FP8 recipe {r} is not one "
                            f"{target} runs; plan with --engine {target} and its recipe")
    if target == "torchtitan" and r == "tensorwise":
        raise AmspUserError("amsp export --to torchtitan: torchtitan 0.3 has no tensorwise "
                            "Float8 recipe nor FP8 all-gather (Float8LinearConverter runs "
                            "rowwise; pytorch/torchtitan 6348d93 removed them): plan with "
                            + ("" if job.engine == "torchtitan" else "--engine torchtitan ")
                            + "--fp8-recipe rowwise, or export --to fsdp2 (torchao tensorwise "
                            "with enable_fsdp_float8_all_gather)")
    if target == "fsdp2" and r not in ("tensorwise", "rowwise"):
        raise AmspUserError(f"amsp export --to fsdp2: the module converts with torchao's "
                            f"Float8LinearConfig (tensorwise or rowwise), not {r}; plan with "
                            "--fp8-recipe tensorwise or rowwise")
    if target == "megatron" and r not in MEGATRON_RECIPES:
        raise AmspUserError(f"amsp export --to megatron: --fp8-recipe {r} is not one of "
                            f"Megatron's ({', '.join(MEGATRON_RECIPES)})")


def pin_recipe(job):
    """The job with its FP8 recipe named (auto resolved with the plan's engine), so that the
    export writes the recipe the plan priced, not the target's default."""
    if job.training.precision != "fp8" or job.training.fp8_recipe:
        return job
    import dataclasses

    return dataclasses.replace(job, training=job.training.model_copy(
        update={"fp8_recipe": recipe(job)}))


def gathers_fp8(job, s=None) -> bool:
    """Whether the plan's weights are gathered in FP8: its strategy's ``fp8ag`` (the search's
    choice, docs/fp8.md), or --fp8-all-gather on where the recipe allows it."""
    from amsp_planner.cost.fp8 import fp8_all_gather_supported

    return bool(s is not None and s.fp8ag) or (
        job.training.fp8_all_gather == "on"
        and fp8_all_gather_supported(recipe(job), job.engine))


# ----- torchtitan ----------------------------------------------------------------------------
FP8_PREFIX = "#fp8 "
TT_MODULE = "amsp_fp8"


def torchtitan_converter(job) -> tuple[str, dict]:
    """(converter class, its Config keywords) for the plan's recipe."""
    moe = job.model.is_moe
    if recipe(job) == "mxfp8":
        return "MXFP8LinearConverter", {"fqns": MOE_MX_FQNS if moe else ["layers"],
                                        "model_compile_enabled": True}
    return "Float8LinearConverter", {"recipe_name": recipe(job),
                                     "filter_fqns": BF16_FQNS + (MOE_BF16_FQNS if moe else []),
                                     "model_compile_enabled": True}


def torchtitan_lines(job) -> list[str]:
    """The comment block of an FP8 torchtitan export: the config function to run."""
    cls, kw = torchtitan_converter(job)
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    code = [
        "import importlib",
        "",
        f"from torchtitan.components.quantization import {cls}",
        "",
        'BASE_MODULE = "llama3"  # your --module',
        'BASE_CONFIG = "llama3_8b"  # your --config',
        "",
        "",
        f"def {TT_MODULE}():",
        '    models = importlib.import_module(f"torchtitan.models.{BASE_MODULE}")',
        '    registry = importlib.import_module(f"torchtitan.models.{BASE_MODULE}.config_registry")',
        "    config = getattr(registry, BASE_CONFIG)()",
        "    config.model_spec = models.model_registry(",
        f"        config.model_spec.flavor, converters=[{cls}.Config({args})])",
        "    return config",
    ]
    return [f"# FP8 ({recipe(job)}): torchtitan 0.3 sets Float8 training in the config function's "
            "model_spec, not",
            "# by an override. Save the '#fp8' lines as amsp_fp8.py on PYTHONPATH (set BASE_MODULE"
            " and BASE_CONFIG",
            f"# to yours) and run --module {TT_MODULE} --config {TT_MODULE}:",
            "#   sed -n 's/^#fp8 \\?//p' FILE > amsp_fp8.py",
            *[(FP8_PREFIX + ln).rstrip() for ln in code]]


def torchtitan_code(text: str) -> str:
    """The Python of an export's '#fp8' lines ('' when there are none)."""
    tag = FP8_PREFIX.rstrip()
    return "\n".join(ln[len(tag):].removeprefix(" ") for ln in text.splitlines()
                     if ln.startswith(tag)) + "\n"


def check_torchtitan_code(text: str) -> dict | None:
    """Parse an export's FP8 config function (no torchtitan needed): {converter, keywords};
    None when the export has none. ValueError when it does not parse or builds anything else."""
    import ast

    code = torchtitan_code(text)
    if not code.strip():
        return None
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise ValueError(f"the '#fp8' config function does not parse: {e.msg}") from None
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if [f.name for f in funcs] != [TT_MODULE]:
        raise ValueError(f"the '#fp8' lines must define {TT_MODULE}()")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "Config"
             and isinstance(n.func.value, ast.Name)]
    if len(calls) != 1:
        raise ValueError("the '#fp8' config function must build one converter Config")
    call = calls[0]
    return {"converter": call.func.value.id,
            "keywords": {k.arg: ast.literal_eval(k.value) for k in call.keywords}}


def check_torchtitan_converter(found: dict) -> None:
    """Check a parsed converter against torchtitan's own Config class (installed torchtitan):
    its field names, and recipe_name among its Literal choices. ValueError otherwise."""
    import dataclasses
    import typing

    from torchtitan.components import quantization

    cfg = getattr(quantization, found["converter"]).Config
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for k, v in found["keywords"].items():
        if k not in fields:
            raise ValueError(f"{found['converter']}.Config has no field {k!r}")
        hints = typing.get_type_hints(cfg)
        choices = typing.get_args(hints[k]) if typing.get_origin(hints[k]) is typing.Literal \
            else None
        if choices and v not in choices:
            raise ValueError(f"{found['converter']}.Config.{k}={v!r}: torchtitan takes "
                             f"{', '.join(map(repr, choices))}")


# ----- FSDP2 ---------------------------------------------------------------------------------
def fsdp2_settings(job, s=None) -> dict:
    moe = job.model.is_moe
    return {"FP8_RECIPE": recipe(job), "FP8_ALL_GATHER": gathers_fp8(job, s),
            "FP8_BF16_MODULES": ("output", "lm_head") + (FSDP2_MOE_MODULES if moe else ()),
            "FP8_BF16_PARENTS": FSDP2_MOE_PARENTS if moe else ()}


FSDP2_BODY = '''

# ----- FP8 (torchao): the blocks' linears in FP8, converted before sharding -----------------
def fp8_filter(module, fqn: str) -> bool:
    """Which nn.Linear torchao converts: in and out features multiples of 16 (the FP8 tensor
    cores' requirement), and not the LM head (FP8_BF16_MODULES), nor, in a mixture of experts,
    the router and any Linear under the experts (FP8_BF16_PARENTS), as the plan prices them."""
    *parents, name = fqn.split(".")
    return (name not in FP8_BF16_MODULES and not set(parents) & set(FP8_BF16_PARENTS)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_fp8(model):
    """torchao's convert_to_float8_training with the plan's recipe: tensorwise
    (Float8LinearConfig, with enable_fsdp_float8_all_gather when FP8_ALL_GATHER) or rowwise
    (Float8LinearConfig.from_recipe_name). Call before fully_shard (apply does)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if FP8_RECIPE == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=FP8_ALL_GATHER)
    else:
        config = Float8LinearConfig.from_recipe_name(FP8_RECIPE)
    return convert_to_float8_training(model, module_filter_fn=fp8_filter, config=config)


def after_optimizer_step(model) -> None:
    """With the FP8 all-gather: one all-reduce of every FP8 weight's amax per step
    (torchao's precompute_float8_dynamic_scale_for_fsdp); call after optimizer.step()."""
    if FP8_RECIPE == "tensorwise" and FP8_ALL_GATHER:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


_apply_without_fp8 = apply


def apply(model, world_mesh=None, **kw):
    """convert_fp8, then the plan's checkpointing and sharding (the apply above)."""
    convert_fp8(model)
    return _apply_without_fp8(model, world_mesh, **kw)
'''


# ----- Megatron ------------------------------------------------------------------------------
def megatron_arguments(job, s) -> list[str]:
    """Megatron's FP8 arguments for the plan (module docstring)."""
    r = recipe(job)
    out = ["--fp8-format", FP8_FORMAT, "--fp8-recipe", r]
    if r == "delayed":
        out += ["--fp8-amax-history-len", "1", "--fp8-amax-compute-algo", "most_recent"]
    if gathers_fp8(job) and s.s_os > 1:
        out.append("--fp8-param-gather")
    return out
