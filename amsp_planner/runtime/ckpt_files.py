"""A checkpoint folder's files, read without torch: the ``latest`` pointer, the complete
steps, the checksums, the step to resume and the model it was saved for. The launcher refuses
a bad checkpoint with these before any rank starts (``preflight.py``); ``checkpoint.py``
writes what they read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from amsp_planner.errors import AmspUserError

SUMS = "checksums.json"


def latest_step(directory: str | os.PathLike) -> int | None:
    p = Path(directory) / "latest"
    if not p.exists():
        return None
    try:
        return int(p.read_text().strip().removeprefix("step_"))
    except ValueError:
        raise AmspUserError(f"--checkpoint-dir: {p} is not a checkpoint pointer: remove it or use "
                            "another directory") from None


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the finished checkpoints in `directory` (renamed, with their checksums)."""
    root = Path(directory)
    return sorted(int(p.name[5:]) for p in root.glob("step_*")
                  if p.name[5:].isdigit() and (p / SUMS).exists())


def verify(path: str | os.PathLike, option: str = "--resume") -> None:
    """Check a checkpoint against its checksums; refuse in one line naming the first file
    that is missing, truncated, grown or altered."""
    path = Path(path)
    this = int(path.name[5:]) if path.name[5:].isdigit() else 0
    earlier = [k for k in complete_steps(path.parent) if k < this]
    fix = (f"resume an earlier one with --resume-from {earlier[-1]}, or remove {path}"
           if earlier else f"remove {path} and start again")
    head = f"{option}: checkpoint {path.name}:"
    try:
        sums = json.loads((path / SUMS).read_text())
    except FileNotFoundError:
        raise AmspUserError(f"{head} {SUMS} missing, so it cannot be verified: {fix}") from None
    except (OSError, ValueError):
        raise AmspUserError(f"{head} {SUMS} is unreadable: {fix}") from None
    for name, (size, digest) in sorted(sums.items(), key=lambda kv: kv[0] != ".metadata"):
        kind = "metadata" if name == ".metadata" else "shard"
        p = path / name
        if not p.exists():
            raise AmspUserError(f"{head} {kind} {name} deleted: {fix}")
        got = p.stat().st_size
        if got != size:
            how = "truncated" if got < size else "grown"
            raise AmspUserError(f"{head} {kind} {name} {how} ({got:,} of {size:,} bytes): {fix}")
        with open(p, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                raise AmspUserError(f"{head} {kind} {name} altered (checksum mismatch): {fix}")


def resume_step(directory: str | os.PathLike, step: int | None = None) -> int | None:
    """The step to resume from: `step` (``--resume-from``) or the latest; None when the
    directory holds no checkpoint. Refuses a requested step that is not there."""
    if step is None:
        return latest_step(directory)
    if not (Path(directory) / f"step_{step}").is_dir():
        have = ", ".join(map(str, complete_steps(directory))) or "none"
        raise AmspUserError(f"--resume-from {step}: {directory} has no checkpoint step_{step} "
                            f"(complete ones: {have}): give one of those")
    return step


def check_model(meta: dict, job, path) -> None:
    want = json.loads(json.dumps(job.model.model_dump()))
    if meta.get("model") != want:
        name = meta.get("model", {}).get("name")
        raise AmspUserError(f"--resume: {path} holds a checkpoint of model '{name}', the "
                            f"plan trains '{job.model.name}': use a matching plan or "
                            "another --checkpoint-dir")
