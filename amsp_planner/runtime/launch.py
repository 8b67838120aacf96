"""Launching: `amsp train` starts torchrun for the plan's world, or runs inside an existing
torchrun / SLURM launch. Also the worker entry point torchrun runs.

    amsp train plan.json --steps 20                      # one node: torchrun on this host
    amsp train plan8.json --local-nodes                  # every node's agent on this host
    amsp train plan64.json --node-rank 3 --master-addr head-node   # one node of a cluster
    python -m amsp_planner.runtime.torchrun --nproc-per-node=4 \
        -m amsp_planner.runtime.launch plan.json --steps 20         # inside an external torchrun
    srun python -m amsp_planner.runtime.launch plan.json --steps 20  # one rank per SLURM task

Safety: what can be checked before launching is (``preflight.py``: the host, the outputs,
the checkpoint); a world that does not match the plan (size, processes per node, node-major
ranks) is refused by the ranks before any work. Either way: one line, exit 2. The launcher owns
a run folder (``faults.RUN_DIR_ENV``): the agents' log goes to its ``log.txt``, every rank
writes its first exception there, and the launcher prints one line naming the failed rank and
the cause (exit 4), with the log's path; rank 0 leaves the verdict there (exit 5 when the
collectives differ from the plan). When an agent fails (a rank died), the launcher stops the
others at once, so the job exits within a few seconds on one host; across hosts the
process-group timeout (``--timeout``) bounds the wait of the surviving ranks.

Under an external launch every rank makes the same input checks (the plan, the world against
the plan, the outputs, the checkpoint) before any process-group work, so a refusal ends every
rank with exit 2 (rank 0 prints the line); a rank that fails exits 4 and prints its own line.
Those are the process exit codes srun reports; torchrun itself ends with 1 whatever its
workers' codes, which ``runtime/torchrun.py`` turns back into the job's code.
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
from amsp_planner.runtime import faults, lifecycle


def inside_launch() -> bool:
    """True when this process is one rank of a torchrun (or SLURM srun) launch."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def env_rank() -> int:
    """This rank's index from the launch's environment (torchrun's RANK, or SLURM's)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


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
    """The torchrun agent command of one node (no restarts, a fast monitor, ranks given
    ``lifecycle.STOP_GRACE_S`` to end after a signal), without the script or ``-m module``
    and its arguments. The agent is torchrun run by ``runtime/agent.py``, so it dies with
    the process that started it, and its ranks with it."""
    return [sys.executable, "-m", "amsp_planner.runtime.agent", f"--nproc-per-node={nproc}",
            f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={addr}",
            f"--master-port={port}", "--max-restarts=0", "--monitor-interval=0.5",
            f"--shutdown-timeout={int(lifecycle.STOP_GRACE_S)}"]


def leave(code: int) -> NoReturn:
    """End a rank's process once everything it owes is written. gloo's threads may abort at
    interpreter teardown ("terminate called without an active exception"), which torchrun
    would report as a failed rank: flush and leave without running destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----- the worker (one rank) --------------------------------------------------------------------
def run_config(opts: dict):
    from amsp_planner.runtime.engine import OptimConfig
    from amsp_planner.runtime.train import RunConfig

    keys = ("steps", "seed", "data", "checkpoint_dir", "checkpoint_every", "resume",
            "resume_from", "verified", "on_nonfinite", "log_every", "fail_at_step",
            "fail_rank", "fail_mode", "save_on_sigterm")
    kw = {k: opts[k] for k in keys if opts.get(k) is not None}
    return RunConfig(optim=OptimConfig(**opts.get("optim", {})), report_path=opts.get("report"),
                     **kw)


def check_inputs(plan_path: str, opts: dict):
    """Every input check a rank can make alone, identically on every rank and before any
    process-group work: the launch's environment, the plan, the world against the plan, the
    options, the outputs, the checkpoint's step. Returns the plan."""
    from amsp_planner.plan import load_plan
    from amsp_planner.runtime.preflight import (
        check_options,
        check_outputs,
        check_steps,
        check_supported,
        check_tp,
        check_world,
    )

    _slurm_env()
    check_options(opts)
    check_run_options(opts)
    plan = load_plan(plan_path)
    check_supported(plan.job.model)
    check_tp(plan.strategy, plan.job)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world(plan.job, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    check_outputs(opts, [plan_path, opts.get("data")])
    from amsp_planner.runtime.inputs import check_data

    check_data(opts.get("data"), plan.job.model.vocab_size, plan.job.training.seq_len)
    if opts.get("resume") and opts.get("checkpoint_dir"):
        from amsp_planner.runtime.ckpt_files import resume_step

        step = resume_step(opts["checkpoint_dir"], opts.get("resume_from"))
        if step is not None:
            check_steps(step, opts.get("steps", 10), opts["checkpoint_dir"])
    return plan


def check_run_options(opts: dict) -> None:
    """The run's numbers and the options that go together (``inputs.py``; no torch)."""
    from amsp_planner.runtime.inputs import check_lr, check_seed

    check_seed(opts.get("seed", 0))
    check_lr(opts.get("optim", {}).get("lr", 1e-3))
    if opts.get("save_on_sigterm") and not (opts.get("checkpoint_dir")
                                            and opts.get("checkpoint_every")):
        raise AmspUserError("--save-on-sigterm: needs --checkpoint-dir DIR and "
                            "--checkpoint-every K, the folder and cadence it saves with: add "
                            "them or drop --save-on-sigterm")


_HELD: list[int] = []
"""The checkpoint folder's lock, held by rank 0 under an external launch."""


def _lock_under_external_launch(opts: dict) -> None:
    """Rank 0 takes the checkpoint folder's lock (``ckpt_lock.py``) and every rank refuses
    alike when another job holds it. Under ``amsp train`` the launcher holds it."""
    import torch.distributed as dist

    ck = opts.get("checkpoint_dir")
    if not ck or os.environ.get(faults.RUN_DIR_ENV):
        return
    from amsp_planner.runtime.ckpt_lock import lock_folder

    msg = [None]
    if dist.get_rank() == 0:
        try:
            fd = lock_folder(ck, create=bool(opts.get("checkpoint_every")))
            if fd is not None:
                _HELD.append(fd)
        except AmspUserError as e:
            msg[0] = str(e)
    dist.broadcast_object_list(msg, src=0)
    if msg[0]:
        raise AmspUserError(msg[0])


def _train(plan_path: str, opts: dict) -> int:
    """One rank's work; returns 0, or EXIT_DIFFERS when the verdict fails and no launcher
    collects it."""
    plan = check_inputs(plan_path, opts)
    import torch
    import torch.distributed as dist

    from amsp_planner.runtime.train import train

    cuda = torch.cuda.is_available() and not opts.get("cpu")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=timedelta(seconds=opts.get("timeout_s", 300)))
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    _lock_under_external_launch(opts)
    rep = train(plan.job, plan.strategy, run_config(opts), plan.evaluation, device=device)
    dist.barrier()
    ok = rep["verdict"]["ok"]
    run = os.environ.get(faults.RUN_DIR_ENV)
    if run and dist.get_rank() == 0:
        Path(run, "verdict.json").write_text(json.dumps(rep["verdict"]))
        return 0
    return 0 if ok or run else faults.EXIT_DIFFERS


def worker(plan_path: str, opts: dict) -> NoReturn:
    """One rank: check the inputs, the world, train; leaves with the exit code. Its first
    exception goes to the run folder (under ``amsp train``) or to stderr as one line."""
    launched = bool(os.environ.get(faults.RUN_DIR_ENV))
    rank = env_rank()
    lifecycle.follow_parent(signal.SIGKILL, lifecycle.AGENT_PID_ENV)
    if opts.get("save_on_sigterm"):
        lifecycle.catch_sigterm()
    try:
        code = _train(plan_path, opts)
    except lifecycle.Stopped as e:
        code = _stopped(e, rank, launched)
    except AmspUserError as e:
        faults.record(e, rank)
        if not launched:
            refuse(f"error: {e}")
        code = faults.EXIT_REFUSED
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - a rank's fault (DCP's CheckpointException is a
        # BaseException): one line with its cause
        rank = env_rank()  # SLURM's variables are mapped by now
        faults.record(e, rank)
        code = faults.EXIT_RANK_FAILED
        alike = isinstance(e, faults.JobFault) and rank != 0  # rank 0 tells it
        if not launched and faults.cause(e)[1] and not alike:
            print(f"error: {faults.line(e, rank)}", file=sys.stderr, flush=True)
    leave(code)


def _stopped(e: lifecycle.Stopped, rank: int, launched: bool) -> int:
    """A save-and-stop asked by SIGTERM: under ``amsp train`` the ranks end cleanly and the
    launcher tells it (exit 143); under an external launch each rank exits 143 and rank 0
    prints the line."""
    if launched:
        if rank == 0:
            Path(os.environ[faults.RUN_DIR_ENV], "stopped.json").write_text(
                json.dumps({"step": e.step, "path": e.path}))
        return 0
    if rank == 0:
        print(f"interrupted: SIGTERM: the job stopped after saving checkpoint {e.path} "
              "(--save-on-sigterm)", file=sys.stderr, flush=True)
    return lifecycle.EXIT_SIGNALLED[signal.SIGTERM]


REFUSAL_PAUSE_S = 5.0
"""How long ranks other than 0 wait before leaving with a refusal under an external launch."""


def refuse(line: str) -> NoReturn:
    """A refusal under an external launch: every rank leaves with exit 2, rank 0 prints the
    line. The others leave after a pause, so that a launcher stopping the job at the first
    exit (torchrun, srun --kill-on-bad-exit) does not stop rank 0 before it printed."""
    if env_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(REFUSAL_PAUSE_S)
    leave(faults.EXIT_REFUSED)


# ----- the launcher ------------------------------------------------------------------------------
def _torchrun(nproc: int, nnodes: int, node_rank: int, addr: str, port: int, plan: str,
              opts: dict) -> list[str]:
    return torchrun_cmd(nproc, port, nnodes, node_rank, addr) + [
        "-m", "amsp_planner.runtime.launch", plan, "--opts", json.dumps(opts)]


def preflight(plan, plan_path: str, opts: dict, nproc_per_node: int | None, ranks_here: int,
              force: bool = False, lock: bool = True) -> int | None:
    """Refuse what can be refused before starting any process (one line, exit 2), and, when
    `lock` (the launcher of node 0: the other nodes' share the folder), take the checkpoint
    folder's lock before the checkpoint is read; returns the lock's file descriptor (None
    without one). Only the host's checks may need torch (on a host with GPU devices)."""
    from amsp_planner.runtime.ckpt_lock import lock_folder, release
    from amsp_planner.runtime.inputs import check_data
    from amsp_planner.runtime.preflight import (
        check_outputs,
        check_resume,
        check_supported,
        check_tp,
        cuda_available,
        host_problems,
    )

    job = plan.job
    check_supported(job.model)
    check_tp(plan.strategy, plan.job)
    r = job.gpus_per_node
    if nproc_per_node is not None and nproc_per_node != r:
        raise AmspUserError(f"--nproc-per-node {nproc_per_node}: the plan expects {r} processes "
                            f"per node ({job.num_gpus} in all): drop the option or re-plan with "
                            f"--gpus {nproc_per_node * job.num_nodes}")
    check_outputs(opts, [plan_path, opts.get("data")])
    check_data(opts.get("data"), job.model.vocab_size, job.training.seq_len)
    ck = opts.get("checkpoint_dir")
    fd = None
    if lock and ck and (opts.get("checkpoint_every") or opts.get("resume")):
        fd = lock_folder(ck, create=bool(opts.get("checkpoint_every")))
    try:
        check_resume(job, opts)
        cuda = cuda_available() and not opts.get("cpu")
        problems = host_problems(job, plan.evaluation, cuda, ranks_here)
        if problems and not force:
            raise AmspUserError(f"{problems[0]}; or --force to run anyway")
    except BaseException:
        release(fd)
        raise
    for p in problems:
        print(f"warning: --force: running although {p}", flush=True)
    return fd


def launch(plan_path: str, plan, opts: dict, *, local_nodes: bool = False,
           node_rank: int | None = None, master_addr: str | None = None,
           master_port: int | None = None, nproc_per_node: int | None = None,
           env: dict | None = None, force: bool = False) -> int:
    """Start torchrun agent(s) for the plan's world; returns the job's exit code. The
    checkpoint folder stays locked for the job's life; SIGINT, SIGTERM and SIGHUP stop
    every agent and rank (``lifecycle.py``)."""
    from amsp_planner.runtime.ckpt_lock import release
    from amsp_planner.runtime.inputs import check_port

    job = plan.job
    n, r = job.num_nodes, job.gpus_per_node
    if n > 1 and not local_nodes and node_rank is None:
        raise AmspUserError(
            f"the plan is for {n} nodes of {r}: run `amsp train` on every node with "
            "--node-rank I --master-addr HOST, or simulate them on this host with --local-nodes"
        )
    ranks = range(n) if local_nodes or n == 1 else [node_rank]
    if master_port is not None and 0 in ranks:  # this host serves the rendezvous
        check_port(master_port)
    lock = preflight(plan, plan_path, opts, nproc_per_node, r * len(ranks), force,
                     lock=0 in ranks)
    try:
        return _run(plan_path, opts, job, ranks, master_addr, master_port, env, lock)
    finally:
        release(lock)


def _run(plan_path: str, opts: dict, job, ranks, master_addr, master_port, env, lock) -> int:
    n, r = job.num_nodes, job.gpus_per_node
    addr = master_addr or "127.0.0.1"
    port = master_port or free_port()
    try:
        run = Path(tempfile.mkdtemp(prefix="amsp-run-"))
    except OSError as e:
        raise AmspUserError(f"cannot create the run folder in {tempfile.gettempdir()} "
                            f"({e.strerror}): set TMPDIR to a writable folder") from None
    e = dict(env or os.environ)
    e[faults.RUN_DIR_ENV] = str(run)
    e[lifecycle.LAUNCHER_PID_ENV] = str(os.getpid())
    e.setdefault("OMP_NUM_THREADS", "1")
    if addr in ("127.0.0.1", "localhost"):
        e.setdefault("GLOO_SOCKET_IFNAME", "lo")
    keep = (lock,) if lock is not None else ()
    with open(run / faults.LOG_NAME, "w+") as log, lifecycle.Signals() as sig:
        procs = []
        for nr in ranks:
            if not sig.received:
                procs.append(subprocess.Popen(_torchrun(r, n, nr, addr, port, plan_path, opts),
                                              env=e, stderr=log, start_new_session=True,
                                              pass_fds=keep))
        code = wait_all(procs, signals=sig, run=run,
                        save_on_sigterm=bool(opts.get("save_on_sigterm")))
        log.seek(0)
        text = log.read()
        if sig.received:
            return _interrupted(run, sig.received[0], opts)
    return _outcome(run, code, text, job.num_gpus, opts)


def _last_checkpoint(opts: dict) -> str:
    """``; last complete checkpoint: D/step_K``, or nothing without one."""
    ck = opts.get("checkpoint_dir")
    if not ck:
        return ""
    from amsp_planner.runtime.ckpt_files import latest_step

    try:
        k = latest_step(ck)
    except AmspUserError:
        k = None
    return f"; last complete checkpoint: {ck}/step_{k}" if k is not None else ""


def _remove_partial(opts: dict) -> None:
    """Remove the save a stop cut short (``step_K.tmp``): every process of the job has ended
    and the folder is still locked, so no other job is writing there."""
    import shutil

    ck = opts.get("checkpoint_dir")
    if ck:
        for partial in Path(ck).glob("step_*.tmp"):
            shutil.rmtree(partial, ignore_errors=True)


def _interrupted(run: Path, signum: int, opts: dict) -> int:
    """A job stopped by a signal: its partial checkpoint removed (the folder is still locked,
    so no other job writes there), one line, exit 128 + the signal."""
    import shutil

    name = signal.Signals(signum).name
    _remove_partial(opts)
    stopped = run / "stopped.json"
    if stopped.exists():
        doc = json.loads(stopped.read_text())
        what = f"the job stopped after saving checkpoint {doc['path']} (--save-on-sigterm)"
    else:
        what = "the job is stopped, every rank ended" + _last_checkpoint(opts)
    print(f"interrupted: {name}{' (Ctrl-C)' if signum == signal.SIGINT else ''}: {what}",
          file=sys.stderr, flush=True)
    shutil.rmtree(run, ignore_errors=True)
    return lifecycle.EXIT_SIGNALLED.get(signum, 128 + signum)


def _outcome(run: Path, code: int, log_text: str, world: int, opts: dict) -> int:
    """The job's exit code, and its one line when it failed."""
    import shutil

    recs = faults.records(run)
    refused = [x for x in recs if x["type"] == "AmspUserError"]
    if refused:
        shutil.rmtree(run, ignore_errors=True)
        raise AmspUserError(refused[0]["message"])
    if code:
        if code < 0 and not recs:  # the agent itself was killed; its ranks died with it
            _remove_partial(opts)
            line = (f"the torchrun agent was killed by signal {-code}, its ranks with it"
                    + _last_checkpoint(opts))
        else:
            line = faults.summary(run, world, log_text, code) + _last_checkpoint(opts)
        print(f"error: {line} (full log: {run / faults.LOG_NAME})", file=sys.stderr, flush=True)
        return faults.EXIT_RANK_FAILED
    verdict = json.loads((run / "verdict.json").read_text()) if (run / "verdict.json").exists() \
        else {"ok": True}
    shutil.rmtree(run, ignore_errors=True)
    return 0 if verdict["ok"] else faults.EXIT_DIFFERS


SAVE_GRACE_S = 120.0
"""How long ``--save-on-sigterm`` waits for the job to save and stop after a SIGTERM before
stopping it as without the option (a second signal stops it at once)."""


def wait_all(procs: list[subprocess.Popen], grace_s: float = lifecycle.STOP_GRACE_S,
             signals: lifecycle.Signals | None = None, run: Path | None = None,
             save_on_sigterm: bool = False) -> int:
    """Wait for every agent; when one fails, or a signal asks it, stop the others. Returns
    the first failure. With `save_on_sigterm` a first SIGTERM asks the ranks to save and stop
    (``lifecycle.ask_stop``) and waits up to ``SAVE_GRACE_S`` for them."""
    live = list(procs)
    asked = 0
    save_deadline = None
    while live:
        got = signals.received if signals is not None else []
        if len(got) > asked:
            asked = len(got)
            if (save_on_sigterm and asked == 1 and got[0] == signal.SIGTERM
                    and run is not None):
                lifecycle.ask_stop(run)
                save_deadline = time.monotonic() + SAVE_GRACE_S
            else:
                stop_all(live, grace_s)
                return 0
        if save_deadline is not None and time.monotonic() > save_deadline:
            stop_all(live, grace_s)
            return 0
        for p in list(live):
            rc = p.poll()
            if rc is None:
                continue
            live.remove(p)
            if rc:
                stop_all(live, grace_s)
                return rc
        time.sleep(0.1)
    return 0


def stop_all(agents: list[subprocess.Popen], grace_s: float) -> None:
    """Stop agents and their ranks: SIGTERM to each agent's session (the agent then ends
    its ranks), and after `grace_s` SIGKILL to whatever is left of each, ranks included."""
    for q in agents:
        stop_agent(q, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(q.poll() is None for q in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    for q in agents:
        if q.poll() is None:
            lifecycle.kill_tree(q.pid)
            q.wait()


def stop_agent(p: subprocess.Popen, sig) -> None:
    """Signal an agent's session (the agent; on SIGTERM it ends its ranks, which torchrun
    starts in sessions of their own)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> None:
    """Worker entry: ``python -m amsp_planner.runtime.launch PLAN [amsp train options]`` (the
    command line of ``amsp train``), or ``PLAN --opts JSON`` (the launcher's own form)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--opts" not in argv:
        from amsp_planner.cli.main import main as amsp

        amsp(["train", *argv])
        return
    i = argv.index("--opts")
    opts = json.loads(argv[i + 1])
    worker((argv[:i] + argv[i + 2:])[0], opts)


if __name__ == "__main__":
    main()
