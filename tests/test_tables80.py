"""Tables at 80 columns keep every word and number whole; CSV cells are plain values."""

from __future__ import annotations

import csv
import io
import re

import pytest
from amsp_testlib import run_cli

import amsp_planner.report.grid as grid_mod

BOX = re.compile(r"[│┃┏┓┗┛┡┩└┘┳┻╇┼─━┬┴├┤]")


def _tokens(text: str) -> set[str]:
    return set(BOX.sub(" ", text).split())


@pytest.fixture
def rendered(monkeypatch):
    """Every Grid a command renders, with its table alone printed 80 columns wide."""
    from rich.console import Console

    seen: list[tuple[grid_mod.Grid, str]] = []
    real = grid_mod.rich_table

    def spy(grid, wide=False, width=80):
        table = real(grid, wide, width)
        buf = io.StringIO()
        Console(file=buf, width=80, no_color=True, color_system=None).print(table)
        seen.append((grid, buf.getvalue()))
        return table

    monkeypatch.setattr(grid_mod, "rich_table", spy)
    monkeypatch.setenv("COLUMNS", "80")
    return seen


CASES = {
    "plan": ["plan", "--model", "llama-7b", "--gpus", "1024", "-o", "-"],
    "plan tp": ["plan", "--model", "llama2-70b", "--gpus", "512", "--cluster", "dgx-h100-ndr",
                "--global-batch-seqs", "1024", "-o", "-"],
    "compare": ["compare", "--model", "llama-7b", "--gpus", "1024"],
    "whatif": ["whatif", "--model", "llama-7b", "--gpus", "64,1024", "--set",
               "nic_gbit_per_s=100,400", "-j", "1"],
    "whatif clusters": ["whatif", "--model", "llama-7b", "--gpus", "64,1024",
                        "--compare-clusters", "dgx-a100-hdr,dgx-h100-ndr", "-j", "1"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_word_or_number_is_split_at_80_columns(rendered, case):
    code, out, err = run_cli(CASES[case])
    assert code == 0, err
    assert rendered, "no table rendered"
    assert max(len(line) for line in out.splitlines()) <= 80
    for grid, text in rendered:
        assert max(len(line) for line in text.splitlines()) <= 80, grid.title
        toks = _tokens(text)
        shown = getattr(grid_mod, "shown", lambda g, wide, width: (*g.cells(wide), []))
        cols, cells, left = shown(grid, False, 80)
        assert all(c.drop for c in grid.cols if c.title in left)  # only optional columns go
        for c in cols:
            for piece in re.split(r"(?<=[_./])|\s+", c.title):
                assert any(piece in t for t in toks), (grid.title, c.title, piece)
        for row in cells:
            for c, v in zip(cols, row, strict=True):
                if c.strategy:  # broken only after a comma (the what-if ' *' mark apart)
                    for part in v.removesuffix(" *").split(","):
                        assert any(part in t for t in toks), (c.title, v)
                else:
                    for word in v.split():
                        assert word in toks, (grid.title, c.title, v, word)


def _rows(argv):
    code, text, err = run_cli(argv)
    assert code == 0, err
    return list(csv.reader(io.StringIO(text)))


def _kind(cell: str):
    """The plain type a CSV cell holds: '' (none), bool, int, float or str."""
    if cell == "":
        return ""
    if cell in ("true", "false"):
        return bool
    for t in (int, float):
        try:
            t(cell)
            return t
        except ValueError:
            pass
    return str


@pytest.mark.parametrize("argv", [
    ["compare", "--model", "llama-7b", "--gpus", "64", "--format", "csv"],
    ["plan", "--model", "tiny", "--gpus", "8", "--cluster", "cpu-local", "--seq-len", "128",
     "--global-batch-seqs", "32", "-o", "-", "--format", "csv"],
])
def test_csv_cells_are_plain_values_with_unit_headers(argv):
    head, *rows = _rows(argv)
    assert rows
    for row in rows:
        assert len(row) == len(head)
        for key, cell in zip(head, row, strict=True):
            kind = _kind(cell)
            assert not cell.startswith(("(", "[", "{")), (key, cell)  # no Python reprs
            if "bytes" in key:
                assert kind is int, (key, cell)  # whole bytes
            elif key.endswith(("_s", "_gib", "_pct", "mfu")):
                assert kind in (int, float, ""), (key, cell)
            elif key in ("fits", "within_band"):
                assert kind in (bool, ""), (key, cell)
            elif key in ("name", "strategy"):
                assert kind is str or key == "name", (key, cell)
            else:
                raise AssertionError(f"header {key!r} does not say its unit")
    assert any(h.endswith("_pct") for h in head) and "within_band" in head
