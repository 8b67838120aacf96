"""One node of a cluster launch (`amsp train --node-rank I --master-addr HOST`): every node
meets on the same rendezvous port without being told one, options that cannot meet are
refused in one line, and a launch whose chosen port another process took is retried."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

pytest.importorskip("torch")

from .mp import AMSP, amsp, env, make_plan, one_error_line  # noqa: E402


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("cluster")
    local = Path(__file__).parents[2] / "amsp_planner/presets/cluster_specs/cpu-local.yaml"
    two = tmp / "cpu2.yaml"
    two.write_text(local.read_text().replace("gpus_per_node: 4", "gpus_per_node: 2"))
    return {"dir": tmp, "n2": make_plan(tmp, "n2.json", 4, strategy="p=2,g=2,os=4", cluster=str(two)),
            "p4": make_plan(tmp, "p4.json", 4)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("plan,args,starts", [
    ("n2", ["--node-rank", 1], "--node-rank 1: needs --master-addr HOST"),
    ("n2", ["--node-rank", 2, "--master-addr", "127.0.0.1"],
     "--node-rank 2: the plan has 2 nodes (ranks 0 to 1)"),
    ("n2", ["--node-rank", 0, "--local-nodes"], "--node-rank 0 and --local-nodes"),
    ("p4", ["--node-rank", 0, "--master-addr", "127.0.0.1"],
     "--node-rank 0: the plan is for one node"),
])
def test_refuses_cluster_options_that_cannot_meet(plans, plan, args, starts):
    r = amsp("train", plans[plan], "--steps", 1, *args, cwd=plans["dir"], timeout=60)
    one_error_line(r, starts)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


@pytest.mark.multiprocess
def test_nodes_meet_on_the_default_port(plans):
    """Both nodes started as a cluster's would be, with no --master-port: before, each chose a
    port of its own and the rendezvous never met."""
    from amsp_planner.runtime.launch import DEFAULT_MASTER_PORT

    if not _port_free(DEFAULT_MASTER_PORT):
        pytest.skip(f"port {DEFAULT_MASTER_PORT} is in use on this host")
    tmp = plans["dir"]
    procs = [subprocess.Popen([*AMSP, "train", str(plans["n2"]), "--steps", "2", "--node-rank",
                               str(i), "--master-addr", "127.0.0.1", "--timeout", "30",
                               "--report", f"node{i}.json"],
                              cwd=tmp, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=150))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    rep = json.loads((tmp / "node0.json").read_text())  # rank 0 runs on node 0
    assert len(rep["loss"]) == 2
    for e in rep["schedule"]:
        assert e["planned"]["full_bytes_per_step"] == e["measured"]["full_bytes_per_step"]


@pytest.mark.multiprocess
def test_retries_a_port_taken_before_torchrun_binds_it(plans, monkeypatch):
    """The launcher's first port is held by another listener when torchrun binds it (the race
    of a busy host): the launch is retried on a new port and the job runs."""
    from amsp_planner.cli import main as cli_main
    from amsp_planner.runtime import launch as L

    real = L.free_port
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = [held.getsockname()[1]]

    def chosen() -> int:
        port = ports.pop(0) if ports else real()
        calls.append(port)
        return port

    calls: list[int] = []
    monkeypatch.setattr(L, "free_port", chosen)
    for k, v in env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(plans["dir"])
    try:
        with pytest.raises(SystemExit) as ex:
            cli_main.main(["train", str(plans["p4"]), "--steps", "1", "--timeout", "30"])
    finally:
        held.close()
    assert ex.value.code == 0
    assert len(calls) == 2 and calls[0] != calls[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("variables,starts", [
    ({"SLURM_NTASKS": "abc", "SLURM_PROCID": "0"}, "launch environment: SLURM_NTASKS='abc' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "launch environment: WORLD_SIZE='two' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "abc"}, "launch environment: LOCAL_WORLD_SIZE='abc'"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "launch environment: RANK=5 is not below WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_PORT": "29511"}, "launch environment: RANK=-1 is below 0"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": None}, "launch environment: RANK and WORLD_SIZE are set but MASTER_ADDR is not"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "3"}, "launch environment: SLURM_PROCID=3 is not below SLURM_NTASKS=2"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "x"}, "launch environment: SLURM_NTASKS_PER_NODE='x'"),
])
def test_refuses_a_launch_environment_that_cannot_start_a_rank(plans, variables, starts):
    """Under an external launch (torchrun's or SLURM's variables set), a variable that is not a
    whole number or a rank outside the world is one line naming the variable, exit 2: before,
    a ValueError trace (exit 1) or a rank failure (exit 4)."""
    e = env()
    for k, v in variables.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    e.setdefault("MASTER_PORT", "29511")
    r = subprocess.run([*AMSP, "train", str(plans["p4"]), "--steps", "1"], cwd=plans["dir"],
                       env=e, capture_output=True, text=True, timeout=60)
    one_error_line(r, starts)
