"""Failures of a training job, each told in one line with its cause.

    amsp train plan.json ...      # error: rank 3, step 12: out of memory in the forward of unit 7 ...

The side channel: the launcher owns a run folder (``AMSP_RUN_DIR``); every rank writes its
first exception there (``rank<R>.json``: type, message, rank, step, what the rank was doing,
and for known classes a named cause) before it dies. The launcher then prints one line for the
root cause, naming the rank, and the path of the full log it keeps in the same folder. Peer
losses (gloo's "Connection closed by peer" when another rank died) are secondary: they only
speak when no rank left a primary cause, and then a rank that left no record at all is named
as the one that died.

Exit codes (fixed; under srun they are the ranks' own codes, under an external torchrun
``runtime/torchrun.py`` ends with them):
0 success, 2 refused input, 3 does not fit, 4 a rank failed, 5 the collectives differ from the
plan; 130, 143, 129 when SIGINT, SIGTERM or SIGHUP stopped the job (``lifecycle.py``).
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

from amsp_planner.report.fmt import bytes_h

EXIT_REFUSED = 2
"""Refused input: one line naming the field and the fix."""
EXIT_INFEASIBLE = 3
"""The job does not fit in memory (planner)."""
EXIT_RANK_FAILED = 4
"""A rank failed while running (out of memory, disk full, a killed process, a non-finite
loss...): the line names the rank, the step and the cause."""
EXIT_DIFFERS = 5
"""Every step ran, but the measured collectives differ from the plan's schedule."""
RUN_DIR_ENV = "AMSP_RUN_DIR"
LOG_NAME = "log.txt"

# what this rank is doing, for the record of its first exception
_NOW = {"step": None, "doing": "starting"}


def at(step: int | None = None, doing: str | None = None) -> None:
    """Note this rank's step (1-based) and activity, named if it fails now. A new step is
    also noted in the run folder (``rank<R>.step``), so a rank killed without a word is
    named with its step."""
    if doing is not None:
        _NOW["doing"] = doing
    if step is not None:
        _NOW["step"] = step
        run = os.environ.get(RUN_DIR_ENV)
        if run:
            try:
                Path(run, f"rank{os.environ.get('RANK', '0')}.step").write_text(str(step))
            except OSError:
                pass


class RunFault(Exception):
    """A failure with a known cause, raised by the runtime itself (non-finite loss, a
    checkpoint that cannot be written): its message is the cause."""


class JobFault(RunFault):
    """A fault every rank meets alike (a non-finite loss or gradient norm, known to all from
    the world all-reduce): under an external launch rank 0 alone prints its line."""


_ALLOC = re.compile(r"tried to allocate (\d+(?:\.\d+)?) ?(bytes|[KMGT]i?B)", re.I)
_UNITS = {"bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40}
_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe",
         "connection refused", "socket timeout", "timed out", "nccl communicator was aborted")


def _wrapped(exc: BaseException) -> BaseException | None:
    """The first rank's exception inside torch.distributed.checkpoint's CheckpointException
    (``failures``: rank -> the exception, or (exception, traceback)), so a read-only folder
    is named as such, not as 'CheckpointException ranks: [0, 1, 2, 3]'."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    first = failures[min(failures)]
    first = first[0] if isinstance(first, tuple) and first else first
    return first if isinstance(first, BaseException) else None


def cause(exc: BaseException) -> tuple[str, bool]:
    """(the cause in words, whether it is primary). Peer losses are not primary."""
    inner = _wrapped(exc)
    if inner is not None:  # DCP's CheckpointException: every rank's own failure inside
        return cause(inner)
    text = str(exc).strip()
    msg = text.splitlines()[0] if text else type(exc).__name__
    doing = _NOW["doing"]
    if isinstance(exc, RunFault):
        return str(exc), True
    if isinstance(exc, OSError) and exc.errno is not None:
        where = f" ({exc.filename})" if exc.filename else ""
        what = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system",
                errno.EACCES: "permission denied", errno.EDQUOT: "disk quota exceeded",
                errno.ENOMEM: "out of memory"}.get(exc.errno, exc.strerror or msg)
        return f"{what} while {doing}{where}", True
    low = text.lower()
    if isinstance(exc, MemoryError) or "can't allocate memory" in low or "out of memory" in low:
        m = _ALLOC.search(text)
        need = ""
        if m:
            need = f" (an allocation of {bytes_h(float(m[1]) * _UNITS[m[2].lower()])} failed)"
        return f"out of memory while {doing}{need}", True
    if "no space left on device" in low or "errno 28" in low:
        return f"no space left on device while {doing}", True
    if any(p in low for p in _PEER):
        return f"lost a peer while {doing} ({msg[:160]})", False
    return f"{type(exc).__name__} while {doing}: {msg[:300]}", True


def record(exc: BaseException, rank: int) -> None:
    """Write this rank's first exception to the run folder (no-op outside a launcher)."""
    run = os.environ.get(RUN_DIR_ENV)
    if not run:
        return
    path = Path(run) / f"rank{rank}.json"
    if path.exists():
        return
    text, primary = cause(exc)
    doc = {"rank": rank, "step": _NOW["step"], "type": type(exc).__name__,
           "message": str(exc)[:2000], "doing": _NOW["doing"], "cause": text,
           "primary": primary}
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError:
        pass


def line(exc: BaseException, rank: int) -> str:
    """The one line a rank prints itself (under an external torchrun or srun)."""
    text, _ = cause(exc)
    step = _NOW["step"]
    return f"rank {rank}{f', step {step}' if step else ''}: {text}"


# ----- the launcher's side --------------------------------------------------------------------
def records(run_dir: str | Path) -> list[dict]:
    out = []
    for p in sorted(Path(run_dir).glob("rank*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda d: d["rank"])


_ROOT = re.compile(r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", re.M)
"""A rank's entry in torchrun's failure report (``rank : 1 (local_rank: 1)``, ``exitcode : 9``)."""


def summary(run_dir: str | Path, world: int, log_text: str, code: int) -> str:
    """The one line naming the root cause of a failed job, from the ranks' records, else from
    torchrun's report in the log (a rank that died without a word)."""
    recs = records(run_dir)
    primary = [r for r in recs if r.get("primary")]
    if primary:
        r = min(primary, key=lambda d: (d["step"] or 0, d["rank"]))
        return _fmt(r["rank"], r["step"], r["cause"])
    silent = sorted(set(range(world)) - {r["rank"] for r in recs})
    codes = {int(a): int(b) for a, b in _ROOT.findall(log_text)}
    dead = [k for k in silent if codes.get(k, 0)] or silent
    # torchrun's agent ends the survivors of a failure with SIGTERM: a rank that died otherwise
    # is the cause, however late the survivors' own reports came (a loaded host)
    dead.sort(key=lambda k: (codes.get(k) == -15, k))
    if dead and (recs or codes):
        rank = dead[0]
        rc = codes.get(rank)
        how = ("died" if rc is None else f"was killed by signal {-rc}" if rc < 0
               else f"exited with code {rc}")
        waited = any(w in r.get("cause", "").lower() for r in recs if not r.get("primary")
                     for w in ("timed out", "timeout"))
        if rc == -9 and waited:  # hung: its peers' process-group timeout, then torchrun's kill
            return _fmt(rank, _step_of(run_dir, rank), "the process stopped responding: the "
                        "other ranks timed out waiting for it (--timeout), then it was killed")
        return _fmt(rank, _step_of(run_dir, rank), f"the process {how} without an error")
    if recs:
        r = recs[0]
        return _fmt(r["rank"], r["step"], r["cause"])
    steps = [k for k in (_step_of(run_dir, r) for r in range(world)) if k]
    when = f"after step {max(steps)}" if steps else "before any rank reported"
    m = _AGENT_SIGNAL.search(log_text)
    if m:  # torchrun's SignalException: the agent itself was stopped, its ranks with it
        name = _signal_name(int(m[1]))
        return f"the torchrun agent was stopped by signal {m[1]}{name} {when}, its ranks with it"
    return f"the training job failed (exit code {code}) {when}"


_AGENT_SIGNAL = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
"""torchrun's agent, stopped by a signal (torch.distributed.elastic's SignalException)."""


def _signal_name(signum: int) -> str:
    import signal

    try:
        return f" ({signal.Signals(signum).name})"
    except ValueError:
        return ""


def _step_of(run_dir, rank: int) -> int | None:
    try:
        return int(Path(run_dir, f"rank{rank}.step").read_text())
    except (OSError, ValueError):
        return None


def _fmt(rank: int, step: int | None, text: str) -> str:
    return f"rank {rank}{f', step {step}' if step else ''}: {text}"
