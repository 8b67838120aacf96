"""What a calibration is asked for and where it runs: the collectives measured (``OPS``), the
options of a run (``CalibrationConfig``: sizes, dtype, time budgets, passes, model, backend,
timeouts) and this rank's place in the world (``World``).

The lowest of the calibration modules: ``calibrate_comm.py`` and ``calibrate_compute.py``
measure under a config, ``calibrate.py`` runs them all and writes the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass
class CalibrationConfig:
    min_bytes: int = 4096
    """Smallest full tensor of one call; sizes go up by 4x (rounded down to the group)."""
    max_bytes: int | None = None
    """Largest (None: 256 MiB on GPU, 4 MiB on CPU)."""
    ops: tuple[str, ...] = OPS
    dtype: str = "bf16"
    """Element type of the measured tensors (bf16 or fp32)."""
    seconds_per_point: float = 0.25
    """Time budget of the timed calls of one (op, scope, size) point, per pass."""
    passes: int = 3
    """Passes over the whole grid (and the matmul, quantizer and model timings); each point
    keeps the median over passes, so a slow spell of the machine, which hits a run of
    consecutive points within one pass, moves no point."""
    min_iters: int = 2
    max_iters: int = 50
    matmul_size: int | None = None
    """Side of the square matmul (None: 4096 on GPU, 512 on CPU)."""
    matmul_seconds: float = 1.0
    model: str | None = None
    """Also time the bundled runtime's forward + backward of this model (preset or file) on
    every rank at once; its model FLOP/s over the matmul rate becomes ``achievable_fraction``."""
    seq_len: int = 512
    micro_batch: int = 1
    fp8_sizes: tuple[int, ...] = ()
    """GPUs: also measure FP8 linear speed-ups (tensorwise, rowwise) at M, K, N in these sizes
    (calibrate_fp8.py); empty: not measured."""
    backend: str = "auto"
    """'auto' (nccl on CUDA, else gloo), 'gloo' or 'nccl'."""
    timeout_s: float = 60.0
    """Process-group timeout: how long ranks wait for a lost rank before failing."""
    fail_rank: int | None = None
    """Testing aid: this rank dies hard after the first point (a lost rank)."""
    progress: Callable[[str], None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_size: int
    node: int

    @property
    def nodes(self) -> int:
        return self.size // self.local_size
