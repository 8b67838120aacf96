"""DeepSpeed's expert parallelism (AutoEP, DeepSpeed 0.19.8) in a plan's ds_config.

A plan with an expert strategy (``ep=E``, docs/moe.md) adds to the ds_config::

    "expert_parallel": {"enabled": true, "autoep_size": E, "expert_tensor_parallel_size": 1},
    "use_data_before_expert_parallelism": false | true

``autoep_size`` is the expert-parallel degree (``module_inject/auto_ep_config.py``
``parse_autoep_config``); AutoEP finds the model's MoE layers itself (its presets: Mixtral,
Qwen3-MoE, DeepSeek-V2/V3, ...; ``preset_model`` may name one). The EP groups are E consecutive
ranks (the plan's placement in the node) unless ``use_data_before_expert_parallelism`` puts
them strided by N/E (``ep.span``; ``utils/groups.py _create_expert_and_data_parallel``). The ZeRO
stage of the dense triple applies to the experts over the N/E ranks holding the same experts:
stage 1, 2, 3 -> (1, 1, N/E), (1, N/E, N/E), (N/E, N/E, N/E) (exports/moe.py). Native
``deepspeed.moe.layer.MoE`` layers take ``ep_size`` in the model code instead and are refused
with ZeRO-3; AutoEP runs ZeRO-3 without hpZ or qgZ (``engine.py
_validate_zero3_moe_compatibility``).
"""

from __future__ import annotations

from typing import Any

from amsp_planner.strategy import Strategy

WHY = {
    "ep.p": "DeepSpeed applies one ZeRO stage to the dense and the expert class",
    "ep.g": "DeepSpeed applies one ZeRO stage to the dense and the expert class",
    "ep.os": "DeepSpeed applies one ZeRO stage to the dense and the expert class",
}


def fields(s: Strategy, num_gpus: int) -> dict[str, Any]:
    """The ds_config keys of `s`'s expert strategy (none without one, or at e = 1)."""
    if not s.has_experts or s.ep == 1:
        return {}
    from amsp_planner.exports.moe import RULES

    assert [(s.ep_p, s.ep_g, s.ep_os)] == RULES["deepspeed"](s, s.ep, s.ep_span, num_gpus, 1), s
    return {"expert_parallel": {"enabled": True, "autoep_size": s.ep,
                                "expert_tensor_parallel_size": 1},
            "use_data_before_expert_parallelism": s.ep_span}


def parse_with_deepspeed(config: dict[str, Any], num_gpus: int, stage: int) -> dict[str, Any]:
    """Parse the expert keys of `config` with DeepSpeed's own code and validate them for N
    GPUs at `stage` (``validate_autoep_config``: the folding and stage rules); returns
    {"ep", "ep_span", "enabled"}. Raises what DeepSpeed raises; needs the interop extra."""
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config
    from deepspeed.runtime.config import get_expert_data_topo_config, get_expert_parallel_config

    cfg = get_expert_parallel_config(config)
    validate_autoep_config(cfg, num_gpus, 1, 1, 1, zero_stage=stage,
                           use_data_before_expert_parallel=get_expert_data_topo_config(config))
    if cfg.enabled and num_gpus % cfg.autoep_size:
        raise ValueError(f"autoep_size {cfg.autoep_size} does not divide {num_gpus} GPUs")
    return {"enabled": cfg.enabled, "ep": cfg.autoep_size if cfg.enabled else 1,
            "ep_span": bool(get_expert_data_topo_config(config))}


def notes(s: Strategy) -> list[str]:
    if not s.has_experts or s.ep == 1:
        return []
    return ["expert parallelism runs through AutoEP (\"expert_parallel\"), which replaces the "
            "model's MoE layers at initialisation; with native deepspeed.moe.layer.MoE layers, "
            f"pass ep_size={s.ep} in the model code and put the expert parameters in their own "
            "optimizer groups (deepspeed.moe.utils.split_params_into_different_moe_groups_for_"
            "optimizer), else ZeRO-1/2 leave their optimizer states unpartitioned"]
