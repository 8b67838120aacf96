"""Hugging Face ``config.json`` of a mixture-of-experts decoder -> the ModelSpec's MoE fields.

What each family's config says, read as transformers' modules build it (transformers 5.x,
``models/<type>/modeling_<type>.py``; tests/test_moe_models.py compares every family with
them on the meta device); the table in docs/models.md lists the same:

================  ==============================  =============================================
family            experts, top-k, expert width     MoE layers; extras
================  ==============================  =============================================
qwen3_moe         num_experts, num_experts_per_tok, layer i routes when i is not in
                  moe_intermediate_size           mlp_only_layers and (i+1) % decoder_sparse_step
                                                  == 0; q/k norms per head
qwen2_moe         same                            same; shared_expert_intermediate_size and its
                                                  gate; qkv_bias
mixtral           num_local_experts, ...,         every layer
                  intermediate_size
olmoe             num_experts, ..., intermediate  every layer; q/k norms over the projection
granitemoe        num_local_experts, ...,         every layer; top-k then softmax
                  intermediate_size
gpt_oss           num_local_experts, ...,         every layer; router and expert biases,
                  intermediate_size               attention sinks, layer_types' sliding layers
deepseek_v2/v3    n_routed_experts, ...,          i >= first_k_dense_replace and
                  moe_intermediate_size           i % moe_layer_freq == 0 (DeepSeek's own
                                                  modeling code; transformers reads only
                                                  first_k_dense_replace); n_shared_experts x
                                                  moe_intermediate_size shared; MLA; MTP modules
================  ==============================  =============================================

DeepSeek-V3's multi-token-prediction modules (``num_nextn_predict_layers``) are counted
(specs/moe.py: blocks appended after the main model's, as the checkpoint numbers them; their
embedding and head are the main model's). transformers builds none, so its model is the main
model alone.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from amsp_planner.errors import AmspUserError, format_validation_error
from amsp_planner.specs.fields import Flag, Int, Maybe, Text

_QWEN = {"experts": "num_experts", "width": "moe_intermediate_size", "place": "qwen"}
_EVERY = {"experts": "num_local_experts", "width": "intermediate_size", "place": "every"}
_DEEPSEEK = {"experts": "n_routed_experts", "width": "moe_intermediate_size",
             "place": "deepseek", "mla": True}
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": _QWEN,
    "qwen2_moe": {**_QWEN, "shared": "shared_expert_intermediate_size"},
    "mixtral": _EVERY,
    "olmoe": {**_EVERY, "experts": "num_experts"},
    "granitemoe": {**_EVERY, "routing": "topk_softmax"},
    "gpt_oss": {**_EVERY, "routing": "topk_softmax", "gpt_oss": True},
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": {**_DEEPSEEK, "mtp": True},
}

HYBRID = ("jamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "qwen3_next", "bamba",
          "zamba", "zamba2", "mamba", "mamba2", "lfm2", "lfm2_moe", "minimax", "falcon_mamba",
          "recurrent_gemma", "qwen3_5", "qwen3_5_moe")
"""Hybrid models with state-space or linear-attention layers: not a stack of attention blocks."""

# DeepSeek's (scoring_func, topk_method) -> ModelSpec.routing (specs/moe.py)
_DEEPSEEK_ROUTING = {("softmax", "greedy"): "softmax_topk",
                     ("softmax", "group_limited_greedy"): "softmax_group_topk",
                     ("sigmoid", "noaux_tc"): "sigmoid_group_topk"}
_DEEPSEEK_DEFAULT = {"deepseek_v2": ("softmax", "greedy"), "deepseek_v3": ("sigmoid", "noaux_tc")}


class HfMoeNumbers(BaseModel):
    """The MoE keys amsp reads, each of its exact JSON type and in range (as ``HfNumbers``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    num_experts: Maybe(Int(0, 65536)) = None
    num_local_experts: Maybe(Int(0, 65536)) = None
    n_routed_experts: Maybe(Int(0, 65536)) = None
    num_experts_per_tok: Maybe(Int(1, 1024)) = None
    moe_intermediate_size: Maybe(Int(1, 1048576)) = None
    shared_expert_intermediate_size: Maybe(Int(0, 1048576)) = None
    n_shared_experts: Maybe(Int(0, 1024)) = None
    decoder_sparse_step: Maybe(Int(1, 1024)) = None
    mlp_only_layers: list[Int(0, 1 << 20)] | None = None
    first_k_dense_replace: Maybe(Int(0, 1 << 20)) = None
    moe_layer_freq: Maybe(Int(1, 1024)) = None
    num_nextn_predict_layers: Maybe(Int(0, 16)) = None
    q_lora_rank: Maybe(Int(1, 65536)) = None
    kv_lora_rank: Maybe(Int(1, 65536)) = None
    qk_nope_head_dim: Maybe(Int(1, 65536)) = None
    qk_rope_head_dim: Maybe(Int(1, 65536)) = None
    v_head_dim: Maybe(Int(1, 65536)) = None
    sliding_window: Maybe(Int(1, 1048576)) = None
    layer_types: list[Text(100)] | None = None
    scoring_func: Maybe(Text(100)) = None
    topk_method: Maybe(Text(100)) = None
    qkv_bias: Maybe(Flag) = None
    mlp_bias: Maybe(Flag) = None


def _numbers(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        return HfMoeNumbers.model_validate(cfg).model_dump()
    except ValidationError as e:
        raise AmspUserError(format_validation_error(e, source) + ": fix the config") from None


def refuse_hybrid(mtype: str, source: str) -> None:
    if mtype in HYBRID:
        raise AmspUserError(
            f"{source}: model_type '{mtype}' is a hybrid with state-space or linear-attention "
            "layers, which are not modelled (only attention blocks are counted): write a model "
            "spec YAML of its attention layers, or plan another model")


def _dense_layers(c: dict[str, Any], fam: dict[str, Any], layers: int, source: str) -> list[int]:
    """0-based dense-MLP layers, from the family's placement keys."""
    if fam["place"] == "qwen":
        step = c["decoder_sparse_step"] or 1
        only = c["mlp_only_layers"] or []
        bad = [i for i in only if i >= layers]
        if bad:
            raise AmspUserError(f"{source}: field 'mlp_only_layers' has layer {bad[0]}, not below "
                                f"num_hidden_layers = {layers}: fix the list")
        dense = [i for i in range(layers) if i in only or (i + 1) % step]
    elif fam["place"] == "deepseek":
        first, freq = c["first_k_dense_replace"] or 0, c["moe_layer_freq"] or 1
        dense = [i for i in range(layers) if i < first or i % freq]
    else:
        dense = []
    if len(dense) >= layers:
        keys = {"qwen": "'mlp_only_layers' and 'decoder_sparse_step'",
                "deepseek": "'first_k_dense_replace' and 'moe_layer_freq'"}[fam["place"]]
        raise AmspUserError(f"{source}: {keys} leave no mixture-of-experts layer: fix them, or "
                            "give the dense model's config")
    return dense


def _routing(c: dict[str, Any], mtype: str, fam: dict[str, Any], source: str) -> str:
    if fam["place"] != "deepseek":
        return fam.get("routing", "softmax_topk")
    score, method = _DEEPSEEK_DEFAULT[mtype]
    score, method = c["scoring_func"] or score, c["topk_method"] or method
    if (score, method) not in _DEEPSEEK_ROUTING:
        known = ", ".join(f"{s}/{m}" for s, m in _DEEPSEEK_ROUTING)
        key = "scoring_func" if score not in {s for s, _ in _DEEPSEEK_ROUTING} else "topk_method"
        raise AmspUserError(
            f"{source}: field '{key}': routing scoring_func/topk_method = {score}/{method} is not "
            f"modelled (known: {known}): use one of those, or write a model spec YAML")
    return _DEEPSEEK_ROUTING[(score, method)]


def moe_data(cfg: dict[str, Any], mtype: str, source: str) -> dict[str, Any]:
    """ModelSpec fields that a MoE family's config adds to (or changes in) the dense ones."""
    fam = MOE_FAMILIES[mtype]
    c = {**cfg, **_numbers(cfg, source)}
    layers = cfg["num_hidden_layers"]
    out: dict[str, Any] = {}
    if fam.get("mla"):
        out.update(_mla(c, source))
    if fam.get("gpt_oss"):
        out.update(_gpt_oss(c, layers, source))
    if mtype == "deepseek_v2" and c["mlp_bias"]:
        raise AmspUserError(f"{source}: field 'mlp_bias' is true: DeepSeek-V2 then biases its "
                            "dense and shared MLPs but not its routed experts, which is not "
                            "modelled: set it to false, or write a model spec YAML")
    if mtype == "qwen2_moe":
        out["attention_bias"] = "qkv" if c["qkv_bias"] in (None, True) else "none"
    for key in ("first_k_dense_replace", "n_shared_experts") if fam["place"] == "deepseek" else ():
        if c[key] is None:
            raise AmspUserError(f"{source}: field '{key}' is missing: a {mtype} config needs it "
                                "(transformers' defaults differ between DeepSeek-V2 and V3)")
    experts = c[fam["experts"]]
    if not experts:
        if experts is None:
            raise AmspUserError(f"{source}: field '{fam['experts']}' is missing: a {mtype} "
                                "config needs its number of routed experts")
        return out  # 0 experts: transformers builds the dense model
    k = c["num_experts_per_tok"]
    if k is None or k > experts:
        why = "is missing" if k is None else f"= {k} exceeds '{fam['experts']}' = {experts}"
        raise AmspUserError(f"{source}: field 'num_experts_per_tok' {why}: give the router's "
                            "top-k, at most the number of experts")
    width = c[fam["width"]]
    if width is None:
        raise AmspUserError(f"{source}: field '{fam['width']}' is missing: a {mtype} config "
                            "needs the routed experts' width")
    mtp = (c["num_nextn_predict_layers"] or 0) if fam.get("mtp") else 0
    out.update(num_experts=experts, experts_per_token=k, expert_ffn_hidden_size=width,
               dense_layers=_dense_layers(c, fam, layers + mtp, source),
               routing=_routing(c, mtype, fam, source))
    if mtp:
        out.update(num_layers=layers + mtp, mtp_layers=mtp)
    if fam.get("shared"):
        if not c[fam["shared"]]:
            raise AmspUserError(f"{source}: field '{fam['shared']}' is {c[fam['shared']]}: "
                                f"{mtype} still builds the shared expert's gate, which is not "
                                "modelled without the shared expert: give its width")
        out.update(shared_expert_ffn_hidden_size=c[fam["shared"]], shared_expert_gate=True)
    if fam["place"] == "deepseek" and c["n_shared_experts"]:
        out["shared_expert_ffn_hidden_size"] = c["n_shared_experts"] * width
    return out


def _mla(c: dict[str, Any], source: str) -> dict[str, Any]:
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for key in keys:
        if c[key] is None:
            raise AmspUserError(f"{source}: field '{key}' is missing: multi-head latent "
                                "attention needs it")
    return {"q_lora_rank": c["q_lora_rank"], **{k: c[k] for k in keys},
            "num_kv_heads": None, "head_dim": None}


def _gpt_oss(c: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    types = c["layer_types"] or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                 for i in range(layers)]  # GptOssConfig's default
    odd = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if odd or len(types) != layers:
        why = f"has '{odd[0]}'" if odd else f"has {len(types)} entries for {layers} layers"
        raise AmspUserError(f"{source}: field 'layer_types' {why}: give one of "
                            "sliding_attention or full_attention per layer")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    out = {"router_bias": True, "attention_sinks": True, "mlp_bias": True}
    if sliding and c["sliding_window"]:
        out.update(sliding_window=c["sliding_window"], sliding_layers=sliding)
    return out
