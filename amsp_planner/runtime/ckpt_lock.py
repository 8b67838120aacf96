"""The lock of a run's checkpoint folder: one job at a time writes or resumes it.

    amsp train plan.json --checkpoint-dir ck ...    # a second job on ck: refused, exit 2

``amsp train`` takes an exclusive ``flock`` on ``<folder>/.amsp-lock`` before anything
reads or launches, and holds it for the job's life: its torchrun agents inherit the open lock
(so it outlives a launcher killed before them), and the kernel releases it when the last of
them ends, however it ends. On a cluster node 0's ``amsp train`` takes it (the nodes share
the folder); under an external launch rank 0 does. The file names its
holder (process, host, command, start time), which a refused job prints:

    error: --checkpoint-dir ck: in use by another job (pid 4242 on node1, amsp train p.json,
    since 2026-12-02 07:40:12 UTC): wait for it to end or stop it, or give another folder

A folder this process cannot write (a read-only copy, resumed only) is read without a lock
when it holds no lock file. ``flock`` is advisory and local to a host on some network file
systems (NFS before v4 without ``local_lock``): across hosts it guards what they share.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import sys
import time
from pathlib import Path

from amsp_planner.errors import AmspUserError

LOCK_NAME = ".amsp-lock"
_HOLDER_MAX = 512


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, _HOLDER_MAX, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else "holder unknown"


def lock_folder(folder: str | os.PathLike, create: bool, option: str = "--checkpoint-dir"
                ) -> int | None:
    """Take `folder`'s lock (creating the folder when `create`); returns the lock's file
    descriptor, to keep open for the job's life, or None when the folder can hold no lock
    (absent and not to be created, or read-only without a lock file). Refuses in one line
    when another job holds it."""
    p = Path(folder)
    if create:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AmspUserError(f"{option} {folder}: cannot create it "
                                f"({(e.strerror or str(e)).lower()}): choose a writable folder"
                                ) from None
    elif not p.is_dir():
        return None
    f = p / LOCK_NAME
    fd = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            fd = os.open(f, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            break
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise AmspUserError(f"{option} {folder}: {LOCK_NAME} is a symbolic link: "
                                    "remove it") from None
            continue
    if fd is None:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise AmspUserError(f"{option} {folder}: {LOCK_NAME} is not a regular file: remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise AmspUserError(f"{option} {folder}: in use by another job ({holder}): wait "
                                "for it to end or stop it, or give another folder") from None
        return None  # a file system without locks: nothing to guard with
    _write_holder(fd)
    return fd


def _write_holder(fd: int) -> None:
    cmd = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    text = f"pid {os.getpid()} on {socket.gethostname()}, {cmd}, since {since}\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except OSError:
        pass  # read-only: the lock still holds


def release(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


LOCK_ID_ENV = "AMSP_CKPT_LOCK_ID"
"""The held lock file's identity (device:inode), set for the job's ranks by whoever took the
lock (the launcher, or rank 0 under an external launch), so a save can tell its folder from a
folder that replaced it."""


def lock_id(fd: int | None) -> str | None:
    if fd is None:
        return None
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


def folder_problem(folder: str | os.PathLike) -> str | None:
    """Why the job's checkpoint folder is no longer the one it locked (None when it is): it was
    removed, or replaced (the lock file gone, or another's). Checked before each save, so a
    save never recreates a removed folder without its lock, beside another job. None without
    a lock taken (``LOCK_ID_ENV`` unset): nothing to compare with."""
    p, want = Path(folder), os.environ.get(LOCK_ID_ENV)
    if not want:  # no lock taken (the runtime called directly, or no locks on this file system)
        return None
    if not p.is_dir():
        return (f"the checkpoint folder {folder} was removed during the run (its checkpoints "
                "and lock with it): restore it, or resume from a copy in another "
                "--checkpoint-dir")
    try:
        st = os.stat(p / LOCK_NAME, follow_symlinks=False)
    except OSError:
        st = None
    if st is None or f"{st.st_dev}:{st.st_ino}" != want:
        return (f"the checkpoint folder {folder} was replaced during the run (its lock file "
                f"{LOCK_NAME} is gone or another's): another job may be writing there; give "
                "this job another --checkpoint-dir")
    return None
