"""The `note:` and `warning:` lines a command prints about its inputs, held until it succeeds:
a refused or infeasible command prints its one `error:` / `infeasible:` line alone (the
notes of a job that never ran would read as part of the refusal). ``cli/main.py`` prints them
when the command returns, or drops them when it fails; a command that streams its results
prints them before (``flush``)."""

from __future__ import annotations

import click

_PENDING: list[str] = []


def note(text: str, kind: str = "note") -> None:
    """Hold ``kind: text`` for stderr until the command succeeds (or ``flush``); a line held
    already is not held twice (a compare builds its job once per precision)."""
    line = f"{kind}: {text}"
    if line not in _PENDING:
        _PENDING.append(line)


def flush() -> None:
    """Print the held lines now (on stderr), in the order given."""
    while _PENDING:
        click.echo(_PENDING.pop(0), err=True)


def drop() -> None:
    """Forget the held lines: the command failed."""
    _PENDING.clear()
