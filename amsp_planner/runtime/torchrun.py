"""torchrun that ends with the job's exit code.

    python -m amsp_planner.runtime.torchrun --nproc-per-node=4 \
        -m amsp_planner.runtime.launch plan.json --steps 20

Takes torchrun's arguments unchanged and runs its agent in this process. torchrun itself
(torch 2.13, ``torch/distributed/launcher/api.py``) raises ``ChildFailedError`` when any worker
fails and so ends with exit status 1 whatever the workers' own codes; its failure records keep
each worker's code. This entry ends with the job's code from them instead:

- 2 when a rank refused its input (every rank refuses alike; rank 0 printed the line);
- 4 when a rank failed (it printed its own line), or died without a word: then this prints
  ``error: rank R: the process exited with code C without an error`` (or was killed by
  signal S);
- 3 or 5 when that is the ranks' code (every rank ran, the verdict differs: 5).

Workers the agent stopped itself once another had failed (SIGTERM) are not a cause. When the
agent itself is stopped (a signal to torchrun), torchrun's own exit stands.
"""

from __future__ import annotations

import signal
import sys

from amsp_planner.runtime import faults

_OURS = (faults.EXIT_REFUSED, faults.EXIT_INFEASIBLE, faults.EXIT_RANK_FAILED,
         faults.EXIT_DIFFERS)


def job_exit(codes: dict[int, int]) -> tuple[int, str | None]:
    """(the job's exit code, the line to print or None) from each failed rank's exit code
    (global rank -> code; a negative code is the signal that killed it)."""
    if faults.EXIT_REFUSED in codes.values():
        return faults.EXIT_REFUSED, None
    silent = {r: c for r, c in codes.items() if c not in _OURS and c != -signal.SIGTERM}
    if silent:
        rank = min(silent)
        c = silent[rank]
        how = f"was killed by signal {-c}" if c < 0 else f"exited with code {c}"
        return faults.EXIT_RANK_FAILED, f"rank {rank}: the process {how} without an error"
    for code in (faults.EXIT_RANK_FAILED, faults.EXIT_INFEASIBLE, faults.EXIT_DIFFERS):
        if code in codes.values():
            return code, None
    return faults.EXIT_RANK_FAILED, None  # every failed worker was stopped by the agent


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run.main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        code, line = job_exit({rank: f.exitcode for rank, f in e.failures.items()})
        if line:
            print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(code)
    sys.exit(0)


if __name__ == "__main__":
    main()
