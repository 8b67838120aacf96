"""ClusterSpec: GPUs, nodes, the intra-node fabric, NICs and the leaf/spine network.

Units follow DESIGN.md section 0: NIC speed in Gbit/s per NIC, NVLink/PCIe bandwidth in GB/s per
GPU and direction, memory in GiB, latency in microseconds. ``bus_efficiency`` turns a spec
bandwidth into the bus bandwidth that nccl-tests measure (about 0.8). Measured tables, when
present, override the alpha-beta model for the (op, scope) they cover.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 1024**3

CollectiveOp = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


class GpuSpec(BaseModel):
    """One accelerator type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100)
    memory_gib: float = Field(gt=0, le=4096)
    """Device memory in GiB."""
    peak_bf16_tflop_per_s: float = Field(gt=0, le=100000)
    """Dense 16-bit tensor-core peak, TFLOP/s (V100: its fp16 peak)."""
    achievable_fraction: float = Field(default=0.55, gt=0, le=1)
    """Fraction of peak that training matmuls reach (model FLOPs per second / peak)."""
    context_reserve_gib: float = Field(default=1.0, ge=0, le=64)
    """Memory taken by the CUDA context, NCCL and the allocator's own state."""
    fragmentation_fraction: float = Field(default=0.05, ge=0, le=0.5)
    """Allocator fragmentation, as a fraction of the tensors' bytes."""
    quant_gbyte_per_s: float = Field(default=500.0, gt=0, le=100000)
    """Throughput of the (de)quantization kernels of qwZ/qgZ, GB/s of 16-bit input."""
    optimizer_gbyte_per_s: float = Field(default=1400.0, gt=0, le=100000)
    """Memory traffic the AdamW step moves per second, GB/s: per element of the rank's
    optimizer shard it reads and writes the fp32 master and both moments, reads the gradient
    and writes the new 16-bit parameter (``cost.step_time.optimizer_bytes_per_element``).
    Presets: about 70% of the HBM bandwidth; ``amsp calibrate`` measures the runtime's own."""


class MeasuredPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    size_bytes: int = Field(ge=1)
    """Full tensor size of one call (the gathered / reduced tensor)."""
    busbw_gbyte_per_s: float = Field(gt=0)
    """Measured bus bandwidth at that size (nccl-tests convention)."""


class MeasuredTable(BaseModel):
    """Measured bus bandwidth of one collective at one scope, by message size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: CollectiveOp
    scope: Literal["intra", "inter"]
    """'intra': a group inside one node; 'inter': a group spanning nodes."""
    points: list[MeasuredPoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _sorted(self) -> MeasuredTable:
        sizes = [p.size_bytes for p in self.points]
        if sizes != sorted(set(sizes)):
            raise ValueError("points must have strictly increasing size_bytes: sort them")
        return self


class ClusterSpec(BaseModel):
    """A GPU cluster: identical nodes on a two-level leaf/spine network."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=200)
    gpu: GpuSpec
    gpus_per_node: int = Field(ge=1, le=1024)
    """R: GPUs in one node."""
    intra_fabric: Literal["nvswitch", "nvlink", "pcie", "shm"] = "nvswitch"
    """In-node interconnect (shm: processes on one host, for the CPU runtime)."""
    intra_gbyte_per_s: float = Field(gt=0, le=100000)
    """In-node bandwidth per GPU, one direction, GB/s (NVLink 3: 300, NVLink 4: 450)."""
    intra_latency_us: float = Field(default=3.0, ge=0, le=100000)
    """Latency of one in-node hop."""
    nics_per_node: int = Field(ge=1, le=64)
    nic_gbit_per_s: float = Field(gt=0, le=100000)
    """Speed of one NIC port, Gbit/s (HDR 200, NDR 400)."""
    inter_latency_us: float = Field(default=6.0, ge=0, le=100000)
    """Latency of one inter-node hop."""
    nodes_per_leaf: int = Field(default=16, ge=1, le=100000)
    """Nodes under one leaf switch; a group spanning leaves crosses the spine."""
    oversubscription: float = Field(default=1.0, ge=1, le=64)
    """Leaf downlink : uplink bandwidth ratio (1 = non-blocking fat tree)."""
    bus_efficiency: float = Field(default=0.8, gt=0, le=1)
    """Measured bus bandwidth as a fraction of spec (nccl-tests reach about 0.8)."""
    overlap_efficiency: float = Field(default=1.0, ge=0, le=1)
    """Fraction of compute time that can hide communication: 1 when collectives run on their own
    engines (GPUs with NCCL), 0 when they compete for the same cores (CPU processes)."""
    measured: list[MeasuredTable] = Field(default_factory=list)
    """Measured bandwidth tables (from `amsp calibrate`) that override the alpha-beta model."""

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        seen = set()
        for t in self.measured:
            if (t.op, t.scope) in seen:
                raise ValueError(
                    f"measured has two tables for ({t.op}, {t.scope}): keep one per op and scope"
                )
            seen.add((t.op, t.scope))
        return self

    # ----- derived figures --------------------------------------------------------------------
    @property
    def memory_bytes(self) -> float:
        return self.gpu.memory_gib * GIB

    @property
    def intra_bytes_per_s(self) -> float:
        """In-node bus bandwidth per GPU, bytes/s (spec x bus_efficiency)."""
        return self.intra_gbyte_per_s * 1e9 * self.bus_efficiency

    @property
    def node_nic_bytes_per_s(self) -> float:
        """All NICs of a node together, bytes/s (spec x bus_efficiency)."""
        return self.nics_per_node * self.nic_gbit_per_s * 1e9 / 8 * self.bus_efficiency

    @property
    def peak_flop_per_s(self) -> float:
        return self.gpu.peak_bf16_tflop_per_s * 1e12

    @property
    def achievable_flop_per_s(self) -> float:
        return self.peak_flop_per_s * self.gpu.achievable_fraction

    def table(self, op: str, scope: str) -> MeasuredTable | None:
        for t in self.measured:
            if t.op == op and t.scope == scope:
                return t
        return None
