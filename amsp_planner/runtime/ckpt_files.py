"""A checkpoint folder's files, read without torch: the ``latest`` pointer, the complete
steps, the checksums, the step to resume and the model it was saved for. The launcher refuses
a bad checkpoint with these before any rank starts (``preflight.py``); ``checkpoint.py``
writes what they read.

Every file is checked for its kind (a regular file: never a folder, FIFO or device, which
could hang a read or never end it), its size (``latest`` at most ``POINTER_MAX`` bytes,
``checksums.json`` at most ``SUMS_MAX``) and its shape before it is opened, and a bad one is
refused in one line naming it:

- ``latest``: ``step_K`` and a newline;
- ``checksums.json``: an object of ``{file name: [size, sha256]}`` naming ``.metadata`` and
  every shard (``__R_I.distcp``) of the folder, names without a path (so it can name no file
  outside the checkpoint), sizes non-negative integers, digests 64 hexadecimal digits. An empty
  or partial table is refused: a checkpoint is verified whole or not resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

from amsp_planner.errors import AmspUserError

SUMS = "checksums.json"
STATES = ("master", "exp_avg", "exp_avg_sq")
"""The tensors saved per unit (``unit<i>.<state>``), each a logical 1-D fp32 tensor."""
METADATA = ".metadata"
POINTER_MAX = 64
"""Bytes of a ``latest`` pointer (``step_K`` and a newline)."""
SUMS_MAX = 16 * 2**20
"""Bytes of a ``checksums.json``: about 150,000 entries, far above any world's shard count."""
_POINTER = re.compile(r"step_(\d{1,18})\n?")
_SHARD = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words ("a folder", "a FIFO", "a device", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def file_kind_problem(p: Path, limit: int | None = None) -> str | None:
    """Why `p` cannot be read as a checkpoint file (None: a regular file within `limit`
    bytes). Follows symbolic links, so a link to a device is refused as the device."""
    try:
        st = p.stat()
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({(e.strerror or str(e)).lower()})"
    if not stat.S_ISREG(st.st_mode):
        return f"is {kind_of(st.st_mode)}, not a regular file"
    if limit is not None and st.st_size > limit:
        return f"is {st.st_size:,} bytes, more than the {limit:,} such a file can be"
    return None


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step ``latest`` points to; None when there is no pointer."""
    p = Path(directory) / "latest"
    if not os.path.lexists(p):
        return None
    fix = "remove it or use another directory"
    bad = file_kind_problem(p, POINTER_MAX)
    if bad:
        raise AmspUserError(f"--checkpoint-dir: {p} {bad}: {fix}")
    try:
        m = _POINTER.fullmatch(p.read_text())
    except (OSError, UnicodeDecodeError):
        m = None
    if m is None:
        raise AmspUserError(f"--checkpoint-dir: {p} is not a checkpoint pointer (step_K): {fix}")
    return int(m[1])


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the finished checkpoints in `directory` (renamed folders with their
    checksums)."""
    root = Path(directory)
    return sorted(int(p.name[5:]) for p in root.glob("step_*")
                  if p.name[5:].isdigit() and p.is_dir() and (p / SUMS).is_file())


def read_sums(path: Path, head: str, fix: str) -> dict[str, tuple[int, str]]:
    """A checkpoint's checksum table, its kind, size and shape checked (one line naming the
    file otherwise)."""
    f = path / SUMS
    bad = file_kind_problem(f, SUMS_MAX)
    if bad == "missing":
        raise AmspUserError(f"{head} {SUMS} missing, so it cannot be verified: {fix}")
    if bad:
        raise AmspUserError(f"{head} {SUMS} {bad}: {fix}")
    try:
        text = f.read_text()
        doc = json.loads(text)
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep
        raise AmspUserError(f"{head} {SUMS} is unreadable: {fix}") from None
    shape = f"{head} {SUMS} is not a checksum table ({{file: [size, sha256]}})"
    if not isinstance(doc, dict):
        raise AmspUserError(f"{shape}: {fix}")
    out = {}
    for name, entry in doc.items():
        if name != METADATA and not _SHARD.fullmatch(name):
            raise AmspUserError(f"{shape}: it names {name[:80]!r}, not a file of a checkpoint: "
                                f"{fix}")
        ok = (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
              and entry[0] >= 0 and isinstance(entry[1], str) and _DIGEST.fullmatch(entry[1]))
        if not ok:
            raise AmspUserError(f"{shape}: the entry of {name} is {json.dumps(entry)[:60]}: "
                                f"{fix}")
        out[name] = (entry[0], entry[1])
    if METADATA not in out:
        raise AmspUserError(f"{head} {SUMS} does not list {METADATA}, so the checkpoint cannot "
                            f"be verified: {fix}")
    unlisted = sorted(p.name for p in path.glob("*.distcp") if p.name not in out)
    if unlisted:
        raise AmspUserError(f"{head} shard {unlisted[0]} is not in {SUMS}, so it cannot be "
                            f"verified: {fix}")
    return out


def verify(path: str | os.PathLike, option: str = "--resume") -> None:
    """Check a checkpoint against its checksums; refuse in one line naming the first file
    that is missing, not a regular file, truncated, grown or altered."""
    path = Path(path)
    this = int(path.name[5:]) if path.name[5:].isdigit() else 0
    earlier = [k for k in complete_steps(path.parent) if k < this]
    fix = (f"resume an earlier one with --resume-from {earlier[-1]}, or remove {path}"
           if earlier else f"remove {path} and start again")
    head = f"{option}: checkpoint {path.name}:"
    sums = read_sums(path, head, fix)
    for name, (size, digest) in sorted(sums.items(), key=lambda kv: kv[0] != METADATA):
        kind = "metadata" if name == METADATA else "shard"
        p = path / name
        bad = file_kind_problem(p)
        if bad == "missing":
            raise AmspUserError(f"{head} {kind} {name} deleted: {fix}")
        if bad:
            raise AmspUserError(f"{head} {kind} {name} {bad}: {fix}")
        got = p.stat().st_size
        if got != size:
            how = "truncated" if got < size else "grown"
            raise AmspUserError(f"{head} {kind} {name} {how} ({got:,} of {size:,} bytes): {fix}")
        with open(p, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                raise AmspUserError(f"{head} {kind} {name} altered (checksum mismatch): {fix}")


def resume_step(directory: str | os.PathLike, step: int | None = None) -> int | None:
    """The step to resume from: `step` (``--resume-from``), or the one ``latest`` points to,
    or without that pointer the newest complete checkpoint; None when the directory holds no
    checkpoint. Refuses a requested step that is not there, and a pointer to a missing step
    beside complete ones."""
    if step is None:
        k, have = latest_step(directory), complete_steps(directory)
        if k is None:  # a save stopped between its rename and the pointer, or removed
            return have[-1] if have else None
        if (Path(directory) / f"step_{k}").is_dir() or not have:
            return k
        raise AmspUserError(f"--resume: {Path(directory) / 'latest'} points at step_{k}, which "
                            f"is not there (complete ones: {', '.join(map(str, have))}): "
                            f"resume one with --resume-from {have[-1]}")
    if not (Path(directory) / f"step_{step}").is_dir():
        have = ", ".join(map(str, complete_steps(directory))) or "none"
        raise AmspUserError(f"--resume-from {step}: {directory} has no checkpoint step_{step} "
                            f"(complete ones: {have}): give one of those")
    return step


def check_model(meta: dict, job, path) -> None:
    """The checkpoint's model is the plan's, and its tensors (``meta["_sizes"]``, from the
    checkpoint's metadata) have the sizes of the plan's units."""
    want = json.loads(json.dumps(job.model.model_dump()))
    if meta.get("model") != want:
        got = meta.get("model")
        name = got.get("name") if isinstance(got, dict) else None
        raise AmspUserError(f"--resume: {path} holds a checkpoint of model '{name}', the "
                            f"plan trains '{job.model.name}': use a matching plan or "
                            "another --checkpoint-dir")
    sizes = meta.get("_sizes")
    if sizes is None:
        return
    expected = {f"unit{i}.{s}": n for i, n in enumerate(job.model.unit_params())
                for s in STATES}
    for fqn in sorted(set(expected) | set(sizes)):
        if sizes.get(fqn) != expected.get(fqn):
            raise AmspUserError(
                f"--resume: checkpoint in {path}: {METADATA} describes tensor {fqn} with "
                f"{sizes.get(fqn)} elements, the model's has {expected.get(fqn)}: the metadata "
                "is damaged: resume another with --resume-from K, or remove it")
