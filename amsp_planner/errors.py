"""Errors that reach the user.

Every error a user can cause is an ``AmspUserError`` (exit code 2): its message is one line that
names the field and says how to fix it. ``InfeasibleError`` (exit code 3) means the inputs are
valid but no strategy fits. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class AmspUserError(Exception):
    """Bad input: one line naming the field and the fix; exit code 2."""

    exit_code = 2


class InfeasibleError(Exception):
    """Valid input, but no strategy fits in memory; exit code 3."""

    exit_code = 3


def format_validation_error(exc, source: str = "") -> str:
    """One line from a pydantic ValidationError naming every failing field and its message."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        parts.append(f"field '{loc}': {msg}" if loc else msg)
    where = f"{source}: " if source else ""
    return (where + "; ".join(parts)).replace("\n", " ")
