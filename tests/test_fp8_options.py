"""--precision fp8, --fp8-recipe, --fp8-all-gather: the spec fields, the CLI's one-line errors, and
the FP8 matmuls in the step's compute (cost/compute.py via cost/fp8.py)."""

import pytest
from amsp_testlib import assert_user_error, run_cli
from pydantic import ValidationError

from amsp_planner.cost.compute import block_compute, head_compute
from amsp_planner.cost.job import Job
from amsp_planner.specs import TrainingSpec, load_cluster, load_model


def test_fp8_fields_stay_out_of_bf16_dumps():
    assert "fp8_recipe" not in TrainingSpec().model_dump()
    assert "fp8_all_gather" not in TrainingSpec(precision="fp8").model_dump()
    d = TrainingSpec(precision="fp8", fp8_recipe="tensorwise", fp8_all_gather="on").model_dump()
    assert d["fp8_recipe"] == "tensorwise" and d["fp8_all_gather"] == "on"
    assert TrainingSpec(**d) == TrainingSpec(precision="fp8", fp8_recipe="tensorwise",
                                             fp8_all_gather="on")
    for bad in ({"fp8_recipe": "rowwise"}, {"fp8_all_gather": "off"}):
        with pytest.raises(ValidationError, match="precision"):
            TrainingSpec(**bad)


@pytest.mark.parametrize("argv,needles", [
    (["--precision", "fp8", "--engine", "deepspeed"], ("engine deepspeed has no FP8 path",
                                                        "use --engine amsp, fsdp2, torchtitan, "
                                                        "megatron, or --precision bf16")),
    # on an Ampere GPU no recipe runs FP8 matmuls: the fix is bf16, not another recipe
    (["--precision", "fp8", "--engine", "torchtitan", "--cluster", "dgx-a100-hdr",
      "--fp8-recipe", "tensorwise"], ("use --precision bf16, or a cluster of such GPUs",)),
    # the bundled runtime gathers tensorwise only: blockwise names that, not recipes it refuses
    (["--precision", "fp8", "--fp8-recipe", "blockwise"], ("use --fp8-recipe tensorwise",)),
    # the bundled runtime's FP8 is its all-gather: tensorwise only
    (["--precision", "fp8", "--fp8-recipe", "rowwise"], ("tensorwise",)),
    (["--precision", "fp8", "--engine", "torchtitan", "--cluster", "dgx-a100-hdr"],
     ("needs a hopper or blackwell GPU",)),
    (["--precision", "fp8", "--engine", "torchtitan", "--fp8-recipe", "rowwise",
      "--fp8-all-gather", "on"], ("tensorwise",)),
    (["--precision", "fp8", "--engine", "megatron", "--fp8-recipe", "rowwise"],
     ("megatron does not run it",)),
    (["--fp8-recipe", "tensorwise"], ("--fp8-recipe", "--precision fp8")),
    (["--precision", "fp9"], ("--precision",)),
    (["--precision", "fp8", "--fp8-all-gather", "maybe"], ("--fp8-all-gather",)),
])
def test_bad_fp8_options_are_one_line_errors(argv, needles):
    base = ["compare", "--model", "llama3-8b", "--gpus", "8"]
    if "--cluster" not in argv:
        base += ["--cluster", "dgx-h100-ndr"]
    assert_user_error(*run_cli(base + argv), *needles)


def _job(precision, recipe=None, engine="torchtitan", mb_tokens=8192):
    t = TrainingSpec(seq_len=mb_tokens, global_batch_seqs=8, precision=precision,
                     fp8_recipe=recipe)
    return Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"), t, 8, engine)


def test_fp8_changes_the_blocks_matmuls_only():
    bf16 = block_compute(_job("bf16"), 1, False)
    tw = block_compute(_job("fp8", "tensorwise"), 1, False)
    # M = 8192: the torchao tensorwise examples and the roofline put Llama-3-8B's large
    # linears above 1x; the block gets faster, backward by twice forward's saving
    assert tw.forward < bf16.forward
    assert bf16.backward - tw.backward == pytest.approx(2 * (bf16.forward - tw.forward))
    # rowwise at M = 4096: every cell of torchao's H100 table for these (K, N) is at most
    # 1.04x, wk/wv (4096, 1024) 0.44x: the block is slower in FP8
    row = block_compute(_job("fp8", "rowwise", mb_tokens=4096), 1, False)
    assert row.forward > block_compute(_job("bf16", mb_tokens=4096), 1, False).forward
    # the LM head stays bf16
    assert head_compute(_job("fp8", "tensorwise"), 1) == head_compute(_job("bf16"), 1)


def test_megatron_first_and_last_layers_default_to_fp8():
    """Megatron's first_last_layers_bf16 is off by default: every block runs FP8 (delayed)."""
    fp8 = block_compute(_job("fp8", engine="megatron"), 1, False)
    assert fp8.forward < block_compute(_job("bf16", engine="megatron"), 1, False).forward


def test_fp8_plans_export_where_the_engine_runs_fp8(tmp_path):
    plan = tmp_path / "plan.json"
    code, out, err = run_cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--cluster",
                              "dgx-h100-ndr", "--engine", "torchtitan", "--precision", "fp8",
                              "--fp8-recipe", "tensorwise", "-o", str(plan)])
    assert code == 0, err
    # torchtitan 0.3 has no tensorwise recipe; DeepSpeed no FP8 path (tests/test_fp8_exports.py)
    for target, needle in (("torchtitan", "no tensorwise"), ("deepspeed", "FP8 plan")):
        assert_user_error(*run_cli(["export", str(plan), "--to", target]), needle)
    out_file = tmp_path / "megatron.sh"
    code, out, err = run_cli(["export", str(plan), "--to", "megatron", "-o", str(out_file)])
    assert code == 0, err
    assert "--fp8-recipe tensorwise" in out_file.read_text()
