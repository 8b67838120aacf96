"""Errors that reach the user, and how their one line is kept readable.

Every error a user can cause is an ``AmspUserError`` (exit code 2): its message is one line that
names the field and says how to fix it. ``InfeasibleError`` (exit code 3) means the inputs are
valid but no strategy fits. Anything else is a bug and keeps its traceback.

A message echoes what the user gave; ``shown`` cuts one echoed value and ``readable`` the whole
line (``MAX_LINE`` characters at most, newlines folded), saying how much was cut, so a 100 kB
strategy string or path gives an error line one can read.
"""

from __future__ import annotations

import re


class AmspUserError(Exception):
    """Bad input: one line naming the field and the fix; exit code 2."""

    exit_code = 2


class InfeasibleError(Exception):
    """Valid input, but no strategy fits in memory; exit code 3."""

    exit_code = 3


def in_context(e: AmspUserError, context: str, own: str) -> AmspUserError:
    """`e` as the refusal of `context` (``--engine megatron: this fsdp2 plan ... cannot run
    there``): a check written for the options of ``amsp plan`` names options another command
    lacks, so the line first says which of this command's inputs it is about. A message that
    already starts with `own` (this command's option) is kept."""
    text = str(e)
    if text.startswith(own):
        return e
    return AmspUserError(f"{context}: {text}")


MAX_SHOWN = 100
"""Characters of one echoed input value shown in a message."""
MAX_LINE = 1000
"""Characters of a whole error line."""


def shown(value, limit: int = MAX_SHOWN) -> str:
    """`value` as text, cut to `limit` characters with a note of how many were cut."""
    text = str(value).replace("\r", " ").replace("\n", " ")
    if len(text) <= limit:
        return text
    head = max(1, limit * 3 // 4)
    tail = max(1, limit - head - 1)
    return f"{text[:head]}...{text[-tail:]} [{len(text):,} characters, cut]"


_LONG_WORD = re.compile(r"\S{" + str(MAX_SHOWN + 21) + ",}")


def readable(message: str, limit: int = MAX_LINE) -> str:
    """`message` on one line: newlines folded, every run of more than MAX_SHOWN + 20 characters
    without a space (an echoed value) cut by ``shown``, then the line itself cut in the middle
    (its start names the field, its end the fix) when still over `limit`."""
    line = " ".join(str(message).split("\n"))
    line = _LONG_WORD.sub(lambda m: shown(m.group(0)), line)
    if len(line) > limit:
        half = (limit - 40) // 2
        line = f"{line[:half]} ... [{len(line) - 2 * half:,} characters cut] ... {line[-half:]}"
    return line


def _input_note(err: dict) -> str:
    """', got X (type)' for the type errors pydantic reports without the input."""
    if not err.get("type", "").endswith("_type") or "input" not in err:
        return ""
    value = err["input"]
    if isinstance(value, dict | list):
        return f", got a {'mapping' if isinstance(value, dict) else 'list'}"
    kind = {bool: "a boolean", str: "a string", int: "an integer",
            float: "a number"}.get(type(value), type(value).__name__)
    text = "true" if value is True else "false" if value is False else repr(value)
    return f", got {shown(text, 40)} ({kind})"


_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _known_fields(model, loc: tuple) -> list[str] | None:
    """The field names of the (nested) pydantic model that holds ``loc[-1]``, or None."""
    from pydantic import BaseModel

    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    fields = getattr(model, "model_fields", None)
    return sorted(fields) if fields else None


def field_meant(model, loc: tuple) -> tuple[str | None, list[str]]:
    """For an unknown field at `loc` of pydantic `model`: (the field meant, when one is close;
    the fields of the model that holds it)."""
    from amsp_planner.specs.fields import suggest

    loc = tuple(p for p in loc if p != "__root__")
    names = (_known_fields(model, loc) if loc else None) or []
    return (suggest(str(loc[-1]), names) if names else None), names


def _extra_note(err: dict, model) -> str:
    """An unknown field: the field meant (``did you mean``), when one is close."""
    if err.get("type") != "extra_forbidden" or model is None:
        return ""
    close, _ = field_meant(model, tuple(err.get("loc", ())))
    return f" (no such field: did you mean '{close}'?)" if close else " (no such field: remove it)"


def format_validation_error(exc, source: str = "", model=None) -> str:
    """One line from a pydantic ValidationError naming every failing field and its message
    (for a value of the wrong type or out of range, the value given; for an unknown field of
    `model`'s, the field meant)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        if err.get("type") in _RANGE and "input" in err:
            msg += f", got {shown(repr(err['input']), 40)}"
        msg += _input_note(err) + _extra_note(err, model)
        parts.append(f"field '{loc}': {msg}" if loc else msg)
    where = f"{source}: " if source else ""
    return readable(where + "; ".join(parts))
