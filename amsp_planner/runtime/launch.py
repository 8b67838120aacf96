"""Launching: `amsp train` starts torchrun for the plan's world, or runs inside an existing
torchrun / SLURM launch. Also the worker entry point torchrun runs.

    amsp train plan.json --steps 20                      # one node: torchrun on this host
    amsp train plan8.json --local-nodes                  # every node's agent on this host
    amsp train plan64.json --node-rank 3 --master-addr head-node   # one node of a cluster
    torchrun --nproc-per-node=4 -m amsp_planner.runtime.launch plan.json   # inside torchrun

Safety: a world that does not match the plan (size, processes per node, node-major ranks,
model of the checkpoint) is refused with one line before any work (exit 2). Workers write
user errors to ``AMSP_ERROR_FILE``; the launcher prints that one line instead of torchrun's
report. When an agent fails (a rank died), the launcher stops the others at once, so the job
exits non-zero within a few seconds on one host; across hosts the process-group timeout
(``--timeout``) bounds the wait of the surviving ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from amsp_planner.errors import AmspUserError

ERROR_FILE_ENV = "AMSP_ERROR_FILE"


def inside_launch() -> bool:
    """True when this process is one rank of a torchrun (or SLURM srun) launch."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def _slurm_env() -> None:
    """Map SLURM's variables onto torch.distributed's (srun with one task per GPU)."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    e = os.environ
    e["RANK"] = e["SLURM_PROCID"]
    e["WORLD_SIZE"] = e["SLURM_NTASKS"]
    e["LOCAL_RANK"] = e.get("SLURM_LOCALID", "0")
    e["LOCAL_WORLD_SIZE"] = e.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    e["GROUP_RANK"] = e.get("SLURM_NODEID", "0")
    e.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in e:
        raise AmspUserError("SLURM launch: MASTER_ADDR is not set: export the first node's "
                            "host name as MASTER_ADDR before srun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, port: int, nnodes: int = 1, node_rank: int = 0,
                 addr: str = "127.0.0.1") -> list[str]:
    """The torchrun agent command of one node (no restarts, a fast monitor), without the
    script or ``-m module`` and its arguments."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={addr}",
            f"--master-port={port}", "--max-restarts=0", "--monitor-interval=0.5"]


def leave(code: int) -> NoReturn:
    """End a rank's process once everything it owes is written. gloo's threads may abort at
    interpreter teardown ("terminate called without an active exception"), which torchrun
    would report as a failed rank: flush and leave without running destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----- the worker (one rank) --------------------------------------------------------------------
def worker(plan_path: str, opts: dict) -> int:
    """One rank: load the plan, check the world, train. Returns the exit code."""
    import torch
    import torch.distributed as dist

    from amsp_planner.plan import load_plan
    from amsp_planner.runtime.engine import OptimConfig
    from amsp_planner.runtime.train import RunConfig, train

    err_file = os.environ.get(ERROR_FILE_ENV)
    code = 0
    try:
        _slurm_env()
        plan = load_plan(plan_path)
        cuda = torch.cuda.is_available() and not opts.get("cpu")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=timedelta(seconds=opts.get("timeout_s", 300)))
        optim = OptimConfig(**opts.get("optim", {}))
        cfg = RunConfig(steps=opts.get("steps", 10), seed=opts.get("seed", 0),
                        data=opts.get("data"), optim=optim,
                        checkpoint_dir=opts.get("checkpoint_dir"),
                        checkpoint_every=opts.get("checkpoint_every", 0),
                        resume=opts.get("resume", False), log_every=opts.get("log_every", 1),
                        report_path=opts.get("report"), fail_at_step=opts.get("fail_at_step"),
                        fail_rank=opts.get("fail_rank", -1))
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        train(plan.job, plan.strategy, cfg, plan.evaluation, device=device)
        dist.barrier()
    except AmspUserError as e:
        code = 2
        rank = os.environ.get("RANK", "0")
        if err_file and rank == "0":
            Path(err_file).write_text(str(e))
        elif not err_file and rank == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        if rank != "0":
            # Rank 0 reports the one line; the others give it time to do so before torchrun,
            # seeing them exit, stops the whole job (and rank 0 with it).
            time.sleep(5)
    leave(code)


# ----- the launcher ------------------------------------------------------------------------------
def _torchrun(nproc: int, nnodes: int, node_rank: int, addr: str, port: int, plan: str,
              opts: dict) -> list[str]:
    return torchrun_cmd(nproc, port, nnodes, node_rank, addr) + [
        "-m", "amsp_planner.runtime.launch", plan, "--opts", json.dumps(opts)]


def preflight(plan, opts: dict, nproc_per_node: int | None) -> None:
    """Refuse what can be refused before starting any process."""
    from amsp_planner.runtime.model import check_supported

    job = plan.job
    check_supported(job.model)
    r = job.gpus_per_node
    if nproc_per_node is not None and nproc_per_node != r:
        raise AmspUserError(f"--nproc-per-node {nproc_per_node}: the plan expects {r} processes "
                            f"per node ({job.num_gpus} in all): drop the option or re-plan with "
                            f"--gpus {nproc_per_node * job.num_nodes}")
    ck = opts.get("checkpoint_dir")
    if opts.get("resume") and ck:
        from amsp_planner.runtime.checkpoint import latest_step, read_meta

        step = latest_step(ck)
        if step is not None:
            meta = read_meta(Path(ck) / f"step_{step}")
            want = json.loads(json.dumps(job.model.model_dump()))
            if meta.get("model") != want:
                name = meta.get("model", {}).get("name")
                raise AmspUserError(f"--resume: {ck} holds a checkpoint of model '{name}', the "
                                    f"plan trains '{job.model.name}': use a matching plan or "
                                    "another --checkpoint-dir")


def launch(plan_path: str, plan, opts: dict, *, local_nodes: bool = False,
           node_rank: int | None = None, master_addr: str | None = None,
           master_port: int | None = None, nproc_per_node: int | None = None,
           env: dict | None = None) -> int:
    """Start torchrun agent(s) for the plan's world; returns the job's exit code."""
    preflight(plan, opts, nproc_per_node)
    job = plan.job
    n, r = job.num_nodes, job.gpus_per_node
    if n > 1 and not local_nodes and node_rank is None:
        raise AmspUserError(
            f"the plan is for {n} nodes of {r}: run `amsp train` on every node with "
            "--node-rank I --master-addr HOST, or simulate them on this host with --local-nodes"
        )
    addr = master_addr or "127.0.0.1"
    port = master_port or free_port()
    ranks = range(n) if local_nodes or n == 1 else [node_rank]
    fd, err_file = tempfile.mkstemp(prefix="amsp-error-")
    os.close(fd)
    e = dict(env or os.environ)
    e[ERROR_FILE_ENV] = err_file
    e.setdefault("OMP_NUM_THREADS", "1")
    if addr in ("127.0.0.1", "localhost"):
        e.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logs = [tempfile.TemporaryFile(mode="w+") for _ in ranks]
    procs = [subprocess.Popen(_torchrun(r, n, nr, addr, port, plan_path, opts), env=e,
                              stderr=log, start_new_session=True)
             for nr, log in zip(ranks, logs, strict=True)]
    code = wait_all(procs)
    err = Path(err_file).read_text().strip()
    Path(err_file).unlink(missing_ok=True)
    if err:
        raise AmspUserError(err)
    if code:
        for log in logs:
            log.seek(0)
            tail = log.read()[-3000:]
            if tail.strip():
                print(tail, file=sys.stderr)
        print(f"error: the training job failed (exit code {code}); the last good checkpoint, "
              "if any, is intact", file=sys.stderr)
    return code


def wait_all(procs: list[subprocess.Popen], grace_s: float = 5.0) -> int:
    """Wait for every agent; when one fails, stop the others. Returns the first failure."""
    code = 0
    live = list(procs)
    while live:
        for p in list(live):
            rc = p.poll()
            if rc is None:
                continue
            live.remove(p)
            if rc and not code:
                code = rc
                for q in live:
                    stop_agent(q, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while any(q.poll() is None for q in live) and time.monotonic() < deadline:
                    time.sleep(0.1)
                for q in live:
                    stop_agent(q, signal.SIGKILL)
        time.sleep(0.1)
    return code


def stop_agent(p: subprocess.Popen, sig) -> None:
    """Signal an agent's whole session (the agent and the ranks it started)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> None:
    """Worker entry: ``python -m amsp_planner.runtime.launch PLAN [--opts JSON]``."""
    argv = sys.argv[1:] if argv is None else argv
    opts = {}
    if "--opts" in argv:
        i = argv.index("--opts")
        opts = json.loads(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    sys.exit(worker(argv[0], opts))


if __name__ == "__main__":
    main()
