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
    """A rich Console: the terminal's width on a terminal; off one, $COLUMNS if set, else no
    limit (pipes and files get whole rows). NO_COLOR (no-color.org) drops every style: colour,
    bold and italic."""
    import os
    import sys

    from rich.console import Console

    out = file or sys.stdout
    plain = bool(os.environ.get("NO_COLOR"))
    style = {"color_system": None} if plain else {}
    if out.isatty():
        return Console(file=out, highlight=not plain, **style)
    cols = os.environ.get("COLUMNS", "")
    width = int(cols) if cols.isdigit() and int(cols) > 0 else 1000
    return Console(file=out, width=width, no_color=True, highlight=False, color_system=None)
