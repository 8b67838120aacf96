"""What a new user meets first: the fixes error lines suggest work and keep the plan good, the
default sequence length of a model with learned positions, baselines that do not fit say what
would, and an export to another engine says when that engine's own plan is better."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from amsp_testlib import assert_user_error, run_cli


def _plan(argv):
    code, out, err = run_cli(["plan", *argv, "-o", "-", "--json"])
    assert code == 0, (argv, err)
    return json.loads(out)


def _suggested(line: str) -> list[list[str]]:
    """The option/value pairs after 'use' in an error line."""
    fix = line.rsplit("; use ", 1)[1]
    return [[opt, val] for opt, val in re.findall(r"(--global-batch(?:-seqs)?) (\d+)", fix)]


BATCH_CASES = [
    # (job options, option the suggestions must name)
    (["--model", "llama-7b", "--gpus", "1024", "--global-batch", "4000000"], "--global-batch"),
    (["--model", "llama-7b", "--gpus", "1024", "--global-batch", "3997696"], "--global-batch"),
    (["--model", "llama-13b", "--gpus", "24"], "--global-batch"),
    (["--model", "tiny", "--gpus", "8", "--cluster", "cpu-local", "--seq-len", "3000"],
     "--global-batch"),
    (["--model", "tiny", "--gpus", "8", "--cluster", "cpu-local", "--seq-len", "128",
      "--global-batch-seqs", "20", "--micro-batch", "2"], "--global-batch-seqs"),
    (["--model", "llama-7b", "--gpus", "2048", "--engine", "deepspeed"], "--global-batch"),
]


@pytest.mark.parametrize("argv, option", BATCH_CASES, ids=[" ".join(a) for a, _ in BATCH_CASES])
def test_every_suggested_batch_plans_without_forcing_tensor_parallelism(argv, option):
    line = assert_user_error(*run_cli(["plan", *argv, "-o", "-"]), option)
    assert "global_batch" not in line  # options, not internal field names
    fixes = _suggested(line)
    assert fixes, line
    base = [a for i, a in enumerate(argv) if not (
        a.startswith("--global-batch") or (i and argv[i - 1].startswith("--global-batch")))]
    for opt, val in fixes:
        assert opt == option, line
        doc = _plan([*base, opt, val])
        # the batch splits over every data-parallel degree: tensor parallelism stays a choice
        seqs = doc["inputs"]["training"]["global_batch_seqs"] or (
            doc["inputs"]["training"]["global_batch_tokens"] // doc["inputs"]["training"]
            ["seq_len"])
        assert seqs % doc["inputs"]["num_gpus"] == 0


def test_suggested_batches_beat_the_one_that_forced_tp8():
    """llama-13b on 24 GPUs: 1,023 sequences (the old suggestion) only split over the 3 ranks of
    tp=8; the nearest batches the GPUs divide plan faster per sequence."""
    line = assert_user_error(*run_cli(["plan", "--model", "llama-13b", "--gpus", "24",
                                       "-o", "-"]))
    old = _plan(["--model", "llama-13b", "--gpus", "24", "--global-batch-seqs", "1023"])
    assert old["decision"]["tp"] == 8
    seqs = sorted(int(v) // 4096 for _, v in _suggested(line))
    assert seqs == [1008, 1032]  # one below, one above 1,024: multiples of 24
    for s in seqs:
        new = _plan(["--model", "llama-13b", "--gpus", "24", "--global-batch-seqs", str(s)])
        assert new["decision"].get("tp", 1) < 8
        assert new["predictions"]["tokens_per_s"] > 1.15 * old["predictions"]["tokens_per_s"]


# ----- the default sequence length -------------------------------------------------------------
def test_a_model_with_learned_positions_is_planned_at_its_max_seq_len_by_default():
    code, out, err = run_cli(["plan", "--model", "gpt3-175b", "--gpus", "1024", "-o", "-",
                              "--json"])
    assert code == 0, err
    assert json.loads(out)["inputs"]["training"]["seq_len"] == 2048
    assert "--seq-len not given: planning at 2048" in err
    # a longer sequence asked for is refused: the model has no positions beyond 2048
    assert_user_error(*run_cli(["plan", "--model", "gpt3-175b", "--gpus", "1024",
                                "--seq-len", "4096", "-o", "-"]), "--seq-len 2048")
    # a rotary model is planned longer than its max_seq_len, with a warning
    code, _, err = run_cli(["compare", "--model", "llama-7b", "--gpus", "64", "--seq-len",
                            "8192", "--global-batch-seqs", "512"])
    assert code == 0 and "warning: --seq-len 8192 is longer" in err


# ----- compare: when no baseline fits ----------------------------------------------------------
@pytest.mark.parametrize("job", [["--model", "llama2-70b", "--gpus", "512"],
                                 ["--model", "gpt3-175b", "--gpus", "1024"]])
def test_compare_says_what_would_make_a_baseline_fit_and_each_way_does(job):
    code, out, err = run_cli(["compare", *job])
    assert code == 0, err
    assert "yes" not in out.split("hint:")[0]  # every baseline is NO
    hint = next(line for line in out.splitlines() if line.startswith("hint: "))
    ways = re.findall(r"((?:--[a-z-]+ [\w.]+ ?)+) \(([a-z0-9, ]+)(?::|\))", hint)
    options = {w.split()[0] for w, _ in ways}
    assert {"--activation-checkpointing", "--tp", "--memory-limit"} <= options, hint
    for way, names in ways:
        code, js, err = run_cli(["compare", *job, *way.split(), "--json"])
        assert code == 0, (way, err)
        fits = {r["name"] for r in json.loads(js)["rows"] if r["fits"]}
        assert set(names.replace(" ", "").split(",")) <= fits, (way, names, fits)


# ----- export to another engine ----------------------------------------------------------------
TP_PLAN = "tests/golden/llama2-70b_dgx-h100-ndr_512.json"  # amsp: tp=8,p=1,g=1,os=64


@pytest.mark.parametrize("target", ["torchtitan", "fsdp2"])
def test_export_to_another_engine_points_to_that_engines_own_plan(tmp_path, target):
    import shlex

    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.plan import load_plan
    from amsp_planner.strategy import Strategy
    from amsp_planner.validation import step_time_band

    code, out, err = run_cli(["export", TP_PLAN, "--to", target, "-o", str(tmp_path / "x")])
    assert code == 0, err
    note = next(line for line in out.splitlines() if "own best plan" in line)
    cmd = re.search(r"`amsp (plan [^`]+)`", note).group(1)
    assert f"--engine {target}" in cmd
    closest = Strategy.parse(re.search(r"closest expressible strategy: (\S+)", out).group(1))
    plan = load_plan(TP_PLAN)
    tjob = plan.job.for_engine(target)
    exported = evaluate(tjob, closest, plan.memory_limit)
    # the suggested command plans, for the target, a strategy faster beyond the band
    own = _plan(shlex.split(cmd)[1:])
    assert own["inputs"]["engine"] == target
    assert own["predictions"]["time"]["step_s"] * (1 + step_time_band()) < exported.step_s
    # and it exports to the target exactly
    p = tmp_path / "own.json"
    p.write_text(json.dumps(own))
    code, out, err = run_cli(["export", str(p), "--to", target, "-o", str(tmp_path / "y")])
    assert code == 0 and "expresses the plan exactly" in out and "own best" not in out, out


def test_export_within_the_band_of_the_engines_own_plan_says_nothing_more(tmp_path):
    code, out, err = run_cli(["export", TP_PLAN, "--to", "deepspeed", "-o",
                              str(tmp_path / "ds.json")])
    assert code == 0, err
    assert "own best plan" not in out


# ----- docs say what the code does ---------------------------------------------------------------
DOCS = Path(__file__).parent.parent / "docs"


def test_exports_doc_says_the_runtime_runs_tensor_parallel_plans():
    from amsp_planner.plan import load_plan
    from amsp_planner.runtime.preflight import check_tp

    plan = load_plan(TP_PLAN)
    assert plan.strategy.tp == 8
    check_tp(plan.strategy, plan.job)  # the runtime's own gate accepts a tp=8 plan
    text = " ".join((DOCS / "exports.md").read_text().split())
    assert "refuses `t > 1`" not in text
    assert "(`amsp train`) runs `t > 1` plans" in text


def test_whatif_doc_describes_the_markers_the_plot_draws(tmp_path):
    from amsp_planner.report.plots import sweep_figure
    from amsp_planner.whatif import Sweep, run

    rows = run(Sweep(models=("llama-65b",), gpus=(8, 64, 128)), workers=1)
    assert not rows[0].ok and rows[1].ok  # 8 GPUs: nothing fits, a point without a plan
    fig = sweep_figure(rows, "gpus", [])
    markers = {ln.get_marker() for ax in fig.axes for ln in ax.get_lines()}
    hollow = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_marker() == "v"]
    assert hollow and all(ln.get_markerfacecolor() == "none" for ln in hollow)
    assert not markers & {"x", "X", "+"}  # no crosses
    letters = [t.get_text() for ax in fig.axes for t in ax.texts if len(t.get_text()) <= 2]
    assert letters and all(t.isalpha() for t in letters)  # letters, no rings
    doc = " ".join((DOCS / "whatif.md").read_text().split())
    assert "ringed" not in doc and "a cross" not in doc
    assert "hollow triangle at the top edge" in doc and "bold letter" in doc
