"""What every schedule entry is: ``ScheduleEntry`` (one collective kind of a step, its calls,
bytes and seconds), the unit classes its per-class tuples run over, the size of a quantized
buffer and the NCCL algorithm named for a call. ``cost/schedule.py`` (the data-parallel
entries) and ``cost/tp_schedule.py`` (the tensor-parallel ones) build on it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amsp_planner.cost.job import Job

CLASSES = ("embedding", "block", "head")
"""The unit classes: the embedding, every transformer block (all the same size), the head."""


@dataclass(frozen=True)
class ScheduleEntry:
    phase: str
    op: str
    group: str
    group_size: int
    stride: int
    members_per_node: int
    dtype: str
    calls_per_step: int
    full_bytes_per_step: int
    intra_bytes_per_rank_per_step: float
    inter_bytes_per_rank_per_step: float
    time_s: float
    """Predicted seconds per step for these collectives, before overlap."""
    kernel_s: float = 0.0
    """Seconds per step of the (de)quantization kernels these collectives need; they run on the
    compute stream (cost/step_time.py)."""
    unit_time_s: tuple[float, ...] = field(default=(0.0, 0.0, 0.0), compare=False)
    """Seconds of one call for a unit of each class (``CLASSES``): the step model's input."""
    unit_kernel_s: tuple[float, ...] = field(default=(0.0, 0.0, 0.0), compare=False)
    """Kernel seconds of one call for a unit of each class."""
    algorithm: str = ""
    """What NCCL runs for a block's call (e.g. 'ring/LL128'); empty off NCCL."""
    unit_demand_s: tuple[float, ...] = field(default=(0.0, 0.0, 0.0), compare=False)
    """Of ``unit_kernel_s``, the seconds of the gathers the engine fetches on demand (collective
    time on the compute stream: ``cost/schedule.py`` ``on_demand``); counted in ``time_s``."""

    @property
    def bytes_per_rank_per_step(self) -> float:
        return self.intra_bytes_per_rank_per_step + self.inter_bytes_per_rank_per_step

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["unit_time_s"], d["unit_kernel_s"], d["unit_demand_s"]
        return d


def quantized_bytes(elements: int, bits: int, block: int) -> int:
    """Bytes of one quantized buffer: packed values + one fp32 scale per block."""
    assert elements % block == 0 and (elements * bits) % 8 == 0
    return elements * bits // 8 + 4 * (elements // block)


def algorithm_name(job: Job, op: str, size: int, stride: int, per_call: float) -> str:
    """'algorithm/protocol' NCCL runs for one call; empty off NCCL or with measured tables."""
    if size <= 1 or job.cluster.collective_library != "nccl" or job.cluster.measured:
        return ""
    ch = job.topology.algorithm(op, size, stride, per_call)
    return f"{ch.algorithm}/{ch.protocol}"
