"""Checks before any rank starts: the plan against this host, every output, the checkpoint.

    amsp train plan.json ...        # refused in one line (exit 2), or --force to run anyway

- the host: the plan's device type (a cluster of CPU processes, ``intra_fabric: shm``, or of
  GPUs) against what this host would run; ranks per node against the GPUs, or for CPU
  processes against the cores (at most ``MAX_RANKS_PER_CORE`` per core); the plan's predicted
  memory per rank against each GPU's free memory, or the host's available memory for all the
  ranks started here. ``--force`` runs anyway and says so.
- the outputs: the report path can take a run report (an earlier report or a new file, in a
  writable folder; never the plan or the data), the checkpoint folder and the run folder of
  logs are writable. Never forced.
- ``--resume``: the checkpoint's checksums, its model and its step against ``--steps``.
- options that cannot apply together.
"""

from __future__ import annotations

import os
from pathlib import Path

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime.support import check_supported, check_tp  # noqa: F401 - this API too

MAX_RANKS_PER_CORE = 4
"""CPU ranks share cores; beyond four per core a step is mostly waiting for a core."""
REPORT_KIND = "amsp-run-report"
"""The first key of a run report; an existing file without it is never replaced."""


def check_world(job, world: int, local: int) -> None:
    """Refuse a plan launched on a world of the wrong shape (one line, before any work)."""
    n, r = job.num_gpus, job.gpus_per_node
    if world != n:
        replan = f" or re-plan with --gpus {world}" if 1 <= world <= 2**20 else ""
        raise AmspUserError(f"plan is for {n} GPUs but the job has {world} processes: "
                            f"launch {n} (e.g. torchrun --nproc-per-node={r} --nnodes={n // r})"
                            f"{replan}")
    if local > world:
        raise AmspUserError(f"LOCAL_WORLD_SIZE {local} is above WORLD_SIZE {world}: a node "
                            "cannot run more processes than the job has; fix the launcher's "
                            "environment")
    if local != r:
        raise AmspUserError(f"plan expects {r} processes per node but this node runs {local}: "
                            f"launch --nproc-per-node={r}, or re-plan for this cluster")


def check_steps(step: int, steps: int, directory) -> None:
    """`amsp train --resume` with nothing left to run is refused (``train()`` itself allows
    it: a load alone, as the resharding tests use)."""
    if step >= steps:
        raise AmspUserError(f"--steps {steps}: the checkpoint in {directory} is at step {step} "
                            f"already, so there is nothing to run: give --steps above {step}")


def is_report(path) -> bool:
    from amsp_planner.outfile import contains

    return contains(f'"kind": "{REPORT_KIND}"')(path)


def check_report(path: str) -> None:
    """Refuse a report path that could not take the run report (before any work)."""
    from amsp_planner.outfile import check_output

    check_output(path, "--report", "an amsp run report", is_report)


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch (seconds of a CPU core) on a host
    with no GPU device node: without the driver's devices (NVIDIA, ROCm, WSL) CUDA cannot be
    available."""
    import glob

    if not any(glob.glob(p) for p in ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def host_problems(job, evaluation, cuda: bool, ranks_here: int) -> list[str]:
    """What makes this host unable to run the plan's ranks (empty: nothing)."""
    c = job.cluster
    per_rank = evaluation.memory.total
    if c.intra_fabric != "shm" and not cuda:
        return [f"the plan is for {c.name} ({c.gpu.name} GPUs) but this host runs CPU processes "
                "(no CUDA device): plan for this host (--cluster cpu-local, or a spec from "
                "amsp calibrate)"]
    if c.intra_fabric == "shm" and cuda:
        return [f"the plan is for CPU processes ({c.name}) but CUDA is available: add --cpu, "
                "or plan for the GPUs"]
    out = []
    if cuda:
        import torch

        have = torch.cuda.device_count()
        if have < job.gpus_per_node:
            out.append(f"the plan runs {job.gpus_per_node} ranks per node but this host has "
                       f"{have} GPU(s): re-plan with --gpus {have * job.num_nodes}")
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(min(have, job.gpus_per_node)))
        if per_rank > free:
            out.append(f"the plan needs {_gib(per_rank)} per GPU but this host's GPUs have "
                       f"{_gib(free)} free: re-plan with --memory-limit {free / 2**30:.1f}")
        return out
    cores = os.cpu_count() or 1
    if ranks_here > MAX_RANKS_PER_CORE * cores:
        out.append(f"{ranks_here} ranks on this host's {cores} cores (at most "
                   f"{MAX_RANKS_PER_CORE} per core): re-plan with fewer --gpus")
    avail = _available_memory()
    if avail is not None and per_rank * ranks_here > avail:
        out.append(f"the plan needs {_gib(per_rank)} per rank, {_gib(per_rank * ranks_here)} for "
                   f"the {ranks_here} ranks on this host, but {_gib(avail)} is available: "
                   "re-plan a smaller job or a sharded strategy")
    return out


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _probe(folder: Path, option: str, path) -> None:
    """Refuse a folder this process cannot create files in, naming the reason."""
    from amsp_planner.outfile import probe_folder

    probe_folder(folder, option, path)


def _existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_outputs(opts: dict, inputs: list[str]) -> None:
    """Every output path writable and none of them an input (one line, exit 2)."""
    ins = {os.path.realpath(p) for p in inputs if p}
    rep = opts.get("report")
    if rep:
        if os.path.realpath(rep) in ins:
            raise AmspUserError(f"--report {rep}: is an input of this run (the plan or the "
                                "data): give another path")
        check_report(rep)
        _probe(Path(rep).parent, "--report", rep)
    ck = opts.get("checkpoint_dir")
    if ck:
        p = Path(ck)
        if p.exists() and not p.is_dir():
            raise AmspUserError(f"--checkpoint-dir {ck}: is a file: give a folder")
        if os.path.realpath(ck) in ins:
            raise AmspUserError(f"--checkpoint-dir {ck}: is an input of this run: give another "
                                "folder")
        if opts.get("checkpoint_every"):  # a resume alone only reads it
            _probe(_existing(p.absolute()), "--checkpoint-dir", ck)
            if not opts.get("resume"):
                _check_fresh(p)


def _check_fresh(folder: Path) -> None:
    """A run from step 0 saving into `folder` would replace the checkpoints an earlier run left
    there (its saves take their names): refused in one line, and junk named like a checkpoint
    (a folder `latest`, a file `step_K`) that the first save would trip on."""
    from amsp_planner.runtime.ckpt_files import complete_steps

    if not folder.is_dir():
        return
    have = complete_steps(folder)
    if have:
        raise AmspUserError(f"--checkpoint-dir {folder}: holds checkpoints of an earlier run "
                            f"(step {', '.join(map(str, have))}): give --resume to continue "
                            "it, or another folder to start over (a run from step 0 would "
                            "replace them)")
    latest = folder / "latest"
    if os.path.lexists(latest) and not latest.is_file():
        raise AmspUserError(f"--checkpoint-dir {folder}: {latest} is not a file (the save's "
                            "pointer goes there): remove it or give another folder")
    for q in folder.glob("step_*"):
        if q.name[5:].isdigit() and not q.is_dir():
            raise AmspUserError(f"--checkpoint-dir {folder}: {q} is not a checkpoint folder "
                                "(a save would go there): remove it or give another folder")


def check_options(opts: dict) -> None:
    """Options that cannot apply together (one line, exit 2)."""
    ck, every = opts.get("checkpoint_dir"), opts.get("checkpoint_every")
    if opts.get("resume") and not ck:
        raise AmspUserError("--resume needs --checkpoint-dir DIR: the directory to resume from")
    if every and not ck:
        raise AmspUserError(f"--checkpoint-every {every}: needs --checkpoint-dir DIR, the "
                            "folder to save to: add it or drop --checkpoint-every")
    if opts.get("resume_from") is not None and not opts.get("resume"):
        raise AmspUserError(f"--resume-from {opts['resume_from']}: only applies with --resume: "
                            "add --resume or drop --resume-from")


def check_resume(job, opts: dict) -> None:
    """The checkpoint a resume will load: its step against --steps, its checksums and its
    model, all before any rank starts."""
    from amsp_planner.runtime.ckpt_files import check_model, resume_step, verify

    ck = opts.get("checkpoint_dir")
    if not (opts.get("resume") and ck):
        return
    step = resume_step(ck, opts.get("resume_from"))
    if step is None:
        return
    check_steps(step, opts.get("steps", 10), ck)
    path = Path(ck) / f"step_{step}"
    verify(path)
    from amsp_planner.runtime.checkpoint import read_meta  # torch: once the files are sound

    check_model(read_meta(path), job, ck)
    opts["verified"] = True
