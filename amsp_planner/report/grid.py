"""Tables as data: a ``Grid`` of raw values renders as a terminal table, CSV or Markdown.

Terminal tables keep to the console's width: by default only the columns a reader needs
(``--wide`` shows them all), no cell is cut (cells wrap at spaces), and strategy strings wrap
only after a comma, never inside a token. CSV holds the raw numbers under snake_case keys;
Markdown the formatted cells of every column.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Col:
    title: str
    key: str
    fmt: Callable[[Any], str] = str
    right: bool = True
    wide: bool = False
    """Shown only with --wide (and always in CSV and Markdown)."""
    strategy: bool = False
    """A strategy string: wrapped after commas when the table must be narrower."""


@dataclass
class Grid:
    title: str
    cols: list[Col]
    rows: list[list[Any]] = field(default_factory=list)
    caption: str = ""

    def cells(self, wide: bool = True) -> tuple[list[Col], list[list[str]]]:
        keep = [i for i, c in enumerate(self.cols) if wide or not c.wide]
        cols = [self.cols[i] for i in keep]
        return cols, [["" if r[i] is None else self.cols[i].fmt(r[i]) for i in keep]
                      for r in self.rows]


def wrap_commas(text: str, width: int) -> str:
    """`text` in lines of at most `width` characters, broken only after commas."""
    toks = text.split(",")
    lines, cur = [], toks[0]
    for i, tok in enumerate(toks[1:], start=1):
        end = "" if i == len(toks) - 1 else ","  # a line that does not end here ends in ','
        if len(cur) + 1 + len(tok) + len(end) > width:
            lines.append(cur + ",")
            cur = tok
        else:
            cur += "," + tok
    return "\n".join(lines + [cur])


def _widths(cols: list[Col], cells: list[list[str]], width: int) -> list[int]:
    """Column widths for a table `width` wide: every column its full width when that fits,
    else titles wrap at spaces, the strategy column wraps after commas, titles fold (down to
    their cells' width), the strategy column wraps down to its longest token, in that order."""
    full, words, least = [], [], []
    for i, c in enumerate(cols):
        col = [r[i] for r in cells]
        if c.strategy:
            toks = [t for v in col for t in v.split(",")]
            full.append(max([len(v) for v in col] + [len(c.title)]))
            least.append(max([len(t) + 1 for t in toks] + [len(c.title)]))
            words.append(full[-1])
        else:
            cell = max([len(v) for v in col] + [1])
            full.append(max(cell, len(c.title)))
            words.append(max([cell] + [len(w) for w in c.title.split()]))
            least.append(max(cell, min(3, len(c.title))))  # a long title folds
    budget = width - 3 * len(cols) - 1  # one space each side of a cell, the borders
    out = list(full)
    half = [max(m, 16) if c.strategy else m for c, m in zip(cols, least, strict=True)]
    # titles wrap at spaces; strategies wrap to 16; titles fold; strategies wrap to a token
    stages = [(words, False), (half, True), (least, False), (least, True)]
    for floor, strategy in stages:
        for i, c in enumerate(cols):
            if sum(out) > budget and c.strategy == strategy:
                out[i] = max(floor[i], out[i] - (sum(out) - budget))
    return out


def rich_table(grid: Grid, wide: bool = False, width: int = 80):
    """The grid as a rich Table at most `width` columns wide when its cells allow (no cell is
    cut: a strategy wraps after commas, a title at spaces)."""
    from rich.table import Table

    cols, cells = grid.cells(wide)
    widths = _widths(cols, cells, width)
    t = Table(title=grid.title or None, title_justify="left", caption=grid.caption or None)
    for c, w in zip(cols, widths, strict=True):
        t.add_column(c.title, justify="right" if c.right else "left", overflow="fold", width=w)
    for row in cells:
        t.add_row(*[wrap_commas(v, w) if c.strategy else v
                    for c, v, w in zip(cols, row, widths, strict=True)])
    return t


def csv_text(grid: Grid) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([c.key for c in grid.cols])
    for r in grid.rows:
        w.writerow(["" if v is None else v for v in r])
    return buf.getvalue()


def markdown(grid: Grid) -> str:
    cols, cells = grid.cells(wide=True)

    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    out = [f"**{esc(grid.title)}**", ""] if grid.title else []
    out.append("| " + " | ".join(esc(c.title) for c in cols) + " |")
    out.append("| " + " | ".join("---:" if c.right else "---" for c in cols) + " |")
    out += ["| " + " | ".join(esc(v) for v in row) + " |" for row in cells]
    if grid.caption:
        out += ["", esc(grid.caption)]
    return "\n".join(out) + "\n"


FORMATS = ("table", "json", "csv", "markdown")


def format_option(f=None, *, json_flag: bool = True):
    """--format table|json|csv|markdown, --wide, and --json (an alias of --format json)."""
    import click

    def deco(f):
        f = click.option("--wide", is_flag=True, help="Tables: every column (default: the "
                         "main ones, to fit the terminal).")(f)
        if json_flag:
            f = click.option("--json", "as_json", is_flag=True,
                             help="Same as --format json.")(f)
        return click.option("--format", "fmt", type=click.Choice(FORMATS), default="table",
                            show_default=True, help="Output: terminal tables, JSON, CSV or "
                            "Markdown.")(f)

    return deco(f) if f is not None else deco


def pick_format(fmt: str, as_json: bool) -> str:
    from amsp_planner.errors import AmspUserError

    if as_json and fmt not in ("table", "json"):
        raise AmspUserError(f"give --json or --format {fmt}, not both")
    return "json" if as_json else fmt


def emit(grids: list[Grid | str], fmt: str, wide: bool, csv_of: Grid | None = None) -> None:
    """Print grids (and plain lines between them) as tables or Markdown; CSV: `csv_of`, else
    the first grid."""
    import click

    if fmt == "csv":
        click.echo(csv_text(csv_of or next(g for g in grids if isinstance(g, Grid))), nl=False)
        return
    if fmt == "markdown":
        click.echo("\n".join(markdown(g) if isinstance(g, Grid) else g + "\n" for g in grids),
                   nl=False)
        return
    from amsp_planner.report.fmt import console

    con = console()
    for g in grids:
        con.print(rich_table(g, wide, con.width) if isinstance(g, Grid) else g)
