"""The training job's life cycle: every process of a job ends with the job.

    amsp train plan.json ...   # Ctrl-C: exit 130; SIGTERM: exit 143; every agent and rank ended

The launcher (``launch.py``) catches SIGINT, SIGTERM and SIGHUP for the whole run and stops
every torchrun agent it started (SIGTERM to the agent, which ends its ranks; SIGKILL to the
agent's session and its ranks after ``STOP_GRACE_S``), so no rank keeps training or writing
checkpoints after the launcher is gone. The processes below it stop by themselves when their
parent dies, by Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``, through ctypes):

- an agent (``runtime/agent.py``) gets SIGTERM when the launcher dies (even by SIGKILL), and
  ends its ranks as on any SIGTERM;
- a rank gets SIGKILL when its agent dies (even by SIGKILL).

A process whose parent died before it set the signal sees that its parent is not the one
named in its environment (``LAUNCHER_PID_ENV``, ``AGENT_PID_ENV``) and leaves at once.

``--save-on-sigterm`` (preemptible clusters): a SIGTERM asks the job to save a checkpoint at
the end of the step it is running and then stop. Under ``amsp train`` the launcher writes the
run folder's ``stop`` file instead of signalling the agents; under an external launch
(``srun``, torchrun) the ranks' own SIGTERM handler notes it. Every rank asks at each step's
end whether any rank was asked (one all-reduce of one element, uncounted, only with the
option), so all of them save the same step and stop together (``Stopped``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

LAUNCHER_PID_ENV = "AMSP_LAUNCHER_PID"
"""The ``amsp train`` process, as its agents see it."""
AGENT_PID_ENV = "AMSP_AGENT_PID"
"""The torchrun agent, as its ranks see it."""
STOP_NAME = "stop"
"""The run folder's file that asks the ranks to save and stop (``--save-on-sigterm``)."""
ABORT_NAME = "abort"
"""In the run folder: the launcher stops the job without a save (``abort_stop``)."""
STOP_GRACE_S = 5.0
"""How long a stopped agent has to end its ranks before its session is killed."""
EXIT_SIGNALLED = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
"""A job stopped by a signal exits 128 + the signal's number, as a shell reports it."""
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False where the call is
    not available (another OS, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def follow_parent(sig: int, env_name: str) -> None:
    """Die with the parent: the parent-death signal, and leave at once when the parent named
    by `env_name` is gone already (it died before the signal was set)."""
    set_parent_death_signal(sig)
    want = os.environ.get(env_name)
    if want and want.isdigit() and os.getppid() != int(want):
        os._exit(128 + int(sig))


def orphaned() -> bool:
    """True when this rank's agent is gone (it is being stopped and must not remove
    checkpoints)."""
    want = os.environ.get(AGENT_PID_ENV)
    return bool(want and want.isdigit() and os.getppid() != int(want))


# ----- --save-on-sigterm: the ranks' side ------------------------------------------------------
_ASKED = {"signal": False}


class Stopped(Exception):
    """The job saved checkpoint ``step`` and stops, as a SIGTERM asked (--save-on-sigterm)."""

    def __init__(self, step: int, path: str):
        super().__init__(f"stopped by SIGTERM after saving checkpoint {path}")
        self.step, self.path = step, path


def catch_sigterm() -> None:
    """A SIGTERM to this rank asks for a save and a stop instead of ending it at once, unless
    the launcher stops the job without a save (``abort_stop``): then it ends the rank at once,
    as without --save-on-sigterm."""
    def note(signum, frame):  # noqa: ARG001
        from amsp_planner.runtime.faults import RUN_DIR_ENV

        run = os.environ.get(RUN_DIR_ENV)
        if run and Path(run, ABORT_NAME).exists():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _ASKED["signal"] = True

    signal.signal(signal.SIGTERM, note)


def stop_asked() -> bool:
    """Whether this rank was asked to save and stop (its own SIGTERM, or the launcher's
    ``stop`` file)."""
    if _ASKED["signal"]:
        return True
    from amsp_planner.runtime.faults import RUN_DIR_ENV

    run = os.environ.get(RUN_DIR_ENV)
    return bool(run) and Path(run, STOP_NAME).exists()


def ask_stop(run_dir: str | os.PathLike) -> None:
    """The launcher's side: ask every rank to save and stop."""
    Path(run_dir, STOP_NAME).write_text("SIGTERM\n")


def abort_stop(run_dir: str | os.PathLike) -> None:
    """The launcher's side: the SIGTERM the ranks get next ends them at once, no save (Ctrl-C,
    SIGHUP, a second signal, or the save's time is up, under --save-on-sigterm)."""
    Path(run_dir, ABORT_NAME).write_text("stop now\n")


# ----- the launcher's side -----------------------------------------------------------------------
class Signals:
    """Catch SIGINT, SIGTERM and SIGHUP for the life of a job (restored after): each is noted
    in ``received``, in order, for the launcher's loop to act on."""

    CAUGHT = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []
        self._old: dict[int, object] = {}

    def __enter__(self) -> Signals:
        for s in self.CAUGHT:
            self._old[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _note(self, signum, frame) -> None:  # noqa: ARG002
        self.received.append(signum)


def children(pid: int) -> list[int]:
    """The live children of `pid`, from /proc (empty where there is none)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            out += [int(x) for x in text.split()]
    except OSError:
        pass
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process, its session (process group) and every descendant."""
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo += children(p)
    for p in seen:
        for kill in (lambda q: os.killpg(q, signal.SIGKILL), lambda q: os.kill(q, signal.SIGKILL)):
            try:
                kill(p)
            except (ProcessLookupError, PermissionError):
                pass


class Signalled(BaseException):
    """A stop signal turned into an exception by ``raising`` (not an Exception: no handler of
    a failure catches it); ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def line_name(self) -> str:
        """``SIGTERM``, or ``SIGINT (Ctrl-C)``: how a stop line names it."""
        name = signal.Signals(self.signum).name
        return name + (" (Ctrl-C)" if self.signum == signal.SIGINT else "")


class raising(Signals):  # noqa: N801 - used as a context manager, like contextlib's
    """Within the block, each of `signals` raises ``Signalled`` (handlers restored after): a
    command that runs worker processes stops them in its own cleanup, then prints one line."""

    def __init__(self, *signals: int):
        super().__init__()
        self.CAUGHT = signals

    def _note(self, signum, frame) -> None:  # noqa: ARG002
        raise Signalled(signum)
