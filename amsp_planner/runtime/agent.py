"""The torchrun agent ``amsp train`` starts: torchrun itself, which dies with its launcher.

    python -m amsp_planner.runtime.agent [torchrun arguments]

Sets the parent-death signal (SIGTERM: torchrun's agent then ends its ranks as on any
SIGTERM) before running torchrun in this process, and names itself to its ranks
(``lifecycle.AGENT_PID_ENV``), which die with it in turn (``lifecycle.py``).
"""

from __future__ import annotations

import os
import signal
import sys

QUIET_ENV = "AMSP_AGENT_QUIET"
"""Set: torchrun's own warnings are not logged (its stderr is a terminal, not a log file)."""


def main(argv: list[str] | None = None) -> None:
    from amsp_planner.runtime import lifecycle

    lifecycle.follow_parent(signal.SIGTERM, lifecycle.LAUNCHER_PID_ENV)
    os.environ[lifecycle.AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if os.environ.get(QUIET_ENV):  # its warnings on a user's terminal (amsp calibrate)
        import logging

        for name in [n for n in logging.root.manager.loggerDict if n.startswith(
                "torch.distributed.elastic")] + ["torch.distributed.elastic"]:
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        run.main(sys.argv[1:] if argv is None else argv)
    except SignalException as e:  # torchrun ended its ranks first: one line, not its trace
        from amsp_planner.runtime.faults import RUN_DIR_ENV

        if os.environ.get(RUN_DIR_ENV):  # amsp train's log, which faults.summary reads
            print(f"SignalException: Process {os.getpid()} got signal: {int(e.sigval)}",
                  file=sys.stderr, flush=True)
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
