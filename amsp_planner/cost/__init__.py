"""The cost model: pure functions of (job, strategy). No I/O.

- ``job``: the inputs bundled, with the padded units (docs/design.md, the reference schedule);
- ``schedule``: every collective of a step, with its bytes;
- ``memory``: bytes per GPU by term;
- ``step_time``: compute, collective times and the overlap model;
- ``evaluate``: all of it for one strategy.
"""

from amsp_planner.cost.evaluate import Evaluation, evaluate
from amsp_planner.cost.job import Job

__all__ = ["Evaluation", "Job", "evaluate"]
