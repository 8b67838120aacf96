"""amsp compare --precision bf16,fp8: the same job side by side in each precision, the engine
named, bad values one line and exit 2."""

import json

import pytest
from amsp_testlib import assert_user_error, run_cli

BASE = ["compare", "--model", "llama3-8b", "--gpus", "64", "--cluster", "dgx-h100-ndr",
        "--engine", "torchtitan"]


def _json(argv):
    code, out, err = run_cli(argv + ["--json"])
    assert code == 0, err
    return json.loads(out)


def test_side_by_side_rows_are_each_precisions_own_job():
    both = _json(BASE + ["--precision", "bf16,fp8", "--fp8-recipe", "tensorwise"])
    bf16 = _json(BASE)
    fp8 = _json(BASE + ["--precision", "fp8", "--fp8-recipe", "tensorwise"])
    assert both["engine"] == "torchtitan"
    assert both["precisions"] == ["bf16", "fp8 (tensorwise)"]
    rows = {(r["name"], r["precision"]): r for r in both["rows"]}
    names = [r["name"] for r in bf16["rows"]]
    # every baseline in both precisions, bf16 then fp8, each row the single-precision run's
    assert [(r["name"], r["precision"]) for r in both["rows"]] == \
        [(n, p) for n in names for p in ("bf16", "fp8")]
    for single, p in ((bf16, "bf16"), (fp8, "fp8")):
        for r in single["rows"]:
            assert rows[(r["name"], p)]["time"] == r["time"]
            assert rows[(r["name"], p)]["strategy"] == r["strategy"]
    # M = 4096 x K, N >= 4096: torchao's tensorwise README example 2 (4096, 8192, 16384) is
    # 1.39x, so the blocks' linears and the step get faster; the memory is the same (torchao
    # keeps the bf16 inputs for backward and casts its weights per use: docs/fp8.md)
    for n in names:
        assert rows[(n, "fp8")]["time"]["step_s"] < rows[(n, "bf16")]["time"]["step_s"]
        assert rows[(n, "fp8")]["memory"] == rows[(n, "bf16")]["memory"]
    line = both["precision_notes"][0]
    fast = {p: min((r for r in both["rows"] if r["precision"] == p and r["fits"]),
                   key=lambda r: r["time"]["step_s"]) for p in ("bf16", "fp8")}
    gain = fast["bf16"]["time"]["step_s"] / fast["fp8"]["time"]["step_s"] - 1
    assert line.startswith("fp8 (tensorwise) vs bf16 on torchtitan: fastest fitting")
    assert f"tokens/s {gain * 100:+.1f}%" in line
    # what the figure covers, for torchao's tensorwise: not Transformer Engine's terms
    note = both["precision_notes"][1]
    assert note.startswith("FP8 here (torchao, tensorwise)") and "all-gathers in FP8" in note
    assert "Transformer Engine" not in note and "TE's" not in note


@pytest.mark.parametrize("engine,recipe,needles,absent", [
    ("megatron", "delayed", ("Transformer Engine, delayed", "tensor-parallel all-gathers in FP8",
                             "TE's FP8 saved inputs"), ("torchao",)),
    ("torchtitan", "rowwise", ("torchao, rowwise", "every collective in bf16"),
     ("Transformer Engine", "all-gathers in FP8")),
])
def test_the_note_says_what_each_family_prices(engine, recipe, needles, absent):
    doc = _json(BASE[:-1] + [engine, "--precision", "bf16,fp8", "--fp8-recipe", recipe])
    note = doc["precision_notes"][1]
    assert all(n in note for n in needles), note
    assert not any(a in note for a in absent), note


def test_side_by_side_table_names_the_engine_and_both_precisions():
    code, out, err = run_cli(BASE + ["--precision", "fp8,bf16", "--format", "markdown"])
    assert code == 0, err
    assert "fp8 (rowwise) vs bf16" in out  # torchtitan's default recipe, in the order given
    assert "engine: torchtitan" in out and "| zero3 fp8 |" in out and "| zero3 bf16 |" in out
    # the notes of both jobs are the same: each printed once
    assert len(err.splitlines()) == len(set(err.splitlines()))


@pytest.mark.parametrize("argv,needles", [
    (["--precision", "bf16,fp9"], ("--precision", "'fp9' is not a precision", "bf16,fp8")),
    (["--precision", "bf16,bf16"], ("--precision", "repeated")),
    (["--precision", "bf16,"], ("--precision", "'' is not a precision")),
    (["--precision", "bf16,fp8", "--engine", "deepspeed"], ("engine deepspeed has no FP8",)),
    (["--precision", "bf16,fp8", "--engine", "torchtitan", "--cluster", "dgx-a100-hdr"],
     ("hopper or blackwell",)),
    (["--precision", "bf16,fp32", "--fp8-recipe", "tensorwise"], ("--fp8-recipe",)),
    (["--precision", "bf16,fp32", "--fp8-all-gather", "on"],
     ("--fp8-all-gather is set but --precision bf16,fp32 has no fp8",)),
    # an FP8 gather in a given strategy with no FP8 job: refused as plan refuses it, not dropped
    (["-s", "p=8,g=8,os=8,fp8ag,mb=1"], ("--strategy fp8ag", "needs --precision fp8")),
    (["--precision", "bf16,fp32", "-s", "p=8,g=8,os=8,fp8ag,mb=1"],
     ("--strategy fp8ag", "needs --precision fp8")),
])
def test_bad_precision_lists_are_one_line_errors(argv, needles):
    base = ["compare", "--model", "llama3-8b", "--gpus", "8"]
    if "--cluster" not in argv:
        base += ["--cluster", "dgx-h100-ndr"]
    assert_user_error(*run_cli(base + argv), *needles)


def test_bundled_runtime_says_its_fp8_is_the_gathers_only():
    # the bundled runtime's matmuls stay bf16 (docs/fp8.md): its named baselines price the same
    # in both precisions, and the note says so instead of describing FP8 linears
    doc = _json(BASE[:-2] + ["--precision", "bf16,fp8"])
    assert doc["engine"] == "amsp"
    rows = {(r["name"], r["precision"]): r for r in doc["rows"]}
    for name, p in rows:
        if p == "fp8":
            assert rows[(name, p)]["time"] == rows[(name, "bf16")]["time"]
    note = doc["precision_notes"][1]
    assert note.startswith("FP8 on amsp (the bundled runtime)")
    assert "matmuls stay bf16" in note and "--engine" in note and "torchtitan" in note
    assert "blocks' linears" not in " ".join(doc["precision_notes"])


def test_plan_on_the_bundled_runtime_says_its_fp8_is_the_gathers_only(tmp_path):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "64", "--cluster", "dgx-h100-ndr",
            "--precision", "fp8", "-o", str(tmp_path / "p.json")]
    code, out, err = run_cli(argv)
    assert code == 0, err
    assert "FP8 on amsp (the bundled runtime)" in out + err
    code, out, err = run_cli(argv[:-2] + ["--engine", "torchtitan", "-o", str(tmp_path / "t.json")])
    assert code == 0, err
    assert "bundled runtime" not in out + err


@pytest.mark.parametrize("engine,recipe", [("torchtitan", "rowwise"), ("megatron", "delayed")])
def test_an_fp8_plan_names_the_recipe_auto_resolved_to(tmp_path, engine, recipe):
    # the engines' defaults (docs/fp8.md): torchtitan's Float8LinearConverter, Megatron's
    # TransformerConfig; written into the file and the header, so the plan reads the same later
    out = tmp_path / "p.json"
    code, text, err = run_cli(["plan", "--model", "llama3-8b", "--gpus", "64", "--cluster",
                               "dgx-h100-ndr", "--engine", engine, "--precision", "fp8",
                               "-o", str(out)])
    assert code == 0, err
    assert json.loads(out.read_text())["inputs"]["training"]["fp8_recipe"] == recipe
    assert f"fp8 ({recipe})" in text.splitlines()[0]


def test_csv_gives_the_precision_a_column_as_json_does():
    import csv
    import io

    argv = BASE + ["--precision", "bf16,fp8", "--fp8-recipe", "tensorwise", "-s",
                   "p=8,g=8,os=8,mb=1"]
    code, out, err = run_cli(argv + ["--format", "csv"])
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    doc = _json(argv)
    # one CSV row per JSON row, the name and precision split the same way, given row included
    assert [(r["name"], r["precision"]) for r in rows] == \
        [(r["name"], r["precision"]) for r in doc["rows"]]
    assert ("given", "fp8") in {(r["name"], r["precision"]) for r in rows}
    assert [float(r["step_s"]) for r in rows] == \
        pytest.approx([r["time"]["step_s"] for r in doc["rows"]])
    # one precision: no precision column (the job's precision is the title's)
    code, out, err = run_cli(BASE + ["--format", "csv"])
    assert code == 0 and "precision" not in out.splitlines()[0].split(","), err


def test_the_same_strategy_range_says_when_no_row_fits_in_both():
    # fp32 70B on 512 GPUs fits nowhere: the range is over rows that do not fit, and says so
    doc = _json(["compare", "--model", "llama3-70b", "--gpus", "512", "--cluster",
                 "dgx-h100-ndr", "--engine", "torchtitan", "--precision", "fp32,bf16"])
    assert not any(r["fits"] for r in doc["rows"] if r["precision"] == "fp32")
    line = doc["precision_notes"][0]
    assert "no fitting row in fp32; the same strategy, none fitting in both: " in line
    # one strategy: one figure, not a range from itself to itself
    doc = _json(BASE + ["--precision", "bf16,fp8", "--fp8-recipe", "rowwise",
                        "--memory-limit", "42"])
    fit = {r["name"] for r in doc["rows"] if r["fits"]}
    assert fit == {"zero3"}
    line = doc["precision_notes"][0]
    gain = line.split("tokens/s ")[1].split(";")[0]  # the fastest fitting: zero3 in both
    assert line.endswith(f"; the same strategy: {gain} (zero3)")


def test_several_given_strategies_are_numbered_so_each_row_is_named_once():
    s1, s2 = "p=8,g=8,os=8,mb=1", "tp=2,p=32,g=32,os=32,mb=1"
    for extra in ([], ["--precision", "bf16,fp8", "--fp8-recipe", "tensorwise"]):
        doc = _json(BASE + extra + ["-s", s1, "-s", s2])
        given = [r for r in doc["rows"] if r["name"].startswith("given")]
        assert [(r["name"], r["strategy"]) for r in given] == \
            [(n, st) for n, st in (("given 1", s1), ("given 2", s2))
             for _ in range(len(doc["precisions"]))]
    # one given strategy keeps its plain name
    doc = _json(BASE + ["-s", s1])
    assert [r["name"] for r in doc["rows"] if r["name"].startswith("given")] == ["given"]


def test_single_precision_json_rows_name_their_precision_too():
    doc = _json(BASE + ["--precision", "fp8", "--fp8-recipe", "tensorwise"])
    assert {r["precision"] for r in doc["rows"]} == {"fp8"}
    assert {r["precision"] for r in _json(BASE)["rows"]} == {"bf16"}
