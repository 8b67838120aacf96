"""Hugging Face ``config.json`` of a decoder -> ModelSpec, family by family.

Each family below is counted exactly (tests/test_hf_models.py and tests/test_moe_models.py
compare every one with the model ``transformers`` builds from the same config, module by
module); the mixture-of-experts families' own keys are read by specs/hf_moe.py. A config of
any other type, a multimodal one, a hybrid with state-space layers, or experts in a dense
family is refused with its reason. The keys read are validated first (``HfNumbers``: exact
types, finite, in range), naming the config's own key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from amsp_planner.errors import AmspUserError, format_validation_error
from amsp_planner.specs.fields import Flag, Int, Maybe, Real, Text
from amsp_planner.specs.hf_moe import MOE_FAMILIES, moe_data, refuse_hybrid

# model_type -> what its config leaves implicit: biases, MLP activation, norms, tied defaults.
# 'bias_key': the config flag that adds biases ('all': q, k, v and o; 'qkv': q, k, v only).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"bias_key": "all"},
    "mistral": {},
    "qwen2": {"attention_bias": "qkv"},
    "qwen3": {"bias_key": "all", "qk_norm": "head", "tied": True},
    "phi3": {},
    "granite": {"bias_key": "all"},
    "olmo2": {"bias_key": "all", "qk_norm": "full"},
    "gemma": {"ffn": "geglu", "tied": True, "act_key": "hidden_activation"},
    "gemma2": {"ffn": "geglu", "tied": True, "post_norms": True, "act_key": "hidden_activation"},
    "gemma3_text": {"ffn": "geglu", "tied": True, "post_norms": True, "qk_norm": "head",
                    "act_key": "hidden_activation"},
    # mixtures of experts (specs/hf_moe.py reads their MoE keys)
    "qwen3_moe": {"bias_key": "all", "qk_norm": "head"},
    "qwen2_moe": {},  # qkv_bias: specs/hf_moe.py
    "mixtral": {},
    "olmoe": {"bias_key": "all", "qk_norm": "full"},
    "granitemoe": {"bias_key": "all"},
    "gpt_oss": {"bias_key": "all", "bias_default": True},
    "deepseek_v2": {"bias_key": "all"},
    "deepseek_v3": {"bias_key": "all"},
}
_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu",
          "gelu_new": "geglu", "gelu_fast": "geglu"}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_MULTIMODAL = ("text_config", "vision_config", "audio_config")
_NEED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
         "vocab_size")


def _refuse_inexpressible(cfg: dict[str, Any], source: str) -> str:
    """The model_type of a config we count, or AmspUserError with the reason we cannot."""
    mtype = cfg.get("model_type")
    if not isinstance(mtype, str):
        raise AmspUserError(f"{source}: field 'model_type' must be a string such as \"llama\", "
                            f"got {type(mtype).__name__}: fix the config")
    refuse_hybrid(mtype, source)
    if any(k in cfg for k in _MULTIMODAL):
        raise AmspUserError(
            f"{source}: model_type '{mtype}' is multimodal (it has a "
            f"{next(k for k in _MULTIMODAL if k in cfg)}): the vision/audio towers are not "
            "counted; give the text model's config.json or write a model spec YAML")
    for key in _MOE_KEYS if mtype not in MOE_FAMILIES else ():
        n = cfg.get(key)
        if isinstance(n, int | float) and not isinstance(n, bool) and n > 1:
            raise AmspUserError(
                f"{source}: '{key}' = {n}: model_type '{mtype}' with experts is not supported: "
                f"the mixtures of experts counted are {', '.join(sorted(MOE_FAMILIES))}; "
                "write a model spec YAML for another")
    if mtype not in FAMILIES:
        raise AmspUserError(
            f"{source}: model_type '{mtype}' is not supported: use a decoder of type "
            f"{', '.join(sorted(FAMILIES))}, or write a model spec YAML")
    for key in _NEED:
        v = cfg.get(key)
        if v is None:
            raise AmspUserError(f"{source}: field '{key}' is missing: a {mtype} config needs it")
    return mtype


class HfNumbers(BaseModel):
    """The config keys amsp reads, each of its exact JSON type (strict: ``true`` is not a layer
    count and ``"false"`` is not a boolean) and in range (0 key/value heads, positions or RoPE
    base mean nothing). ``null`` or absent: the family's default. Other keys are not read."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    num_hidden_layers: Int(1, 1024)
    hidden_size: Int(8, 131072)
    num_attention_heads: Int(1, 4096)
    num_key_value_heads: Maybe(Int(1, 4096)) = None
    intermediate_size: Int(1, 1048576)
    vocab_size: Int(2, 4194304)
    head_dim: Maybe(Int(1, 65536)) = None
    max_position_embeddings: Maybe(Int(1, 1048576)) = None
    rope_theta: Maybe(Real(1.0, 1e12)) = None
    tie_word_embeddings: Maybe(Flag) = None
    attention_bias: Maybe(Flag) = None
    mlp_bias: Maybe(Flag) = None
    hidden_act: Maybe(Text(100)) = None
    hidden_activation: Maybe(Text(100)) = None


def _numbers(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        return HfNumbers.model_validate(cfg).model_dump()
    except ValidationError as e:
        raise AmspUserError(format_validation_error(e, source) + ": fix the config") from None


def _ffn_type(cfg: dict[str, Any], fam: dict[str, Any], mtype: str, source: str) -> str:
    key = fam.get("act_key", "hidden_act")
    act = cfg.get(key) or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if fam.get("ffn")
                                                    == "geglu" else "silu")
    ffn = _GATED.get(act) if isinstance(act, str) else None
    if ffn is None:
        raise AmspUserError(
            f"{source}: field '{key}' is {act!r}: {mtype} MLPs are counted as gated (silu or "
            "gelu); write a model spec YAML for other MLPs")
    return ffn


def _name(cfg: dict[str, Any], source: str) -> str:
    given = cfg.get("_name_or_path")
    if isinstance(given, str) and given.strip():
        return given.strip().rstrip("/").rsplit("/", 1)[-1] or given
    p = Path(source)
    return p.parent.name if p.name == "config.json" and p.parent.name else p.stem


def model_data(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """ModelSpec fields for a Hugging Face config of a family we count exactly."""
    raw = cfg
    mtype = _refuse_inexpressible(cfg, source)
    fam = FAMILIES[mtype]
    cfg = {**cfg, **_numbers(cfg, source)}
    bias = fam.get("attention_bias", "none")
    if fam.get("bias_key") and given_flag(cfg, "attention_bias", fam.get("bias_default", False)):
        bias = fam["bias_key"]
    heads = cfg["num_attention_heads"]

    def given(key: str, default):
        return default if cfg[key] is None else cfg[key]

    data = {
        "name": _name(cfg, source),
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": given("num_key_value_heads", heads),
        "ffn_hidden_size": cfg["intermediate_size"],
        "ffn_type": _ffn_type(cfg, fam, mtype, source),
        "vocab_size": cfg["vocab_size"],
        "tied_embeddings": given("tie_word_embeddings", fam.get("tied", False)),
        "max_seq_len": given("max_position_embeddings", 4096),
        "rope_theta": given("rope_theta", 10000.0),
        "attention_bias": bias,
        "mlp_bias": given("mlp_bias", False),
        "qk_norm": fam.get("qk_norm", "none"),
        "post_norms": fam.get("post_norms", False),
    }
    if cfg["head_dim"] is not None:
        data["head_dim"] = cfg["head_dim"]
    if mtype in MOE_FAMILIES:
        data["mlp_bias"] = False  # their MLPs take no mlp_bias key (gpt-oss: specs/hf_moe.py)
        data.update(moe_data(raw, mtype, source))
    return data


def given_flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    return default if cfg[key] is None else cfg[key]
