"""What each export target does with a mixture-of-experts plan's routed experts (docs/exports.md).

A plan for an MoE model may carry an expert strategy (docs/moe.md): the expert-parallel degree
e (``ep=``), its placement (``ep.span``) and the expert class's own triple (``ep.p``, ``ep.g``,
``ep.os``) over the N/e ranks that hold the same experts (the EDP group). Each engine ties the
expert triple to its dense setting in its own way; ``RULES`` lists, per target, the expert
setting it runs for one dense candidate and one (e, placement), read from the engine's code
(the rules themselves are engine_experts.py's, which the search uses too):

- DeepSpeed 0.19.8 (AutoEP, ``"expert_parallel": {"enabled": true, "autoep_size": e}``): one
  ZeRO stage for both classes, the expert class partitioned over the expert-data-parallel group
  (runtime/zero/stage_1_and_2.py: the MoE parameter groups use ``expert_dp_process_group``;
  stage3.py ``_autoep_expert_parallel_group``): stage 0/1/2/3 -> (1, 1, 1), (1, 1, N/e),
  (1, N/e, N/e), (N/e, N/e, N/e). EP groups are e consecutive ranks, or strided by N/e with
  ``use_data_before_expert_parallelism`` (utils/groups.py ``_create_expert_and_data_parallel``):
  both placements. AutoEP with ZeRO-3 refuses hpZ and qgZ (engine.py
  ``_validate_zero3_moe_compatibility``).
- torchtitan 0.3 (``parallelism.expert_parallel_degree``): EP borrows e ranks from the FSDP
  group, innermost on the mesh (``ParallelDims.build_mesh``: sparse mesh (pp, dp_replicate,
  efsdp, ep)), so EP groups are e consecutive ranks; the experts are FSDP-sharded over
  efsdp = dp_shard / e and replicated over dp_replicate (models/*/parallelize.py ``edp_mesh``):
  dense (s, s, s) -> experts (s/e, s/e, s/e), e | s, in the node.
- FSDP2 (the exported module): ``fully_shard`` on the experts with a mesh of their own, built
  from the rank grid of either placement: dense (s, s, s) and experts (f, f, f) for any factor
  f the rules allow (``strategy_experts.expert_factor_options``).
- Megatron-Core (``--expert-model-parallel-size e``): the rank order tp-cp-ep-dp-pp puts EP
  groups on consecutive ranks; the distributed optimizer shards the expert optimizer states over
  the expert-data-parallel group as the dense ones over the data-parallel group: dense (1, 1, N)
  -> experts (1, 1, N/e), DDP (1, 1, 1) -> (1, 1, 1); with several distributed-optimizer
  instances the expert sharding is not expressed here.
- InternEvo: no expert parallelism here; the experts follow the dense triple (e = 1).

``with_experts`` turns a target's dense candidates into its MoE candidates; ``common.expressible``
calls it for a plan with an expert strategy, so the closest-plan search and its priced
differences (``common.translate``) cover e, the placement and the expert triple as well.
"""

from __future__ import annotations

from collections.abc import Callable

from amsp_planner import engine_experts
from amsp_planner.strategy import Strategy
from amsp_planner.strategy_experts import ep_options

Triple = tuple[int, int, int]


def deepspeed_stage(s: Strategy, n: int) -> int | None:
    """The ZeRO stage of a dense triple on N GPUs, None when it is not one."""
    return engine_experts.deepspeed_stage((s.s_p, s.s_g, s.s_os), n)


def _rule(name: str, zeropp_ok: bool = True):
    """The engine rule `name` of engine_experts.py over a dense candidate; without
    `zeropp_ok`, none for a candidate with hpZ or qgZ (DeepSpeed AutoEP with ZeRO-3)."""
    fn = engine_experts.RULES[name]

    def rule(c: Strategy, e: int, span: bool, n: int, r: int) -> list[Triple]:
        if not zeropp_ok and e > 1 and deepspeed_stage(c, n) == 3 and (c.hpz > 1 or c.qgz):
            return []
        return fn((c.s_p, c.s_g, c.s_os), e, span, n, r)

    return rule


RULES: dict[str, Callable[[Strategy, int, bool, int, int], list[Triple]]] = {
    "deepspeed": _rule("stages", zeropp_ok=False), "torchtitan": _rule("titan"),
    "fsdp2": _rule("tied"), "amsp": _rule("tied"), "megatron": _rule("os"),
}
"""Target -> (dense candidate, e, span, N, R) -> the expert triples it runs with them (the
engine rules of engine_experts.py)."""


def with_experts(engine: str, num_experts: int, num_gpus: int, gpus_per_node: int,
                 dense: list[Strategy]) -> list[Strategy]:
    """The MoE candidates of `engine`: each dense setting of `dense` with the experts following
    the dense triple (e = 1) and with every expert setting the engine runs with it, valid by the
    strategy rules (``Strategy.check``)."""
    rule = RULES.get(engine)
    # the engine's search space may already spell experts (every triple the strategy rules
    # allow): keep its dense settings, the engine's rule decides the expert ones
    out = list(dict.fromkeys(c.with_(ep=1, ep_span=False, ep_p=None, ep_g=None, ep_os=None)
                             for c in dense))
    if rule is None or not num_experts:
        return out
    n, r = num_gpus, gpus_per_node
    for c in list(out):
        if c.tp > 1:  # tensor parallelism of an MoE model is not modelled (docs/moe.md)
            continue
        for e, span in ep_options(num_experts, n, r):
            for p, g, os_ in rule(c, e, span, n, r):
                s = c.with_(ep=e, ep_span=span, ep_p=p, ep_g=g, ep_os=os_)
                try:
                    s.check(n, r)
                except ValueError:
                    continue
                out.append(s)
    return out


def expert_knobs(plan: Strategy, closest: Strategy) -> list[tuple[str, str, bool]]:
    """(knob, line, lost) per expert setting that differs (common.knob_differences)."""
    if not (plan.has_experts or closest.has_experts):
        return []
    out = []
    if plan.ep != closest.ep:
        out.append(("ep", f"ep {plan.ep} -> {closest.ep}", True))
    if plan.ep_span != closest.ep_span:
        where = {False: "in the node", True: "spanning nodes"}
        out.append(("ep.span", f"EP placement {where[plan.ep_span]} -> "
                    f"{where[closest.ep_span]}", True))
    for c in ("p", "g", "os"):
        a, b = plan.expert_factor(c), closest.expert_factor(c)
        if a != b:
            out.append((f"ep.{c}", f"expert s_{c.upper()} {a} -> {b}", True))
    return out


def expert_groups(s: Strategy, num_gpus: int, gpus_per_node: int) -> dict[str, list[list[int]]]:
    """The EP and EDP groups of `s` as rank lists (strategy_experts.ExpertLayout), for the
    tests to hold an export's groups against."""
    lay = s.expert_layout(num_gpus, gpus_per_node)

    def groups(size: int, stride: int) -> list[list[int]]:
        seen, out = set(), []
        for r0 in range(num_gpus):
            if r0 in seen:
                continue
            base = r0 - (r0 // stride % size) * stride
            g = [base + k * stride for k in range(size)]
            seen.update(g)
            out.append(g)
        return sorted(out)

    return {"ep": groups(lay.ep_size, lay.ep_stride),
            "edp": groups(lay.edp_size, lay.edp_stride)}
