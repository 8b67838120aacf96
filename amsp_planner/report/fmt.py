"""Number formatting shared by the reports."""

from __future__ import annotations

GIB = 1024**3


def gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def bytes_h(x: float) -> str:
    for unit, div in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(x) >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"


def secs(x: float) -> str:
    if x >= 1:
        return f"{x:,.3f} s"
    return f"{x * 1e3:,.1f} ms"


def console(file=None):
    """A rich Console: real width on a terminal, a wide fixed one otherwise (pipes, tests)."""
    import sys

    from rich.console import Console

    out = file or sys.stdout
    if out.isatty():
        return Console(file=out)
    return Console(file=out, width=200, no_color=True, highlight=False)
