"""Tables as data: a ``Grid`` of raw values renders as a terminal table, CSV or Markdown.

Terminal tables keep to the console's width without splitting a word or a number: numbers never
wrap, text cells wrap only at spaces, strategy strings only after a comma, titles at spaces and
after '_', '.' or '/'. By default only the columns a reader needs are shown (``--wide`` shows them
all), and when even those do not fit, the columns marked ``drop`` are left out (highest first)
and the caption says which. CSV holds plain values under snake_case keys that name their unit:
numbers, strings, true/false, byte counts as integers; Markdown the formatted cells of every
column.
"""

from __future__ import annotations

import csv
import io
import re
import textwrap
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
    drop: int = 0
    """Left out of a terminal table too narrow for every column (highest first; 0: never)."""
    csv: Callable[[Any], dict[str, Any]] | None = None
    """The CSV columns of one value ({key: plain value}); default {key: the value}."""
    words: bool = False
    """Text cells that may wrap at spaces (default: left-aligned text, not numbers)."""

    @property
    def wraps(self) -> bool:
        return self.words or not (self.right or self.strategy)


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


def _title_pieces(title: str) -> list[str]:
    """A title's unbreakable pieces: words, identifiers broken after '_', '.' or '/'."""
    return [p for p in re.split(r"(?<=[_./])|\s+", title) if p]


def wrap_title(title: str, width: int) -> str:
    """`title` in lines of at most `width` characters (a longer piece keeps its line)."""
    lines: list[str] = []
    for word in title.split():
        cur = ""
        for piece in _title_pieces(word):
            if cur and len(cur) + len(piece) > width:
                lines.append(cur)
                cur = piece
            else:
                cur += piece
        if lines and len(lines[-1]) + 1 + len(cur) <= width and not lines[-1].endswith(
                ("_", ".", "/")):
            lines[-1] += " " + cur
        else:
            lines.append(cur)
    return "\n".join(lines)


def wrap_words(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width, break_long_words=False,
                                    break_on_hyphens=False)) or text


def _fit(c: Col, text: str, width: int) -> str:
    if c.strategy:
        return wrap_commas(text, width)
    return wrap_words(text, width) if c.wraps else text


def _least(c: Col, col: list[str]) -> int:
    """The narrowest the column can be without splitting a word or a number."""
    title = max(len(p) for p in _title_pieces(c.title))
    if c.strategy:
        return max([len(t) + 1 for v in col for t in v.split(",")] + [title])
    if c.wraps:
        return max([len(w) for v in col for w in v.split()] + [1, title])
    return max([len(v) for v in col] + [1, title])


def _widths(cols: list[Col], cells: list[list[str]], width: int) -> list[int]:
    """Column widths for a table `width` wide: every column its full width when that fits,
    else titles wrap at spaces, the strategy column wraps after commas (to 16), then every
    column narrows to its least width (``_least``), in that order."""
    full, words, least = [], [], []
    for i, c in enumerate(cols):
        col = [r[i] for r in cells]
        cell = max([len(v) for v in col] + [1])
        full.append(max(cell, len(c.title)))
        words.append(full[-1] if c.strategy else max([cell] + [len(w) for w in c.title.split()]))
        least.append(_least(c, col))
    budget = width - 3 * len(cols) - 1  # one space each side of a cell, the borders
    out = list(full)
    half = [max(m, 16) if c.strategy else m for c, m in zip(cols, least, strict=True)]
    stages = [(words, False), (half, True), (least, False), (least, True)]
    for floor, strategy in stages:
        for i, c in enumerate(cols):
            if sum(out) > budget and c.strategy == strategy:
                out[i] = max(floor[i], out[i] - (sum(out) - budget))
    return out


def _narrow(cols: list[Col], cells: list[list[str]], width: int) -> list[int]:
    """The columns kept at `width`: all when their least widths fit, else without the columns
    marked ``drop`` (all of the highest mark, then the next) until they do."""
    keep = list(range(len(cols)))

    def need(idx):
        return sum(_least(cols[i], [r[i] for r in cells]) for i in idx) + 3 * len(idx) + 1

    for mark in sorted({c.drop for c in cols if c.drop}, reverse=True):
        if need(keep) <= width:
            break
        keep = [i for i in keep if cols[i].drop != mark]
    return keep


def shown(grid: Grid, wide: bool, width: int) -> tuple[list[Col], list[list[str]], list[str]]:
    """The columns and cells a terminal table `width` wide shows, and the titles it leaves out
    (none with --wide)."""
    cols, cells = grid.cells(wide)
    if wide:
        return cols, cells, []
    keep = _narrow(cols, cells, width)
    left = [c.title for i, c in enumerate(cols) if i not in keep]
    return [cols[i] for i in keep], [[r[i] for i in keep] for r in cells], left


def rich_table(grid: Grid, wide: bool = False, width: int = 80):
    """The grid as a rich Table at most `width` columns wide when its cells allow: no word or
    number is split, and without --wide the ``drop`` columns are left out when needed."""
    from rich.table import Table

    cols, cells, left = shown(grid, wide, width)
    caption = grid.caption
    if left:
        caption = (caption + "; " if caption else "") + (
            f"left out at {width} columns: {', '.join(left)} (a wider terminal shows them)")
    widths = _widths(cols, cells, width)
    t = Table(title=grid.title or None, title_justify="left", caption=caption or None)
    for c, w in zip(cols, widths, strict=True):
        t.add_column(wrap_title(c.title, w), justify="right" if c.right else "left",
                     overflow="fold", width=w)
    for row in cells:
        t.add_row(*[_fit(c, v, w) for c, v, w in zip(cols, row, widths, strict=True)])
    return t


def plain(v: Any) -> Any:
    """A value as a CSV cell: true/false, numbers and strings as they are, None empty."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return v


def csv_text(grid: Grid) -> str:
    """Every column, raw values; a column with ``csv`` becomes the columns it gives."""
    heads: list[str] = []
    rows: list[list[Any]] = []
    for r in grid.rows:
        row = {}
        for c, v in zip(grid.cols, r, strict=True):
            row.update(c.csv(v) if c.csv else {c.key: v})
        if not heads:
            heads = list(row)
        rows.append([plain(row.get(k)) for k in heads])
    if not heads:
        heads = [c.key for c in grid.cols]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(heads)
    w.writerows(rows)
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
