"""What a solve returns, whichever solver made it: the solution (``IlpSolution``: strategy,
objective in seconds, memory in GiB, the decision that identifies it), the solver's statistics
(``IlpStats``, recorded in the plan's ``solver`` section) and the error of a solve that did not
prove optimality (``SolverError``)."""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.strategy import Strategy


class SolverError(RuntimeError):
    """The solver did not prove optimality (time limit, numerical trouble)."""


@dataclass
class IlpSolution:
    strategy: Strategy
    objective: float
    memory_gib: float
    status: str
    decision: tuple = ()
    """The decision binaries at 1 in this solution (for the runners-up's no-good cuts)."""
    groups: int = 0
    """Process groups of the decoded strategy."""


@dataclass
class IlpStats:
    solver: str
    status: str = ""
    solve_time_s: float = 0.0
    build_time_s: float = 0.0
    num_variables: int = 0
    num_constraints: int = 0
    solves: int = 0


def merged_stats(stats: list[IlpStats], owner: IlpStats | None = None) -> IlpStats:
    """Several models' statistics summed; the status is that of `owner` (the model chosen
    from; default the first)."""
    if len(stats) == 1:
        return stats[0]
    return IlpStats(solver=stats[0].solver, status=(owner or stats[0]).status,
                    solve_time_s=sum(x.solve_time_s for x in stats),
                    build_time_s=sum(x.build_time_s for x in stats),
                    num_variables=sum(x.num_variables for x in stats),
                    num_constraints=sum(x.num_constraints for x in stats),
                    solves=sum(x.solves for x in stats))
