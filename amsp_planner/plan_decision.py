"""A plan's decision: the strategy and what repeats it (components, meshes, scopes, ZeRO++
switches, micro-batch, accumulation, checkpointing, TP degree, a mixture of experts' experts),
and the lowest plan version that holds it (``plan_schema.VERSION``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amsp_planner.cost.evaluate import Evaluation
    from amsp_planner.strategy import Strategy


def decision(e: Evaluation, gpus_per_node: int, num_gpus: int = 0) -> dict:
    s = e.strategy
    comps = {}
    for c in ("p", "g", "os"):
        s0, s1 = s.mesh(c, gpus_per_node)
        f = s.factor(c)
        comps[c] = {"factor": f, "mesh": [s0, s1],
                    "scope": "none" if f == 1 else ("intra" if s1 == 1 else "inter")}
    return {"strategy": str(s.with_(grad_accum=None)), "components": comps, "qwz": s.qwz,
            "quant_block": s.quant_block, "hpz": s.hpz, "qgz": s.qgz,
            "micro_batch": s.micro_batch, "grad_accum": e.n_micro, "ckpt": s.ckpt_value,
            **({"tp": s.tp} if s.tp > 1 else {}), **({"cp": s.cp} if s.cp > 1 else {}),
            **({"pipeline": pipeline_decision(s)} if s.pp > 1 else {}),
            **({"experts": expert_decision(s, num_gpus, gpus_per_node)}
               if s.has_experts else {})}


def expert_decision(s: Strategy, num_gpus: int, gpus_per_node: int) -> dict:
    """The routed experts' part of a decision (docs/moe.md): degree, placement and the expert
    components, their meshes over the ranks holding the same experts."""
    lay = s.expert_layout(num_gpus, gpus_per_node)
    comps = {}
    for c in ("p", "g", "os"):
        f = s.expert_factor(c)
        s0, s1 = lay.mesh(f)
        comps[c] = {"factor": f, "mesh": [s0, s1],
                    "scope": "none" if f == 1 else ("intra" if s1 == 1 else "inter")}
    return {"ep": s.ep, "span": s.ep_span, "components": comps}


def pipeline_decision(s: Strategy) -> dict:
    """Pipeline parallelism's part of a decision (version 5): stages, virtual stages per rank
    and the schedule (strategy_pipeline.py)."""
    from amsp_planner.strategy_pipeline import schedule_of

    return {"pp": s.pp, "vpp": s.vpp, "schedule": schedule_of(s.pp, s.vpp, s.pp_sched)}


def plan_version(dec: dict, fp8: bool = False) -> int:
    """The lowest version that holds a decision (``VERSION``); `fp8`: the job trains in FP8
    (``inputs.training.precision`` fp8, its recipe and FP8 all-gather), version 6."""
    if fp8 or "fp8ag" in dec.get("strategy", "").split(","):
        return 6
    if dec.get("cp", 1) > 1 or "pipeline" in dec:
        return 5
    if "experts" in dec or dec["ckpt"] == "moe":
        return 4
    if dec.get("tp", 1) > 1:
        return 3
    return 1 if isinstance(dec["ckpt"], bool) else 2
