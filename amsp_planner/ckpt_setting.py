"""A checkpointing setting (the ``ckpt`` token of a strategy, ``--ckpt``): its parse, its
Strategy fields and the blocks it checkpoints. Re-exported by ``strategy.py``."""

from __future__ import annotations

from amsp_planner.errors import AmspUserError

CKPT_HELP = ("a block count K (0 = none), 'op' (op-level selective), 'moe' (the MoE MLPs only), "
             "'full' or 'none'")


def parse_ckpt_value(value: str, where: str) -> bool | int | str:
    """'full' -> True, 'none' -> False, 'op' -> 'op', 'moe' -> 'moe', 'K' -> K (K >= 0);
    AmspUserError naming `where` otherwise."""
    v = value.strip().lower()
    if v in ("full", "none", "op", "moe"):
        return {"full": True, "none": False, "op": "op", "moe": "moe"}[v]
    try:
        k = int(v)
    except ValueError:
        raise AmspUserError(f"{where}{value}: use {CKPT_HELP}") from None
    if k < 0:
        raise AmspUserError(f"{where}{value}: the block count must be at least 0")
    return k or False


def ckpt_fields(value: bool | int | str, num_layers: int | None = None) -> dict:
    """Strategy fields for a checkpointing setting (True, False, K, 'op' or 'moe'); with the
    block count given, K = L is full checkpointing and K = 0 none (the canonical forms)."""
    off = {"ckpt": False, "ckpt_blocks": 0, "ckpt_op": False, "ckpt_moe": False}
    if value in ("op", "moe"):
        return off | {f"ckpt_{value}": True}
    if value is True or value is False:
        return off | {"ckpt": value}
    k = int(value)
    if num_layers is not None and k >= num_layers:
        return off | {"ckpt": True}
    return off | {"ckpt_blocks": k}


def checkpointed_blocks(value: bool | int | str, num_layers: int) -> tuple[int, bool]:
    """(K, op) of a checkpointing setting for L blocks: the blocks fully checkpointed (the
    first K), and whether every block is op-level checkpointed instead. 'moe' (each MoE
    layer's MLP part recomputed, the rest of every block kept: ``is_moe_only``) is (0, False):
    no whole block is checkpointed."""
    if value == "op":
        return 0, True
    if value is True or value == "moe":
        return (0 if value == "moe" else num_layers), False
    if value is False:
        return 0, False
    return int(value), False


def is_moe_only(value) -> bool:
    """Whether a checkpointing setting is 'moe': every MoE layer recomputes its MoE MLP part
    (router, dispatch, experts, shared experts, combine) in backward from the MLP's input,
    kept, as Megatron-Core's ``--recompute-granularity selective --recompute-modules moe``
    (megatron/core/transformer/moe/moe_layer.py at d98e8a6, ``MoELayer.forward``:
    ``tensor_parallel.checkpoint(custom_forward, False, hidden_states, ...)``)."""
    return isinstance(value, str) and value == "moe"


def stops_early(job, tp: int = 1) -> bool:
    """A checkpointed block's recomputation stops before the block's last linear (and its TP
    reduce-scatter): the engine's checkpoint stops early (``EngineProfile.ckpt_early_stop``),
    the block is dense (a MoE block ends in the experts' combine), and, at tp > 1, the engine
    is not the bundled runtime, which turns the early stop off under TP so that the
    recomputation reissues every TP collective (runtime/tp.py ``run_block``; its measured
    bytes: tests/runtime/test_sharded_training.py, tp2_zero3_ckpt1)."""
    if tp > 1 and job.engine == "amsp":
        return False
    return job.profile.ckpt_early_stop and not job.model.is_moe


def ckpt_option(text: str) -> bool | int | str | None:
    """--activation-checkpointing: auto -> None, on -> True, off -> False, K -> K blocks
    (0 = off), op -> 'op', moe -> 'moe'; one line naming the option otherwise."""
    v = str(text).strip().lower()
    if v in ("auto", "on", "off"):
        return {"on": True, "off": False, "auto": None}[v]
    try:
        return parse_ckpt_value(v, "--activation-checkpointing ")
    except AmspUserError:
        raise AmspUserError(f"--activation-checkpointing {text}: use auto, on, off, a block "
                            "count K (the first K blocks), op or moe") from None
