"""What each engine runs for a mixture of experts' routed experts: the expert settings (e, its
placement, the expert triple) it runs with one dense triple, read from the engine's code
(``EngineProfile.expert_rule`` names the rule; docs/moe.md, "Engines"). The search
(``solver/space.py``: ``SearchSpace.expert_pairs``) and the exports (``exports/moe.py``) use
the same rules, so a plan made with ``--engine T`` always exports to T exactly.

========  ==========================================================  =========================
rule      dense (p, g, os) -> expert triples at (e, placement)         engine
========  ==========================================================  =========================
any       every nested expert triple, any placement                   amsp (the bundled runtime)
tied      (s, s, s) -> (f, f, f), f any factor the rules allow         the FSDP2 module
stages    stage 0/1/2/3 -> (1,1,1), (1,1,N/e), (1,N/e,N/e),            DeepSpeed 0.19.8 AutoEP
          (N/e,N/e,N/e); both placements
titan     (s, s, s) -> (s/e, s/e, s/e), e | s, in the node             torchtitan 0.3
os        (1, 1, 1) -> (1, 1, 1); (1, 1, N) -> (1, 1, N/e); in the     Megatron-Core
          node
none      e = 1 only, the experts following the dense triple           InternEvo
========  ==========================================================  =========================

Sources:
- DeepSpeed 0.19.8 (AutoEP, ``"expert_parallel": {"enabled": true, "autoep_size": e}``): one
  ZeRO stage for both classes, the expert class partitioned over the expert-data-parallel
  group (runtime/zero/stage_1_and_2.py: the MoE parameter groups use
  ``expert_dp_process_group``; stage3.py ``_autoep_expert_parallel_group``). EP groups are e
  consecutive ranks, or strided by N/e with ``use_data_before_expert_parallelism``
  (utils/groups.py ``_create_expert_and_data_parallel``). AutoEP with ZeRO-3 refuses hpZ and
  qgZ (engine.py ``_validate_zero3_moe_compatibility``).
- torchtitan 0.3 (``parallelism.expert_parallel_degree``): EP borrows e ranks from the FSDP
  group, innermost on the mesh (``ParallelDims.build_mesh``: sparse mesh (pp, dp_replicate,
  efsdp, ep)), so EP groups are e consecutive ranks; the experts are FSDP-sharded over
  efsdp = dp_shard / e (models/*/parallelize.py ``edp_mesh``).
- FSDP2 (the exported module): ``fully_shard`` on the experts with a mesh of their own, built
  from the rank grid of either placement (``strategy_experts.expert_factor_options``).
- Megatron-Core (``--expert-model-parallel-size e``): the rank order tp-cp-ep-dp-pp puts EP
  groups on consecutive ranks; the distributed optimizer shards the expert optimizer states
  over the expert-data-parallel group as the dense ones over the data-parallel group.
- InternEvo: no expert parallelism in the configurations this project exports
  (exports/internevo.py); the experts are parameters like the others (e = 1).

At e = 1 every rule but ``any`` and ``tied`` gives the dense triple: without expert
parallelism the experts are sharded as every other parameter.
"""

from __future__ import annotations

from collections.abc import Callable

from amsp_planner.strategy_experts import expert_factor_options

Triple = tuple[int, int, int]


def deepspeed_stage(t: Triple, n: int) -> int | None:
    """The ZeRO stage of a dense triple on N GPUs, None when it is not one."""
    return {(1, 1, 1): 0, (1, 1, n): 1, (1, n, n): 2, (n, n, n): 3}.get(tuple(t))


def _stages(t: Triple, e: int, span: bool, n: int, r: int) -> list[Triple]:
    stage = deepspeed_stage(t, n)
    if stage is None:
        return []
    f = n // e
    return [((1, 1, 1), (1, 1, f), (1, f, f), (f, f, f))[stage]]


def _titan(t: Triple, e: int, span: bool, n: int, r: int) -> list[Triple]:
    s = t[0]
    if span or not t[0] == t[1] == t[2] or s % e:
        return []
    return [(s // e,) * 3]


def _tied(t: Triple, e: int, span: bool, n: int, r: int) -> list[Triple]:
    if not t[0] == t[1] == t[2]:
        return []
    return [(f, f, f) for f in expert_factor_options(e, span, n, r)]


def _os(t: Triple, e: int, span: bool, n: int, r: int) -> list[Triple]:
    if span or t[0] != 1 or t[1] != 1 or t[2] not in (1, n):
        return []
    return [(1, 1, 1 if t[2] == 1 else n // e)]


def _none(t: Triple, e: int, span: bool, n: int, r: int) -> list[Triple]:
    return [tuple(t)] if e == 1 else []


RULES: dict[str, Callable[[Triple, int, bool, int, int], list[Triple]]] = {
    "stages": _stages, "titan": _titan, "tied": _tied, "os": _os, "none": _none,
}
"""Rule name -> (dense triple, e, span, N, R) -> the expert triples the engine runs with them
('any' has no entry: every nested triple)."""


def expert_pairs(rule: str, dense: list[Triple], e: int, span: bool, n: int, r: int
                 ) -> tuple[tuple[Triple, Triple], ...] | None:
    """The (dense triple, expert triple) pairs rule `rule` runs at (e, span) for the dense
    triples `dense`; None for 'any' (no restriction)."""
    if rule == "any":
        return None
    fn = RULES[rule]
    return tuple((tuple(t), x) for t in dense for x in fn(tuple(t), e, span, n, r))
