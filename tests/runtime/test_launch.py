"""amsp train end to end: launching, refusing mismatched worlds with one line, and a killed
rank ending the job within a bounded time with the last good checkpoint intact."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from .mp import amsp, env, free_port, make_plan, one_error_line, torchrun_cmd  # noqa: E402


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plans")
    other = tmp / "tiny1.yaml"
    other.write_text("num_layers: 1\nhidden_size: 64\nnum_heads: 4\nnum_kv_heads: 2\n"
                     "ffn_hidden_size: 176\nvocab_size: 256\ntied_embeddings: true\n"
                     "max_seq_len: 256\n")
    # two nodes of two ranks: the smallest world with cross-node groups, for the launches
    local = (Path(__file__).parents[2] / "amsp_planner/presets/cluster_specs/cpu-local.yaml")
    two = tmp / "cpu2.yaml"
    two.write_text(local.read_text().replace("gpus_per_node: 4", "gpus_per_node: 2"))
    return {"dir": tmp, "p4": make_plan(tmp, "p4.json", 4),
            "n2": make_plan(tmp, "n2.json", 4, strategy="p=2,g=2,os=4", cluster=str(two)),
            "n2b": make_plan(tmp, "n2b.json", 4, strategy="hsdp", cluster=str(two)),
            "p8": make_plan(tmp, "p8.json", 8, strategy="p=2,g=4,os=8"),
            "other": make_plan(tmp, "other.json", 2, model=str(other))}  # any world: plan-free


@pytest.mark.multiprocess
def test_train_runs_and_reports(plans):
    tmp = plans["dir"]
    r = amsp("train", plans["p4"], "--steps", 3, "--data", "stdlib", "--report", "r.json", cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step     3/3" in r.stdout and "done: 3 steps" in r.stdout
    rep = json.loads((tmp / "r.json").read_text())
    assert len(rep["loss"]) == 3 and rep["strategy"].startswith("p=4,g=4,os=4")
    for e in rep["schedule"]:
        assert e["planned"]["full_bytes_per_step"] == e["measured"]["full_bytes_per_step"]


@pytest.mark.multiprocess
def test_refuses_wrong_processes_per_node_before_launching(plans):
    r = amsp("train", plans["p4"], "--nproc-per-node", 2, cwd=plans["dir"])
    one_error_line(r, "--nproc-per-node 2: the plan expects 4 processes per node")


@pytest.mark.multiprocess
def test_refuses_multi_node_plan_without_nodes(plans):
    r = amsp("train", plans["p8"], cwd=plans["dir"])
    one_error_line(r, "the plan is for 2 nodes of 4")


def _inside_torchrun(plan, nproc, cwd, wrapped):
    run = [sys.executable, "-m", "amsp_planner.runtime.torchrun"] if wrapped else []
    cmd = (run + torchrun_cmd(nproc, free_port())[3 if wrapped else 0:]
           + ["-m", "amsp_planner.runtime.launch", str(plan)])
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("plan,nproc,wrapped,msg", [
    ("p4", 2, True, "error: plan is for 4 GPUs but the job has 2 processes"),
    ("p8", 8, False, "error: plan expects 4 processes per node but this node runs 8"),
])
def test_refuses_mismatched_world_inside_torchrun(plans, plan, nproc, wrapped, msg):
    """Every rank refuses alike (exit 2), rank 0 prints the line. torchrun itself ends with 1
    whatever its workers' codes (its failure table shows them); amsp_planner.runtime.torchrun
    ends with the job's code."""
    r = _inside_torchrun(plans[plan], nproc, plans["dir"], wrapped)
    if wrapped:
        assert r.returncode == 2, r.stderr[-3000:]
    else:
        assert r.returncode == 1 and re.search(r"exitcode\s*:\s*2\b", r.stderr), r.stderr[-3000:]
    hits = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert hits == [msg + hits[0][len(msg):]] and "Traceback" not in r.stderr.split(msg)[0]


@pytest.mark.multiprocess
def test_refuses_nodes_running_different_plans(plans):
    """Two node agents launched with different plan files: refused by every rank's check of
    the plan fingerprints (the setup all-gather), before any training."""
    port = free_port()
    procs = []
    for node, plan in enumerate(("n2", "n2b")):
        cmd = torchrun_cmd(2, port, 2, node) + ["-m", "amsp_planner.runtime.launch",
                                                 str(plans[plan])]
        procs.append(subprocess.Popen(cmd, cwd=plans["dir"], env=env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    errs = [x for _, e in outs for x in e.splitlines() if x.startswith("error:")]
    assert errs == ["error: rank 2 runs a different plan (model, world or strategy) than rank 0: "
                    "launch every node with the same plan file"]


@pytest.mark.multiprocess
def test_refuses_a_checkpoint_of_another_model(plans):
    tmp = plans["dir"]
    ck = tmp / "ck_other"
    r = amsp("train", plans["other"], "--steps", 2, "--checkpoint-dir", ck,
             "--checkpoint-every", 2, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    r = amsp("train", plans["p4"], "--steps", 4, "--checkpoint-dir", ck, "--resume", cwd=tmp)
    one_error_line(r, f"--resume: {ck} holds a checkpoint of model 'tiny1'")


@pytest.mark.multiprocess
@pytest.mark.parametrize("plan,extra,rank", [("p4", [], 2), ("n2", ["--local-nodes"], 3)])
def test_killed_rank_ends_the_job_and_keeps_the_checkpoint(plans, plan, extra, rank):
    tmp = plans["dir"]
    ck = tmp / f"ck_kill_{plan}"
    t0 = time.monotonic()
    r = amsp("train", plans[plan], *extra, "--steps", 4, "--checkpoint-dir", ck,
             "--checkpoint-every", 2, "--fail-at-step", 3, "--fail-rank", rank,
             "--timeout", 30, cwd=tmp)
    took = time.monotonic() - t0
    line = one_error_line(r, f"rank {rank}, step 3: the process exited with code 9", code=4)
    assert re.fullmatch(rf"error: rank {rank}, step 3: the process exited with code 9 without an "
                        rf"error; last complete checkpoint: {ck}/step_2 \(full log: \S+\)", line)
    assert took < 90
    assert (ck / "latest").read_text().strip() == "step_2"
    r = amsp("train", plans[plan], *extra, "--steps", 4, "--checkpoint-dir", ck, "--resume",
             "--report", "resumed.json", cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp / "resumed.json").read_text())
    assert rep["start_step"] == 2 and len(rep["loss"]) == 2
