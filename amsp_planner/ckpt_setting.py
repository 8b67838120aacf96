"""A checkpointing setting (the ``ckpt`` token of a strategy, ``--ckpt``): its parse, its
Strategy fields and the blocks it checkpoints. Re-exported by ``strategy.py``."""

from __future__ import annotations

from amsp_planner.errors import AmspUserError

CKPT_HELP = "a block count K (0 = none), 'op' (op-level selective), 'full' or 'none'"


def parse_ckpt_value(value: str, where: str) -> bool | int | str:
    """'full' -> True, 'none' -> False, 'op' -> 'op', 'K' -> K (K >= 0); AmspUserError
    naming `where` otherwise."""
    v = value.strip().lower()
    if v in ("full", "none", "op"):
        return {"full": True, "none": False, "op": "op"}[v]
    try:
        k = int(v)
    except ValueError:
        raise AmspUserError(f"{where}{value}: use {CKPT_HELP}") from None
    if k < 0:
        raise AmspUserError(f"{where}{value}: the block count must be at least 0")
    return k or False


def ckpt_fields(value: bool | int | str, num_layers: int | None = None) -> dict:
    """Strategy fields for a checkpointing setting (True, False, K or 'op'); with the block
    count given, K = L is full checkpointing and K = 0 none (the canonical forms)."""
    if value == "op":
        return {"ckpt": False, "ckpt_blocks": 0, "ckpt_op": True}
    if value is True or value is False:
        return {"ckpt": value, "ckpt_blocks": 0, "ckpt_op": False}
    k = int(value)
    if num_layers is not None and k >= num_layers:
        return {"ckpt": True, "ckpt_blocks": 0, "ckpt_op": False}
    return {"ckpt": False, "ckpt_blocks": k, "ckpt_op": False}


def checkpointed_blocks(value: bool | int | str, num_layers: int) -> tuple[int, bool]:
    """(K, op) of a checkpointing setting for L blocks: the blocks fully checkpointed (the
    first K), and whether every block is op-level checkpointed instead."""
    if value == "op":
        return 0, True
    if value is True:
        return num_layers, False
    if value is False:
        return 0, False
    return int(value), False
