"""A plan file's stored fields against the ones re-derived from its decision: the first
difference (numbers to 1e-9 relative, counts exact) and its one-line refusal."""

from __future__ import annotations

import json
import math
from typing import Any

from amsp_planner.errors import AmspUserError

_MISSING = object()


def _show(v: Any) -> str:
    if v is _MISSING:
        return "missing"
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, bool) or isinstance(got, bool) or want is None:
        return type(got) is type(want) and got == want
    if isinstance(want, int):  # counts and byte counts are exact
        return isinstance(got, int | float) and got == want
    if isinstance(want, float):
        return isinstance(got, int | float) and math.isclose(got, want, rel_tol=1e-9,
                                                              abs_tol=1e-300)
    return type(got) is type(want) and got == want


def _difference(got: Any, want: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place where `got` (a stored field) differs from `want` (re-derived): its path,
    the stored value and the derived one; None when they agree (numbers to 1e-9 relative)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return path, got, want
        for k in want:
            d = _difference(got.get(k, _MISSING), want[k], f"{path}.{k}")
            if d:
                return d
        extra = [k for k in got if k not in want]
        return (f"{path}.{extra[0]}", got[extra[0]], _MISSING) if extra else None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return path, got, want
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            d = _difference(a, b, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if _same(got, want) else (path, got, want)


def _refuse_difference(got: Any, want: Any, path: str, basis: str, source: str) -> None:
    d = _difference(got, want, path)
    if d is None:
        return
    where, a, b = d
    where = where if len(where) <= 120 else where[:117] + "..."  # a key can be any length
    if isinstance(b, list) and not (isinstance(a, list) and len(a) == len(b)):
        wanted = f"a list of {len(b)} entries"
        held = (f"a list of {len(a)}" if isinstance(a, list) else _show(a))
    else:
        wanted, held = _show(b), _show(a)
    raise AmspUserError(
        f"{source}: field '{where}' is {held}, but {basis.replace('{}', wanted, 1)} (the plan "
        "was edited, or made by another amsp version): regenerate it with amsp plan"
    )
