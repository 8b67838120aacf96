"""The bundled runtime's FP8 parameter all-gather (``fp8ag``, runtime/fp8.py) under torchrun
(gloo, 4 ranks on CPU): the measured bytes of every collective equal the plan's schedule
entries (the FP8 gathers at 1 byte per element, the amax all-reduce of 4 bytes per unit per
step), the buffers equal the memory model's, and the loss stays near the bf16 gathers'."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from amsp_planner.specs.loader import load_model  # noqa: E402

from .mp import run_worker  # noqa: E402
from .test_sharded_training import check_accounting, check_memory  # noqa: E402

RUNS = {"fp8_zero3": "p=4,g=4,os=4,fp8ag", "fp8_hpz2": "p=4,g=4,os=4,fp8ag,hpz=2",
        "fp8_amsp_2_4_4": "p=2,g=4,os=4,fp8ag", "bf16_zero3": "p=4,g=4,os=4"}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8four")
    runs = [{"name": n, "strategy": s, "steps": 2, "precision": "fp8"} for n, s in RUNS.items()]
    return run_worker(tmp, runs, nproc=4, timeout=200)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RUNS))
def test_fp8_gather_bytes_and_memory_equal_the_plan(four, name):
    rep = four[name]
    check_accounting(rep)
    check_memory(rep)
    got = {(e["phase"], e["op"], e["group"]): e for e in rep["schedule"]}
    if name.startswith("fp8"):
        # 1 byte per element: half the bf16 gathers' measured bytes (the same units and
        # micro-batches); one 4-byte amax per unit per step (the blocks, embedding and head)
        bf = {(e["phase"], e["op"], e["group"]): e for e in four["bf16_zero3"]["schedule"]}
        fwd = got["forward", "all_gather", "P"]["measured"]["full_bytes_per_step"]
        assert 2 * fwd == bf["forward", "all_gather", "P"]["measured"]["full_bytes_per_step"]
        amax = got["update", "all_reduce", "P"]["measured"]
        assert amax["calls_per_step"] == load_model("tiny").num_layers + 2
        assert amax["full_bytes_per_step"] == 4 * amax["calls_per_step"]
    else:
        assert ("update", "all_reduce", "P") not in got


@pytest.mark.multiprocess
def test_fp8_gathers_train_like_bf16_gathers(four):
    ref = four["bf16_zero3"]["loss"]
    for name in ("fp8_zero3", "fp8_hpz2", "fp8_amsp_2_4_4"):
        got = four[name]["loss"]
        assert len(got) == len(ref) == 2
        for a, b in zip(got, ref, strict=True):
            assert abs(a - b) <= 0.02 * abs(b), (name, got, ref)
