"""Bad input and output faults an adversarial audit found reaching a trace, a silent success
or a line naming the wrong option: each now one line naming the right one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from amsp_testlib import assert_user_error, run_cli

TINY = ["--model", "tiny", "--cluster", "cpu-local", "--gpus", "8", "--seq-len", "128",
        "--global-batch-seqs", "32"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [["schema"], ["specs", "list"], ["plan", *TINY, "-o", "-"]])
def test_a_full_disk_under_stdout_is_one_line_not_a_trace(argv):
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", *argv], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert lines[-1] == "error: cannot write the output: No space left on device", p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr


@pytest.mark.parametrize("argv, needles", [
    (["whatif", "--model", "tiny", "--cluster", "cpu-local", "--gpus", "8,16", "--csv", ""],
     ("'--csv'", "is empty")),  # was a table, nothing written, exit 0
    (["whatif", "--model", "tiny", "--cluster", "cpu-local", "--gpus", "8", "--plot", ""],
     ("'--plot'", "is empty")),
    (["validate", ""], ("'PLAN_FILE'", "is empty")),  # was ".: is a folder"
    (["plan", *TINY, "--strategy-from", "", "-o", "-"], ("'--strategy-from'", "is empty")),
    (["specs", "show", ""], ("NAME is empty",)),
    (["calibrate", "--max-size", "999999999G"], ("--max-size 999999999G", "at most 16G")),
    (["compare", "--model", "llama-7b", "--gpus", "64", "--activation-checkpointing", "99999"],
     ("--activation-checkpointing 99999", "the model has 32 blocks")),  # named --strategy
    (["plan", "--model", "llama-7b", "--gpus", "64", "-s", "zero3,mb=4", "--micro-batch", "2",
      "-o", "-"], ("--micro-batch 2", "mb=4")),  # mb=4 was kept silently
    (["plan", "--model", "llama-7b", "--gpus", "64", "--expert-routing", "round_robin", "-o",
      "-"], ("--expert-routing", "no routed experts")),  # was ignored
    (["plan", *TINY, "--set", "name=", "-o", "-"], ("--set name", "the value is empty")),
    (["whatif", *TINY, "--set", "nic_gbit_per_s="], ("--set nic_gbit_per_s", "the value is empty")),
    (["calibrate", "--nproc", "1", "--ops", "all_gather,all_gather"], ("--ops", "twice")),
    (["calibrate", "--nproc", "1", "--name", ""], ("--name is empty",)),
    # int() takes any script's digits and underscores: "p=\u0666\u0664" was p=64
    (["plan", "--model", "llama-7b", "--gpus", "64", "-s", "p=\u0666\u0664", "-o", "-"],
     ("'p=\u0666\u0664' is not an integer",)),
    (["plan", *TINY, "--set", "nic_gbit_per_s=4_00", "-o", "-"], ("--set nic_gbit_per_s",)),
])
def test_bad_input_is_one_line_naming_it(argv, needles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_user_error(*run_cli(argv), *needles)
    assert not any(tmp_path.iterdir())


def test_a_baseline_name_takes_the_micro_batch_option():
    # `-s zero3 --micro-batch 2` planned mb=1 (the baseline's default), silently
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "-s", "zero3",
                              "--micro-batch", "2", "--format", "json", "-o", "-"])
    assert code == 0, err
    assert json.loads(out)["decision"]["micro_batch"] == 2
    # compare's given row too (it evaluated mb=1 beside baselines at mb=2)
    code, out, err = run_cli(["compare", "--model", "llama-7b", "--gpus", "64", "-s", "zero3",
                              "--micro-batch", "2", "--format", "json"])
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    assert rows["given"]["strategy"] == rows["zero3"]["strategy"] == "p=64,g=64,os=64,mb=2"


def test_a_memory_limit_above_the_gpu_is_said():
    code, _, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "--memory-limit",
                            "4000", "-o", "-"])
    assert code == 0 and "warning: --memory-limit 4000 GiB is above the 80 GiB" in err, err


def test_a_non_finite_spec_value_names_its_field(tmp_path):
    spec = tmp_path / "m.yaml"
    spec.write_text("name: x\nnum_layers: .nan\nhidden_size: 64\nnum_heads: 2\n"
                    "ffn_hidden_size: 128\nvocab_size: 100\n")
    assert_user_error(*run_cli(["specs", "show", str(spec)]), "field 'num_layers'", "nan")


def _rewrite(path, edit):
    """Edit a plan and recompute its digest, as a script rewriting it would."""
    from amsp_planner.plan_schema import content_digest

    doc = json.loads(path.read_text())
    edit(doc)
    doc["digest"] = content_digest(doc)
    path.write_text(json.dumps(doc, indent=2))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["inputs"]["search"].__setitem__("bogus_kw", 1), "inputs.search.bogus_kw"),
    (lambda d: d["inputs"]["search"]["preference"].__setitem__("headroom", 0.5),
     "inputs.search.preference.headroom"),
])
def test_a_rewritten_search_record_is_caught(tmp_path, edit, field):
    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "64", "-o", str(plan)])
    assert code == 0, err
    _rewrite(plan, edit)
    assert_user_error(*run_cli(["validate", str(plan)]), f"'{field}")


def test_explain_on_another_engine_follows_the_strategy_it_runs(tmp_path):
    # a plan searched at a pinned tp=2, pp=2, explained on DeepSpeed (no TP + SP, no pipeline):
    # the re-solves used to keep --tp 2 and refuse it there, naming an option explain has not
    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--model", "llama-13b", "--gpus", "64", "--pp", "2",
                            "--tp", "2", "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan), "--engine", "deepspeed", "--no-sensitivity"])
    assert code == 0, err
    assert out.startswith("engine: deepspeed (the plan was made for amsp) runs ")


def test_a_wrong_world_never_suggests_an_impossible_plan():
    from amsp_planner.cost.job import Job
    from amsp_planner.errors import AmspUserError
    from amsp_planner.runtime.preflight import check_world
    from amsp_planner.specs import TrainingSpec, load_cluster, load_model

    job = Job.create(load_model("tiny"), load_cluster("cpu-local"),
                     TrainingSpec(seq_len=64, global_batch_seqs=8), 4)
    with pytest.raises(AmspUserError) as e:
        check_world(job, 10**23, 4)
    assert "re-plan" not in str(e.value) and "launch 4" in str(e.value)
    with pytest.raises(AmspUserError) as e:
        check_world(job, 8, 4)
    assert "re-plan with --gpus 8" in str(e.value)
    with pytest.raises(AmspUserError, match="LOCAL_WORLD_SIZE 8 is above WORLD_SIZE 4"):
        check_world(job, 4, 8)


# ----- from a review of the session's own changes ---------------------------------------------
def test_a_given_cp_plan_with_a_small_batch_explains_with_fp8_sensitivity(tmp_path):
    # the nemolong 256K row's job: 16 sequences over tp=4 x cp=8 on 256 H100s. explain's FP8
    # sensitivity (H100 plans) made its job again without the strategy's cp and refused it
    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "-m", "llama-7b", "-n", "256", "-c", "dgx-h100-ndr",
                            "--engine", "megatron", "--seq-len", "262144",
                            "--global-batch-seqs", "16", "-s", "tp=4,cp=8,p=1,g=1,os=64,mb=1,ckpt",
                            "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan)])
    assert code == 0, err
    assert "FP8" in out or "fp8" in out


def test_a_given_pipeline_plan_with_a_small_batch_exports_to_megatron(tmp_path):
    plan, out = tmp_path / "p.json", tmp_path / "meg"
    code, _, err = run_cli(["plan", "-m", "llama-7b", "-n", "1024", "--global-batch-seqs", "64",
                            "-s", "tp=8,pp=16,p=1,g=1,os=8,mb=1", "-o", str(plan)])
    assert code == 0, err
    code, text, err = run_cli(["export", str(plan), "--to", "megatron", "-o", str(out)])
    assert code == 0, err
    assert "expresses the plan exactly" in text + err


@pytest.mark.parametrize("given", ["p=1,g=1,os=64,mb=1,ga=16", "p=64,g=64,os=64,mb = 2"])
def test_given_strategies_with_ga_or_spaces_read_back(tmp_path, given):
    # ga= in a given strategy wrote predictions.strategy with it and the plan was refused at
    # load; 'mb = 2' beside --micro-batch 2 was refused as 'mb given twice'
    plan = tmp_path / "p.json"
    argv = ["plan", "-m", "llama-7b", "-n", "64", "-s", given, "-o", str(plan)]
    if "mb = 2" in given:
        argv += ["--micro-batch", "2"]
    code, _, err = run_cli(argv)
    assert code == 0, err
    code, out, err = run_cli(["validate", str(plan)])
    assert code == 0 and "valid amsp plan" in out, err


def test_micro_batch_beside_a_ds_config_is_refused_when_it_differs(tmp_path):
    plan, ds = tmp_path / "p.json", tmp_path / "ds.json"
    assert run_cli(["plan", "-m", "llama-7b", "-n", "64", "-o", str(plan)])[0] == 0
    assert run_cli(["export", str(plan), "--to", "deepspeed", "-o", str(ds)])[0] == 0
    for cmd in (["plan", "-o", "-"], ["compare"]):
        argv = [cmd[0], "-m", "llama-7b", "-n", "64", "--engine", "deepspeed",
                "--strategy-from", str(ds), "--micro-batch", "2", *cmd[1:]]
        assert_user_error(*run_cli(argv), "--micro-batch 2", "train_micro_batch_size_per_gpu")


@pytest.mark.parametrize("argv, needle", [
    (["plan", "-m", "llama-7b", "-n", "64", "-s", "p=6_4,g=64,os=64", "-o", "-"],
     "'p=6_4' is not an integer"),
    (["plan", "-m", "llama-7b", "-n", "64", "--memory-limit", "1_00", "-o", "-"],
     "'1_00' is not a number"),
])
def test_underscored_numbers_are_refused(argv, needle):
    assert_user_error(*run_cli(argv), needle)


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="needs a sysfs file")
def test_a_data_file_the_kernel_cannot_map_is_one_line():
    pytest.importorskip("numpy")
    from amsp_planner.errors import AmspUserError
    from amsp_planner.runtime.inputs import check_data

    with pytest.raises(AmspUserError, match="--data .*cannot read it as tokens"):
        check_data("/sys/kernel/mm/transparent_hugepage/enabled", 1000, 8)
