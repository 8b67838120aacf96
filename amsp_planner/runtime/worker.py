"""One rank of a job: the worker torchrun (or srun) runs, from the launch's environment to
the rank's exit code.

It reads the launch's environment (torchrun's variables, or SLURM's mapped onto them), makes
every input check a rank can make alone before any process-group work (the plan, the world
against the plan, the options, the outputs, the checkpoint's step), joins the process group,
trains, and leaves with its exit code: 0, 2 for a refusal (under an external launch every rank
leaves with it and rank 0 prints the line), 4 for a rank's fault (its first exception goes to
the run folder, or to stderr as one line), 5 when the collectives differ from the plan and no
launcher collects the verdict, 143 after a ``--save-on-sigterm`` stop. ``launch.py`` is the
module torchrun runs (``-m amsp_planner.runtime.launch``); its ``main`` calls ``worker``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime import faults, lifecycle


def inside_launch() -> bool:
    """True when this process is one rank of a torchrun (or SLURM srun) launch; a launch
    environment that cannot start a rank (a variable that is not a whole number, a rank
    outside the world, no MASTER_ADDR) is refused in one line naming the variable."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        world = env_int("WORLD_SIZE", lo=1)
        _check_rank("RANK", env_int("RANK"), "WORLD_SIZE", world)
        local = env_int("LOCAL_WORLD_SIZE", world, lo=1)
        if "LOCAL_RANK" in e:
            _check_rank("LOCAL_RANK", env_int("LOCAL_RANK"), "LOCAL_WORLD_SIZE", local)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not e.get(name):
                raise AmspUserError(f"launch environment: RANK and WORLD_SIZE are set but "
                                    f"{name} is not: export node 0's {name} (torchrun sets it), "
                                    "or unset RANK and WORLD_SIZE to let amsp train launch")
        env_int("MASTER_PORT", lo=1)
        return True
    if "SLURM_PROCID" not in e or env_int("SLURM_NTASKS", 1, lo=1) <= 1:
        return False
    _check_rank("SLURM_PROCID", env_int("SLURM_PROCID"), "SLURM_NTASKS",
                env_int("SLURM_NTASKS", lo=1))
    if "SLURM_NTASKS_PER_NODE" in e:
        env_int("SLURM_NTASKS_PER_NODE", lo=1, raw=e["SLURM_NTASKS_PER_NODE"].split("(")[0])
    return True


def env_int(name: str, default: int | None = None, lo: int = 0, raw: str | None = None) -> int:
    """A launch variable as a whole number >= `lo` (`default` when unset), or one line naming
    it. `raw`: the part of the value to read (SLURM's ``4(x2)`` task counts)."""
    value = os.environ.get(name) if raw is None else raw
    if value is None:
        if default is None:
            raise AmspUserError(f"launch environment: {name} is not set: the launcher "
                                "(torchrun, srun) sets it")
        return default
    try:
        n = int(value.strip())
    except ValueError:
        raise AmspUserError(f"launch environment: {name}={os.environ.get(name)!r} is not a "
                            "whole number: fix or unset it (torchrun and srun set it)") from None
    if n < lo:
        raise AmspUserError(f"launch environment: {name}={n} is below {lo}: fix or unset it "
                            "(torchrun and srun set it)")
    return n


def _check_rank(name: str, rank: int, world_name: str, world: int) -> None:
    if rank >= world:
        raise AmspUserError(f"launch environment: {name}={rank} is not below {world_name}="
                            f"{world}: every rank is 0 to {world_name} - 1")


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


def leave(code: int) -> NoReturn:
    """End a rank's process once everything it owes is written. gloo's threads may abort at
    interpreter teardown ("terminate called without an active exception"), which torchrun
    would report as a failed rank: flush and leave without running destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_config(opts: dict):
    from amsp_planner.runtime.engine import OptimConfig
    from amsp_planner.runtime.train import RunConfig

    keys = ("steps", "seed", "data", "checkpoint_dir", "checkpoint_every", "resume",
            "resume_from", "verified", "on_nonfinite", "log_every", "fail_at_step",
            "fail_rank", "fail_mode", "save_on_sigterm", "gate")
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
    from amsp_planner.runtime.ckpt_lock import LOCK_ID_ENV, lock_folder, lock_id

    msg = [None]
    if dist.get_rank() == 0:
        os.environ.pop(LOCK_ID_ENV, None)  # never another job's
        try:
            fd = lock_folder(ck, create=bool(opts.get("checkpoint_every")))
            if fd is not None:
                _HELD.append(fd)
                os.environ[LOCK_ID_ENV] = lock_id(fd)  # rank 0 saves: ckpt_lock.folder_problem
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
