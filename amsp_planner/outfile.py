"""Writing output files: atomically, and never over something the user would lose.

Every file amsp writes (plans, exports, sweeps, plots, calibrated specs) goes through
``write_output``: the content goes to a temporary file next to the target, then a rename, so a
reader or a killed run never sees half a file. An existing path is replaced only when it is an
earlier output of the same kind (``earlier(path)`` says so; ``contains`` looks for markers in
the first bytes): an input plan, a config of the user's, a folder or any other file is refused
with one line before anything is written. ``check_output`` runs the same checks up front, for
commands that work a long time before they write: a path too long for the system, a FIFO or a
device (never opened: a FIFO would wait for a reader), a folder this process cannot create
files in (read-only file system, no permission): one line naming the path and the cause,
before any work. ``check_outputs`` does so for a command with several outputs, refusing two of
them on one path. A write that fails anyway (no space left, ...) is one line too, and leaves no
temporary file. The file gets the mode a plain write would give it (umask respected; an
earlier file keeps its mode).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from amsp_planner.errors import AmspUserError, shown
from amsp_planner.textfile import file_kind

HEAD_BYTES = 4096


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(HEAD_BYTES)
    except OSError:
        return b""


def _why(e: OSError) -> str:
    return (e.strerror or str(e)).lower()


def probe_folder(folder: Path, option: str, path) -> None:
    """Refuse a folder this process cannot create files in (read-only file system, no write
    permission, no space left), naming the cause: before any work, as a write would fail."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".amsp-probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise AmspUserError(f"{option} {shown(path)}: {_why(e)} (in {shown(folder)}): choose "
                            "a writable folder") from None


def check_output(path: str | Path, option: str, what: str,
                 earlier: Callable[[Path], bool]) -> Path:
    """Refuse (AmspUserError) a path that could not take `what`: a path longer than the system
    allows, a missing or unwritable folder, a folder, something other than a regular file (a
    FIFO or a device: never opened), or an existing file that `earlier` does not recognise as
    an earlier `what`."""
    from amsp_planner.textfile import path_too_long

    p = Path(path)
    long = path_too_long(p)
    if long:
        raise AmspUserError(f"{option} {shown(path)}: {long}: give a shorter path")
    if not str(path).strip():
        raise AmspUserError(f"{option} is empty: give a file name (or - for stdout where the "
                            "command allows it)")
    if str(path).endswith(("/", os.sep)):  # Path() drops it: a folder was meant, not a file
        raise AmspUserError(f"{option} {shown(path)}: names a folder (it ends with /): give a "
                            "file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise AmspUserError(f"{option} {shown(path)}: folder {shown(parent)} does not exist: "
                            "create it first")
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise AmspUserError(f"{option} {shown(path)}: cannot use it ({_why(e)}): choose "
                            "another path") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise AmspUserError(f"{option} {shown(path)}: is a folder: give a file name")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise AmspUserError(f"{option} {shown(path)}: is {file_kind(st.st_mode)}, not a regular "
                            "file: give the path of a file")
    if st is not None and not earlier(p):
        raise AmspUserError(f"{option} {shown(path)}: exists and is not {what}; refusing to "
                            "overwrite it: choose another path or remove it first")
    probe_folder(parent, option, path)
    return p


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_outputs(outputs: dict[str, tuple[str | Path | None, str, Callable[[Path], bool]]]
                  ) -> None:
    """The checks of one command with several outputs, before any work: no two options name
    the same file (one would overwrite the other, or fail after the first was written), then
    ``check_output`` for each. `outputs`: option -> (path or None/'-' for none, what, earlier)."""
    given = [(o, str(p)) for o, (p, _, _) in outputs.items() if p and str(p) != "-"]
    for i, (opt_a, a) in enumerate(given):
        for opt_b, b in given[i + 1:]:
            if _same(a, b):
                raise AmspUserError(f"{opt_a} and {opt_b} name the same file {shown(a)}: give "
                                    "each output its own path")
    for option, path in given:
        _, what, earlier = outputs[option]
        check_output(path, option, what, earlier)


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
    tmp = None
    try:
        # a short name: the target's own may be near the system's limit on a name's length
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name[:64]}.", suffix=p.suffix[:16],
                                   dir=p.parent)
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
        _remove(tmp)
        raise AmspUserError(f"{option} {shown(path)}: cannot write it ({_why(e)}): choose "
                            "another path or free space there") from None
    except BaseException:
        _remove(tmp)
        raise
    return p


def _remove(tmp: str | None) -> None:
    if tmp is not None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def contains(*markers: str | bytes) -> Callable[[Path], bool]:
    """An `earlier` test: the file's first bytes contain every marker."""
    want = [m.encode() if isinstance(m, str) else m for m in markers]
    return lambda path: all(m in _head(path) for m in want)
