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


def main(argv: list[str] | None = None) -> None:
    from amsp_planner.runtime import lifecycle

    lifecycle.follow_parent(signal.SIGTERM, lifecycle.LAUNCHER_PID_ENV)
    os.environ[lifecycle.AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed import run

    run.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
