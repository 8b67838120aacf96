"""Writing output files: atomically, and never over something the user would lose.

Every file amsp writes (plans, exports, sweeps, plots, calibrated specs) goes through
``write_output``: the content goes to a temporary file next to the target, then a rename, so a
reader or a killed run never sees half a file. An existing path is replaced only when it is an
earlier output of the same kind (``earlier(path)`` says so; ``contains`` looks for markers in
the first bytes): an input plan,
a config of the user's, a folder or any other file is refused with one line before anything is
written. ``check_output`` runs the same checks up front, for commands that work a long time
before they write. The file gets the mode a plain write would give it (umask respected; an
earlier file keeps its mode).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from amsp_planner.errors import AmspUserError

HEAD_BYTES = 4096


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(HEAD_BYTES)
    except OSError:
        return b""


def check_output(path: str | Path, option: str, what: str,
                 earlier: Callable[[Path], bool]) -> Path:
    """Refuse (AmspUserError) a path that could not take `what`: a missing folder, a folder,
    or an existing file that `earlier` does not recognise as an earlier `what`."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise AmspUserError(f"{option} {path}: folder {parent} does not exist: create it first")
    if p.is_dir():
        raise AmspUserError(f"{option} {path}: is a folder: give a file name")
    if p.exists() and not earlier(p):
        raise AmspUserError(f"{option} {path}: exists and is not {what}; refusing to overwrite "
                            "it: choose another path or remove it first")
    return p


def _normal_mode(path: Path) -> int:
    """The mode `open(path, "w")` would leave: an existing file's own, else 0666 less umask
    (the temporary file starts at 0600)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def write_output(path: str | Path, option: str, what: str, earlier: Callable[[Path], bool],
                 content: str | bytes | Callable[[Path], None]) -> Path:
    """Check `path` (``check_output``), then write `content` (text, bytes, or a function that
    writes the given temporary path) atomically."""
    p = check_output(path, option, what, earlier)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent)
    try:
        if callable(content):
            os.close(fd)
            content(Path(tmp))
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, _normal_mode(p))
        os.replace(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise AmspUserError(f"{option} {path}: cannot write it ({e.strerror}): check the "
                            "path") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def contains(*markers: str | bytes) -> Callable[[Path], bool]:
    """An `earlier` test: the file's first bytes contain every marker."""
    want = [m.encode() if isinstance(m, str) else m for m in markers]
    return lambda path: all(m in _head(path) for m in want)
