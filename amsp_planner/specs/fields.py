"""The one validation layer for the numbers and types amsp reads: field types of the specs.

Every spec field (model and cluster specs, Hugging Face configs, calibrated tables, the specs a
plan file carries) is declared with one of these, so each is checked the same way:

- its type exactly, with no coercion (pydantic's strict mode): a boolean is not a number
  (``num_layers: true``, YAML's ``yes``/``on``), a number is not a boolean, a string is neither
  (``"tie_word_embeddings": "false"`` is refused, not read as true); an integer is a number;
- finite (no NaN or infinity), and within a stated range: sizes and counts at least 1 (zero
  heads or positions mean nothing), rates and bandwidths at least ``MIN_RATE`` (a subnormal
  ``1e-320`` GB/s would turn a transfer time into infinity), everything below a ceiling far
  above any real hardware (a ``1e308`` GiB memory would overflow to infinity in bytes).

The CLI's numeric options use the same rule (``amsp_planner/cli/options.py``: ``Number``).
"""

from __future__ import annotations

from typing import Annotated, get_args

from pydantic import Field, Strict

MIN_RATE = 1e-6
"""Smallest bandwidth (GB/s, Gbit/s) or throughput (TFLOP/s) accepted: 1 kB/s, 1 MFLOP/s."""
MAX_RATE = 1e5
"""Largest: 100 TB/s, 100 PFLOP/s per device."""


def Int(lo: int = 1, hi: int = 2**31):  # noqa: N802 (a type)
    """An integer (not a boolean, not a string) in [lo, hi]."""
    return Annotated[int, Strict(), Field(ge=lo, le=hi)]


def Real(lo: float, hi: float, lo_open: bool = False):  # noqa: N802 (a type)
    """A finite number (an integer is one; a boolean or a string is not) in [lo, hi], or
    (lo, hi] when `lo_open`."""
    bound = {"gt": lo} if lo_open else {"ge": lo}
    return Annotated[float, Strict(), Field(le=hi, allow_inf_nan=False, **bound)]


Rate = Real(MIN_RATE, MAX_RATE)
"""A bandwidth or a throughput: ``MIN_RATE`` to ``MAX_RATE``."""
Fraction = Real(MIN_RATE, 1.0)
"""A fraction of a peak or of a spec that divides a time: ``MIN_RATE`` to 1 (a subnormal one
would turn the time into infinity)."""
Flag = Annotated[bool, Strict()]
"""true or false only (not 1, "false" or "yes")."""


def Text(hi: int = 200):  # noqa: N802 (a type)
    """A non-empty string of at most `hi` characters (not a number)."""
    return Annotated[str, Strict(), Field(min_length=1, max_length=hi)]


def Maybe(t):  # noqa: N802 (a type)
    """`t` or null, its constraints kept on the field itself (where ``report/explain.py``
    reads a field's bound)."""
    base, *meta = get_args(t)
    return Annotated[base | None, *meta]


def suggest(name: str, names: list[str], aliases: dict[str, str] | None = None) -> str | None:
    """The name meant by `name`: its alias, the same name in other case, or the closest by
    ``difflib`` (None when nothing is close)."""
    import difflib

    if aliases and name in aliases:
        return aliases[name]
    lower = {n.lower(): n for n in names}
    if name.lower() in lower:
        return lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.75)
    return lower[close[0]] if close else None
