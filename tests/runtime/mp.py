"""Launching torchrun from the tests: one node, or several node agents on loopback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from amsp_planner.runtime.launch import free_port, torchrun_cmd

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = HERE / "_mp_worker.py"


def env() -> dict:
    e = dict(os.environ)
    e.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
             PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR",
             PYTHONPATH=os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return e


def launch(args: list[str], nproc: int, nnodes: int = 1, timeout: float = 240,
           script: Path | str = WORKER) -> list[subprocess.CompletedProcess]:
    """Run `script args` on nnodes x nproc processes; returns one result per node agent."""
    port = free_port()
    procs = [subprocess.Popen(torchrun_cmd(nproc, port, nnodes, n) + [str(script), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env()) for n in range(nnodes)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def failure_text(stderr: str, limit: int = 6000) -> str:
    """The lines of the rank torchrun names as the root cause (its own trace, not the peers'
    'Connection closed by peer'), then the tail of the log."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", stderr, re.S)
    own = ""
    if m:
        tag = f"[rank{m.group(1)}]:"
        own = "\n".join(x for x in stderr.splitlines() if x.startswith(tag))
    return (own[-limit // 2:] + "\n...\n" + stderr[-limit // 2:]) if own else stderr[-limit:]


def emulated(nproc: int, nnodes: int, args: list[str], timeout: float, rate_mbit: float = 1000
             ) -> list[subprocess.CompletedProcess]:
    """Run the worker on an emulated cluster of `nnodes` (amsp_planner/emulate.py: a network
    namespace per node, gloo on the rate-limited uplinks whose byte counters the worker reads)."""
    from amsp_planner import emulate

    e = {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR",
         "OMP_NUM_THREADS": "1"}
    with emulate.emulated_cluster(nodes=nnodes, rate_mbit=rate_mbit) as emu:
        res = emu.run_torchrun(nproc, [str(WORKER), *args], env=e, timeout=timeout)
    return [subprocess.CompletedProcess(None, rc, so, se) for rc, so, se in res]


def run_worker(tmp: Path, runs: list[dict], nproc: int, nnodes: int = 1,
               timeout: float = 240, emulate: bool = False) -> dict[str, dict]:
    """Run the worker on `runs` (on an emulated cluster with `emulate`); returns name -> run
    report (params under '_pt')."""
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"out": str(tmp), "runs": runs}))
    if emulate:
        results = emulated(nproc, nnodes, [str(cfg)], timeout)
    else:
        results = launch([str(cfg)], nproc, nnodes, timeout)
    for r in results:
        assert r.returncode == 0, failure_text(r.stderr)
    import torch

    out = {}
    for run in runs:
        rep = json.loads((tmp / f"{run['name']}.json").read_text())
        rep["_pt"] = torch.load(tmp / f"{run['name']}.pt")
        out[run["name"]] = rep
    return out


AMSP = [sys.executable, "-m", "amsp_planner.cli.main"]


def amsp(*args, cwd, timeout=180, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the amsp CLI (bounded in time)."""
    return subprocess.run([*AMSP, *map(str, args)], cwd=cwd, env={**env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=timeout)


def make_plan(tmp, name, gpus, model="tiny", strategy="zero3", cluster="cpu-local", seq=32):
    r = amsp("plan", "--model", model, "--gpus", gpus, "--cluster", cluster, "--strategy",
             strategy, "--seq-len", seq, "--global-batch-seqs", 2 * gpus, "-o", name, cwd=tmp)
    assert r.returncode == 0, r.stderr
    return tmp / name


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.strip()]


def one_error_line(r: subprocess.CompletedProcess, starts: str, code: int = 2) -> str:
    lines = error_lines(r)
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(f"error: {starts}"), r.stderr[-3000:]
    return lines[0]
