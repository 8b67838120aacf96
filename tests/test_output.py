"""What the terminal shows: 80-column tables, --format, suggestions, all validation problems,
specs show, NO_COLOR; and the files amsp writes (their mode, what is refused)."""

from __future__ import annotations

import csv
import io
import json
import os
import stat

import pytest
from amsp_testlib import assert_user_error, run_cli

SMALL = ["--model", "tiny", "--gpus", "16", "--cluster", "cpu-local", "--global-batch-seqs", "64"]
BIG = ["--model", "llama-7b", "--gpus", "1024"]


def _strategy_cells(out: str, col: int) -> list[str]:
    """Column `col` of a rich table's body, wrapped lines joined back together, without the
    what-if table's ' *' mark (a point kept no slower than the one before it)."""
    cells: list[str] = []
    body = False
    for line in out.splitlines():
        if line.startswith("┡") or line.startswith("└"):
            body = line.startswith("┡")
            continue
        if body and line.startswith("│"):
            parts = [p.strip() for p in line.split("│")[1:-1]]
            if parts[0]:
                cells.append(parts[col])
            else:
                cells[-1] += parts[col]
    return [c.removesuffix(" *").removesuffix("*") for c in cells]


@pytest.mark.parametrize("command, argv, col", [
    ("compare", BIG, 1),
    ("whatif", ["--model", "llama-7b", "--gpus", "64,1024", "--set", "nic_gbit_per_s=100,400",
                "-j", "1"], 2),
])
def test_tables_fit_80_columns_and_keep_strategies_whole(monkeypatch, command, argv, col):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli([command, *argv])
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    code, text, _ = run_cli([command, *argv, "--format", "csv"])
    want = [r["strategy"] for r in csv.DictReader(io.StringIO(text))]
    assert _strategy_cells(out, col) == want
    monkeypatch.setenv("COLUMNS", "400")
    _, wide, _ = run_cli([command, *argv, "--wide"])
    assert "exposed comm" in wide and "exposed comm" not in out


def test_off_a_terminal_rows_never_wrap(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    _, out, _ = run_cli(["compare", *BIG])
    body = [line for line in out.splitlines() if line.startswith("│")]
    assert len(body) == 7 and all(line.split("│")[1].strip() for line in body)


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_formats_json_csv_markdown(tmp_path, command):
    extra = ["-o", "-"] if command == "plan" else []
    _, js, _ = run_cli([command, *SMALL, *extra, "--format", "json"])
    _, alias, _ = run_cli([command, *SMALL, *extra, "--json"])
    def stable(doc):
        return {k: v for k, v in json.loads(doc).items() if k not in ("volatile", "digest")}

    assert stable(js) == stable(alias)
    _, text, _ = run_cli([command, *SMALL, *extra, "--format", "csv"])
    rows = list(csv.DictReader(io.StringIO(text)))
    names = [r["name"] for r in rows]
    assert {"zero3", "ddp"} <= set(names)
    assert all(0 < float(r["mfu"]) < 1 for r in rows)
    _, md, _ = run_cli([command, *SMALL, *extra, "--format", "markdown"])
    head = next(line for line in md.splitlines() if line.startswith("| name |"))
    assert "exposed comm" in head  # Markdown holds every column
    assert_user_error(*run_cli([command, *SMALL, *extra, "--json", "--format", "csv"]),
                      "--json")


def test_whatif_formats_match_its_files(tmp_path):
    argv = ["whatif", *SMALL[:2], "--gpus", "8,16", "--cluster", "cpu-local",
            "--global-batch-seqs", "64", "-j", "1"]
    f = tmp_path / "rows.csv"
    _, text, _ = run_cli([*argv, "--format", "csv", "--csv", str(f)])
    assert text == f.read_text()
    _, js, _ = run_cli([*argv, "--format", "json"])
    assert [r["gpus"] for r in json.loads(js)["rows"]] == [8, 16]


def test_misspelt_command_gets_a_suggestion():
    line = assert_user_error(*run_cli(["paln"]))
    assert "Did you mean 'plan'?" in line


def test_every_validation_problem_is_listed(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("num_layers: -1\nhidden_size: x\nnum_heads: 4\nffn_hidden_size: 0\n"
                 "vocab_size: 1\ncolour: red\n")
    line = assert_user_error(*run_cli(["compare", "--model", str(p), *SMALL[2:]]))
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "colour"):
        assert f"field '{field}'" in line
    assert "more problem" not in line


def test_specs_show_formats_groups_and_defaults():
    _, out, _ = run_cli(["specs", "show", "dgx-a100-hdr"])
    assert "{" not in out and "None" not in out
    assert "  gpu:\n    name: A100-SXM4-80GB\n    arch: ampere\n    memory_gib: 80\n" in out
    _, out, _ = run_cli(["specs", "show", "llama-7b"])
    assert "num_kv_heads: 32\n" in out and "head_dim: 128\n" in out and "None" not in out


def test_specs_show_gives_the_loader_reason(tmp_path):
    d = tmp_path / "Mixtral-8x7B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    assert_user_error(*run_cli(["specs", "show", str(d)]), "'num_hidden_layers' is missing")
    (d / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "vocab_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 24}))
    code, out, _ = run_cli(["specs", "show", str(d)])
    assert code == 0 and out.startswith("model Mixtral-8x7B\n")  # named after the folder
    assert "head_dim: 24\n" in out


def test_seq_len_above_the_model_warns():
    code, _, err = run_cli(["compare", *SMALL, "--seq-len", "512"])
    assert code == 0 and "--seq-len 512 is longer than tiny's max_seq_len 256" in err
    _, _, err = run_cli(["compare", *SMALL, "--seq-len", "256"])
    assert err == ""


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("no_color", ["", "1"])
def test_no_color_drops_every_style(monkeypatch, no_color):
    from amsp_planner.report.fmt import console
    from amsp_planner.report.grid import Col, Grid, rich_table

    monkeypatch.setenv("NO_COLOR", no_color)
    f = _Tty()
    g = Grid("title", [Col("a", "a")], [[1]])
    console(f).print(rich_table(g))
    assert ("\x1b[" in f.getvalue()) == (not no_color)  # bold header, italic title


# ----- files written ------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_mode_a_plain_write_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        plan = tmp_path / "plan.json"
        assert run_cli(["plan", *SMALL, "-o", str(plan)])[0] == 0
        out = tmp_path / "m.py"
        assert run_cli(["export", str(plan), "--to", "fsdp2", "-o", str(out)])[0] == 0
    finally:
        os.umask(old)
    for p in (plan, out):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask
    plan.chmod(0o640)  # an earlier file keeps its mode
    assert run_cli(["plan", *SMALL, "-o", str(plan)])[0] == 0
    assert stat.S_IMODE(plan.stat().st_mode) == 0o640


def test_export_over_your_own_ds_config_says_what_is_refused(tmp_path):
    plan = tmp_path / "plan.json"
    run_cli(["plan", *SMALL, "-o", str(plan)])
    mine = tmp_path / "ds_config.json"
    text = json.dumps({"train_batch_size": "auto", "optimizer": {"type": "AdamW"},
                       "zero_optimization": {"stage": 3}})
    mine.write_text(text)
    line = assert_user_error(*run_cli(["export", str(plan), "--to", "deepspeed", "-o",
                                       str(mine)]))
    assert "not an earlier `amsp export --to deepspeed` output" in line
    assert "choose another path or remove it first" in line and mine.read_text() == text
    ours = tmp_path / "ds.json"
    for _ in range(2):  # an earlier export is replaced
        assert run_cli(["export", str(plan), "--to", "deepspeed", "-o", str(ours)])[0] == 0
