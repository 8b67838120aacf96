"""Tensor (+ sequence) parallelism in the bundled runtime (issue #14): t = 2 with ZeRO-1, ZeRO-3
and AMSP points, on 4 ranks (one node) and on 8 ranks as 2 nodes of 4: every schedule entry's
calls and bytes equal the plan's (the TP entries included), fp32 parity with the single-process
reference, the model states equal the memory model, and a checkpoint saved at t = 1 loads into
t = 2 (and back) with identical states.

One launch per world size carries every check (tests/runtime/test_sharded_training.py says
why); two steps per run.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from amsp_planner.cost.job import Job  # noqa: E402
from amsp_planner.specs.loader import load_cluster, load_model  # noqa: E402
from amsp_planner.specs.training import TrainingSpec  # noqa: E402

from .mp import run_worker  # noqa: E402
from .test_sharded_training import check_accounting, check_memory  # noqa: E402

STEPS = 2
"""Steps per run; the global batch is one sequence per rank (two per data-parallel rank at
t = 2: two micro-batches of one)."""
STATES = ("master", "exp_avg", "exp_avg_sq")
RUNS_4 = {"zero1_tp2": "zero1,tp=2", "zero3_tp2": "zero3,tp=2",
          "amsp_tp2_1_2_2": "tp=2,p=1,g=2,os=2",
          # block 1 checkpointed: its forward, TP collectives included, runs again in backward
          "zero3_tp2_ckpt1": "tp=2,p=2,g=2,os=2,ckpt=1"}
RUNS_8 = {"zero1_tp2": "zero1,tp=2", "zero3_tp2": "zero3,tp=2",
          "amsp_tp2_2_4_4": "tp=2,p=2,g=4,os=4", "amsp_tp2_1_2_4": "tp=2,p=1,g=2,os=4"}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp4")
    d1, d2 = str(tmp / "ck_t1"), str(tmp / "ck_t2")
    runs = [{"name": n, "strategy": s, "steps": STEPS} for n, s in RUNS_4.items()]
    runs += [
        # step 1 at t = 1, saved; loaded at t = 2 (a load alone, then the second step)
        {"name": "t1_save", "strategy": "zero3", "steps": 1, "checkpoint_dir": d1,
         "checkpoint_every": 1},
        {"name": "t2_load", "strategy": "zero3,tp=2", "steps": 1, "checkpoint_dir": d1,
         "resume": True},
        {"name": "t2_resume", "strategy": "tp=2,p=1,g=2,os=2", "steps": 2, "checkpoint_dir": d1,
         "resume": True},
        # and back: step 1 at t = 2, saved; loaded at t = 1
        {"name": "t2_save", "strategy": "zero3,tp=2", "steps": 1, "checkpoint_dir": d2,
         "checkpoint_every": 1},
        {"name": "t1_load", "strategy": "p=1,g=2,os=4", "steps": 1, "checkpoint_dir": d2,
         "resume": True},
    ]
    return run_worker(tmp, [{**r, "batch_seqs": 4} for r in runs], nproc=4, timeout=240)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp8")
    runs = [{"name": n, "strategy": s, "steps": STEPS, "batch_seqs": 8} for n, s in RUNS_8.items()]
    return run_worker(tmp, runs, nproc=4, nnodes=2, timeout=300)


def _job(world: int) -> Job:
    t = TrainingSpec(seq_len=32, global_batch_seqs=world, precision="fp32")
    return Job.create(load_model("tiny"), load_cluster("cpu-local"), t, world)


_REF: dict = {}


def reference(world: int):
    from amsp_planner.runtime.reference import reference_run

    if world not in _REF:
        _REF[world] = reference_run(_job(world), STEPS)
    return _REF[world]


def check_parity(rep: dict, world: int) -> None:
    ref_loss, ref_params = reference(world)
    assert len(rep["loss"]) == len(ref_loss) - rep["start_step"]
    for a, b in zip(rep["loss"], ref_loss[rep["start_step"]:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (rep["strategy"], rep["loss"], ref_loss)
    for got, want in zip(rep["_pt"]["master"], ref_params, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def tp_entries(rep: dict) -> dict:
    return {(e["phase"], e["op"]): e["measured"] for e in rep["schedule"] if e["group"] == "TP"}


def check_tp_by_hand(rep: dict, world: int, ckpt_blocks: int = 0) -> None:
    """The TP entries measured against values derived by hand (tiny: L = 2, h = 64, s = 32,
    2 sequences per DP rank = 2 micro-batches of 1, fp32): per micro-batch 2 all-gathers and
    2 reduce-scatters per block plus the head's and the embedding's, of b*s*h*4 bytes, in
    forward and backward; the norms' gradients (2h per block, h for the head) all-reduced; the
    cross-entropy's 3 all-reduces of b*s*4 bytes."""
    L, h, s, n_micro = 2, 64, 32, 2
    assert rep["n_micro"] == n_micro
    act = s * h * 4
    got = tp_entries(rep)
    for key in (("forward", "all_gather"), ("forward", "reduce_scatter"),
                ("backward", "all_gather"), ("backward", "reduce_scatter")):
        assert got[key]["calls_per_step"] == n_micro * (2 * L + 1), key
        assert got[key]["full_bytes_per_step"] == n_micro * (2 * L + 1) * act, key
        assert got[key]["group_size"] == 2 and got[key]["stride"] == 1
        assert got[key]["inter_bytes_per_rank_per_step"] == 0
    assert got["backward", "all_reduce"]["calls_per_step"] == n_micro * (L + 1)
    assert got["backward", "all_reduce"]["full_bytes_per_step"] == n_micro * (2 * L + 1) * h * 4
    assert got["forward", "all_reduce"]["calls_per_step"] == n_micro * 3
    assert got["forward", "all_reduce"]["full_bytes_per_step"] == n_micro * 3 * s * 4
    if ckpt_blocks:
        for op in ("all_gather", "reduce_scatter"):
            assert got["recompute", op]["calls_per_step"] == n_micro * 2 * ckpt_blocks
            assert got["recompute", op]["full_bytes_per_step"] == n_micro * 2 * ckpt_blocks * act
    else:
        assert not any(k[0] == "recompute" for k in got)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RUNS_4))
def test_tp2_exact_bytes_memory_and_parity_4(four, name):
    rep = four[name]
    check_accounting(rep)
    assert rep["verdict"]["ok"], rep["verdict"]["line"]
    check_tp_by_hand(rep, 4, ckpt_blocks=1 if "ckpt1" in name else 0)
    check_memory(rep)
    check_parity(rep, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RUNS_8))
def test_tp2_exact_bytes_memory_and_parity_8_two_nodes(eight, name):
    rep = eight[name]
    check_accounting(rep)
    assert rep["verdict"]["ok"], rep["verdict"]["line"]
    check_tp_by_hand(rep, 8)
    check_memory(rep)
    check_parity(rep, 8)


@pytest.mark.multiprocess
def test_tp_and_dp_groups_on_two_nodes(eight):
    """TP groups are consecutive ranks inside a node; ZeRO-3's P group is the 4 DP ranks of one
    TP index at stride 2, 2 per node, so its gathers cross the nodes."""
    rows = {(e["phase"], e["op"], e["group"]): e["measured"] for e in eight["zero3_tp2"]["schedule"]}
    p = rows[("forward", "all_gather", "P")]
    assert (p["group_size"], p["stride"], p["members_per_node"]) == (4, 2, 2)
    assert p["inter_bytes_per_rank_per_step"] > 0
    tp = rows[("forward", "all_gather", "TP")]
    assert (tp["group_size"], tp["stride"], tp["members_per_node"]) == (2, 1, 2)


@pytest.mark.multiprocess
def test_a_t1_checkpoint_loads_into_t2_and_back(four):
    # the load alone: identical logical states, under another TP degree and other factors
    for name, saved in (("t2_load", "t1_save"), ("t1_load", "t2_save")):
        assert four[name]["start_step"] == 1 and four[name]["loss"] == []
        for k in STATES:
            for a, b in zip(four[name]["_pt"][k], four[saved]["_pt"][k], strict=True):
                assert torch.equal(a, b), (name, k)
    # resumed at t = 2 from the t = 1 step: the reference's second step
    assert four["t2_resume"]["start_step"] == 1
    check_parity(four["t2_resume"], 4)
    check_accounting(four["t2_resume"])
