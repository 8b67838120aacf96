"""Launching: `amsp train` starts torchrun for the plan's world, or runs inside an existing
torchrun / SLURM launch. Also the entry point torchrun runs (``main``: one rank, ``worker.py``).

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
from pathlib import Path

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime import faults, lifecycle
from amsp_planner.runtime.worker import (
    leave,  # noqa: F401 - also this module's API
    worker,
)

DEFAULT_MASTER_PORT = 29500
"""The rendezvous port of a cluster launch (``--node-rank``) without ``--master-port``:
torchrun's default, the same on every node."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what bind to 0 and connect draw)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free on this host for a rendezvous on loopback, taken below the kernel's
    ephemeral range where one is free: a port the kernel hands out (bind to 0) is also what
    every outgoing connection of a busy host draws from, so between this check and torchrun's
    bind another process may take it (``_run`` retries the launch on that)."""
    import random

    lo = _ephemeral_low()
    rng = random.Random()
    for _ in range(64 if lo > 11000 else 0):
        port = rng.randrange(10000, lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TRIES = 3
"""Launches on a port the launcher chose before it reports that torchrun could not bind it."""


def _port_taken(log_text: str) -> bool:
    """torchrun's store could not listen on the rendezvous port (another process took it
    after ``free_port``), before any rank ran."""
    t = log_text.lower()
    return "eaddrinuse" in t or "address already in use" in t


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
    if node_rank is not None:
        master_port = _check_cluster_launch(n, node_rank, local_nodes, master_addr, master_port)
    ranks = range(n) if local_nodes or n == 1 else [node_rank]
    if master_port is not None and 0 in ranks:  # this host serves the rendezvous
        check_port(master_port)
    lock = preflight(plan, plan_path, opts, nproc_per_node, r * len(ranks), force,
                     lock=0 in ranks)
    try:
        return _run(plan_path, opts, job, ranks, master_addr, master_port, env, lock)
    finally:
        release(lock)


def _check_cluster_launch(n: int, node_rank: int, local_nodes: bool, master_addr: str | None,
                          master_port: int | None) -> int:
    """Refuse the options of one node of a cluster launch that cannot meet the others (one
    line, exit 2); returns the rendezvous port, ``DEFAULT_MASTER_PORT`` unless given."""
    if local_nodes:
        raise AmspUserError(f"--node-rank {node_rank} and --local-nodes: --local-nodes runs "
                            "every node here: give one of them")
    if n == 1:
        raise AmspUserError(f"--node-rank {node_rank}: the plan is for one node: drop the "
                            "option, or re-plan for more GPUs")
    if node_rank >= n:
        raise AmspUserError(f"--node-rank {node_rank}: the plan has {n} nodes (ranks 0 to "
                            f"{n - 1}): give this node's index")
    if not master_addr:
        raise AmspUserError(f"--node-rank {node_rank}: needs --master-addr HOST, node 0's "
                            "address, the same on every node")
    return master_port or DEFAULT_MASTER_PORT


def _run(plan_path: str, opts: dict, job, ranks, master_addr, master_port, env, lock) -> int:
    """Launch; a launch on a port this launcher chose that another process took before
    torchrun bound it is retried on a new port (``PORT_TRIES``)."""
    for attempt in range(1, PORT_TRIES + 1):
        port = master_port or free_port()
        out = _launch_once(plan_path, opts, job, ranks, master_addr, port, env, lock,
                           retry=master_port is None and attempt < PORT_TRIES)
        if out is not None:
            return out
    raise AssertionError("unreachable: the last try returns")


def _launch_once(plan_path: str, opts: dict, job, ranks, master_addr, port: int, env, lock,
                 retry: bool) -> int | None:
    """One launch; None when `retry` and torchrun could not bind the port (the run folder
    removed: nothing ran)."""
    import shutil

    n, r = job.num_nodes, job.gpus_per_node
    addr = master_addr or "127.0.0.1"
    try:
        run = Path(tempfile.mkdtemp(prefix="amsp-run-"))
    except OSError as e:
        raise AmspUserError(f"cannot create the run folder in {tempfile.gettempdir()} "
                            f"({e.strerror}): set TMPDIR to a writable folder") from None
    e = dict(env or os.environ)
    e[faults.RUN_DIR_ENV] = str(run)
    from amsp_planner.runtime.ckpt_lock import LOCK_ID_ENV, lock_id

    e.pop(LOCK_ID_ENV, None)  # never another job's
    if lock is not None:
        e[LOCK_ID_ENV] = lock_id(lock)
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
    if retry and code and not faults.records(run) and _port_taken(text):
        shutil.rmtree(run, ignore_errors=True)
        return None
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
    failed = [r for r in faults.records(run) if r.get("primary")]
    if stopped.exists():
        doc = json.loads(stopped.read_text())
        what = f"the job stopped after saving checkpoint {doc['path']} (--save-on-sigterm)"
    elif failed and opts.get("save_on_sigterm"):  # the save it was asked for did not happen
        r = failed[0]
        what = (f"the save --save-on-sigterm asked for failed (rank {r['rank']}"
                f"{', step ' + str(r['step']) if r.get('step') else ''}: {r['cause']}); the "
                "job is stopped, every rank ended" + _last_checkpoint(opts))
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
                if save_on_sigterm and run is not None:
                    lifecycle.abort_stop(run)  # no save: the ranks end at the SIGTERM
                stop_all(live, grace_s)
                return 0
        if save_deadline is not None and time.monotonic() > save_deadline:
            lifecycle.abort_stop(run)
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
