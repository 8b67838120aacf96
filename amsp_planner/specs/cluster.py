"""ClusterSpec: GPUs, nodes, the intra-node fabric, NICs and the leaf/spine network.

Units follow DESIGN.md section 0: NIC speed in Gbit/s per NIC, NVLink/PCIe bandwidth in GB/s per
GPU and direction, memory in GiB, latency in microseconds. ``bus_efficiency`` turns a spec
bandwidth into the bus bandwidth that nccl-tests measure (about 0.8). Measured tables, when
present, override the alpha-beta model for the (op, scope) they cover.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from amsp_planner.specs.fields import Flag, Fraction, Int, Maybe, Rate, Real, Text

GIB = 1024**3

CollectiveOp = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


GpuArch = Literal["volta", "ampere", "hopper", "blackwell", "cpu"]


class Fp8LinearGrid(BaseModel):
    """Measured speed-up of one FP8 linear over bf16 on this GPU: forward + backward with the
    recipe's casts, as torchao runs them (``calibrate_fp8.py``), by forward shape (M tokens,
    K in and N out features); ``speedup[i * len(K) + j][l]`` is at (M[i], K[j], N[l]), the
    layout of presets/fp8_matmul.yaml's grids. Written by ``amsp calibrate --fp8``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: Literal["tensorwise", "rowwise"]
    M: tuple[Int(1, 2**31), ...] = Field(min_length=1)
    K: tuple[Int(1, 2**31), ...] = Field(min_length=1)
    N: tuple[Int(1, 2**31), ...] = Field(min_length=1)
    speedup: tuple[tuple[Real(1e-6, 1e3), ...], ...]
    measured: Text(300) = "amsp calibrate --fp8"
    """Where, on what and how it was measured."""

    @model_validator(mode="after")
    def _shape(self) -> Fp8LinearGrid:
        for axis in ("M", "K", "N"):
            v = getattr(self, axis)
            if list(v) != sorted(set(v)):
                raise ValueError(f"{axis} must be strictly increasing: sort it")
        if len(self.speedup) != len(self.M) * len(self.K) or any(
                len(row) != len(self.N) for row in self.speedup):
            raise ValueError(f"speedup must have len(M) x len(K) = {len(self.M) * len(self.K)} "
                             f"rows of len(N) = {len(self.N)} values")
        return self


class GpuSpec(BaseModel):
    """One accelerator type. Presets live in ``presets/gpus.yaml`` (each value with its source);
    a cluster spec names one (``gpu: A100-SXM4-80GB``) or gives the fields inline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Text(100)
    arch: GpuArch = "ampere"
    """Generation: selects NCCL's per-architecture tuning constants (cost/collectives.py)."""
    memory_gib: Real(1e-6, 4096)
    """Device memory in GiB."""
    peak_bf16_tflop_per_s: Rate
    """Dense 16-bit tensor-core peak, TFLOP/s (V100: its fp16 peak)."""
    peak_fp32_tflop_per_s: Maybe(Rate) = None
    """fp32 matmul peak, TFLOP/s (PyTorch's default: no TF32 for matmuls); None: the bf16 peak
    (CPU processes, where both are the same cores)."""
    hbm_gbyte_per_s: Maybe(Rate) = None
    """Memory bandwidth the memory-bound (elementwise) kernels reach, GB/s; None: those kernels
    are not priced apart (CPU processes: ``achievable_fraction`` covers them)."""
    achievable_fraction: Fraction = 0.55
    """Fraction of peak that large training matmuls reach (cost/compute.py)."""
    attention_fraction: Maybe(Fraction) = None
    """Fraction of peak that the flash-attention kernels reach; None: ``achievable_fraction``."""
    kernel_overhead_us: Real(0, 1e5) = 0.0
    """Fixed time per matmul kernel (launch and tail), microseconds: small matmuls run below
    the large-matrix efficiency."""
    comm_compute_slowdown: Real(0, 1) = 0.0
    """Seconds added to compute per second of communication that overlaps it (collective
    kernels share the SMs and HBM with the matmuls)."""
    context_reserve_gib: Real(0, 64) = 1.0
    """Memory taken by the CUDA context, NCCL and the allocator's own state."""
    fragmentation_fraction: Real(0, 0.5) = 0.05
    """Allocator fragmentation, as a fraction of the tensors' bytes."""
    quant_gbyte_per_s: Rate = 500.0
    """Throughput of the (de)quantization kernels of qwZ/qgZ, GB/s of 16-bit input."""
    optimizer_gbyte_per_s: Rate = 1400.0
    """Memory traffic the AdamW step moves per second, GB/s: per element of the rank's
    optimizer shard it reads and writes the fp32 master and both moments, reads the gradient
    and writes the new 16-bit parameter (``cost.step_time.optimizer_bytes_per_element``).
    Presets: about 70% of the HBM bandwidth; ``amsp calibrate`` measures the runtime's own."""
    fp8_linear: tuple[Fp8LinearGrid, ...] = ()
    """Measured FP8 linear speed-ups (``amsp calibrate --fp8``), one grid per recipe; FP8 jobs
    of torchao engines on this GPU use them before the published grids (cost/fp8.py)."""

    @model_validator(mode="after")
    def _one_grid_per_recipe(self) -> GpuSpec:
        recipes = [g.recipe for g in self.fp8_linear]
        if len(recipes) != len(set(recipes)):
            raise ValueError("fp8_linear: one grid per recipe: drop the repeated one")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        if not out.get("fp8_linear", 1):  # GPUs without a measured FP8 grid dump as before
            del out["fp8_linear"]
        return out

    def peak_flop_per_s(self, dtype: str = "bf16") -> float:
        if dtype == "fp32" and self.peak_fp32_tflop_per_s is not None:
            return self.peak_fp32_tflop_per_s * 1e12
        return self.peak_bf16_tflop_per_s * 1e12


def gpu_presets() -> dict[str, dict]:
    """The GPU table (``presets/gpus.yaml``): name -> fields."""
    return dict(_gpu_table())


@lru_cache(maxsize=1)
def _gpu_table() -> tuple:
    import yaml

    path = Path(__file__).resolve().parent.parent / "presets" / "gpus.yaml"
    rows = yaml.safe_load(path.read_text())
    return tuple((r["name"], r) for r in rows)


def resolve_gpu(data: dict) -> dict:
    """A cluster spec's mapping with ``gpu: NAME`` replaced by that GPU's preset fields."""
    gpu = data.get("gpu")
    if isinstance(gpu, str):
        table = gpu_presets()
        if gpu not in table:
            from amsp_planner.errors import shown
            from amsp_planner.specs.fields import suggest

            near = suggest(gpu, list(table))
            hint = f"did you mean {near}? " if near else ""
            raise ValueError(f"gpu '{shown(gpu)}' is not in the GPU table: {hint}use one of "
                             f"{', '.join(sorted(table))} or give the fields inline")
        data = {**data, "gpu": dict(table[gpu])}
    return data


class MeasuredPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    size_bytes: Int(1, 2**50)
    """Full tensor size of one call (the gathered / reduced tensor)."""
    busbw_gbyte_per_s: Rate
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

    name: Text(200)
    gpu: GpuSpec
    gpus_per_node: Int(1, 1024)
    """R: GPUs in one node."""
    intra_fabric: Literal["nvswitch", "nvlink", "pcie", "shm"] = "nvswitch"
    """In-node interconnect (shm: processes on one host, for the CPU runtime)."""
    intra_gbyte_per_s: Rate
    """In-node bandwidth per GPU, one direction, GB/s (NVLink 3: 300, NVLink 4: 450)."""
    intra_latency_us: Real(0, 1e5) = 3.0
    """Latency of one in-node hop."""
    nics_per_node: Int(1, 64)
    nic_gbit_per_s: Rate
    """Speed of one NIC port, Gbit/s (HDR 200, NDR 400)."""
    inter_latency_us: Real(0, 1e5) = 6.0
    """Latency of one inter-node hop."""
    nodes_per_leaf: Int(1, 100000) = 16
    """Nodes under one leaf switch; a group spanning leaves crosses the spine."""
    oversubscription: Real(1, 64) = 1.0
    """Leaf downlink : uplink bandwidth ratio (1 = non-blocking fat tree)."""
    bus_efficiency: Fraction = 0.8
    """Measured in-node bus bandwidth as a fraction of spec (nccl-tests reach about 0.8); the
    NICs take ``nic_efficiency``."""
    network: Literal["infiniband", "roce", "efa", "ethernet"] = "infiniband"
    """The inter-node network: selects its protocol efficiency and its ring's loss per doubling
    of nodes (``collectives.NETWORKS``)."""
    nic_efficiency: Maybe(Fraction) = None
    """NIC bus bandwidth as a fraction of line rate; None: the network's figure
    (``collectives.NETWORKS``)."""
    overlap_efficiency: Real(0, 1) = 1.0
    """Fraction of compute time that can hide communication: 1 when collectives run on their own
    engines (GPUs with NCCL), 0 when they compete for the same cores (CPU processes)."""
    rank_jitter: Real(0, 1) = 0.0
    """Coefficient of variation of one rank's compute time per step: the step waits for the
    slowest rank, ``rank_jitter x compute x E[max of N standard normals]`` more
    (cost/straggler.py). 0 (the default): not priced; docs/cost-model.md, "Collectives at
    scale", says why."""
    collective_rank_us: Real(0, 1e3) = 0.0
    """Microseconds per rank of its group that each data-parallel collective call adds to the
    step, hidden by no compute (cost/straggler.py ``sync_seconds``). 0 (the default): not
    priced; docs/cost-model.md, "Collectives at scale", says why."""
    nvlink_sharp: Flag = False
    """NVLink SHARP (NVLS, Hopper NVSwitch): in-switch reductions inside the node."""
    ib_sharp: Flag = False
    """InfiniBand SHARP (NCCL CollNet): in-network all-reduce across nodes."""
    host_link_gbyte_per_s: Maybe(Rate) = None
    """Host link per GPU (PCIe), one direction, GB/s that pinned host<->device copies reach;
    None: not known (optimizer offload is refused on this cluster, naming the field)."""
    host_mem_gbyte_per_s: Maybe(Rate) = None
    """The node's host memory bandwidth (CPU data sheets: channels x transfer rate x 8 bytes,
    all sockets), GB/s, shared by the node's ranks' CPU optimizer steps (cost/offload.py);
    None: not known (optimizer offload is refused on this cluster, naming the field)."""
    measured: list[MeasuredTable] = Field(default_factory=list)
    """Measured bandwidth tables (from `amsp calibrate`) that override the alpha-beta model."""

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        for key in ("host_link_gbyte_per_s", "host_mem_gbyte_per_s"):
            if out.get(key, 0) is None:  # clusters without a host figure dump as before
                del out[key]
        for key in ("rank_jitter", "collective_rank_us"):
            if out.get(key, 1.0) == 0.0:  # clusters without them dump as before
                del out[key]
        return out

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
    def nic_fraction(self) -> float:
        """The fraction of NIC line rate a collective's ring reaches: ``nic_efficiency``, else
        the network's (collectives.NETWORKS: NCCL's figures); CPU processes (gloo on shared
        memory) keep ``bus_efficiency``."""
        if self.nic_efficiency is not None:
            return self.nic_efficiency
        if self.intra_fabric == "shm":
            return self.bus_efficiency
        from amsp_planner.collectives import NETWORKS

        return NETWORKS[self.network].efficiency

    @property
    def node_nic_bytes_per_s(self) -> float:
        """All NICs of a node together, bytes/s (line rate x ``nic_fraction``)."""
        return self.nics_per_node * self.nic_gbit_per_s * 1e9 / 8 * self.nic_fraction

    @property
    def peak_flop_per_s(self) -> float:
        """The 16-bit peak (the MFU denominator)."""
        return self.gpu.peak_bf16_tflop_per_s * 1e12

    @property
    def achievable_flop_per_s(self) -> float:
        return self.peak_flop_per_s * self.gpu.achievable_fraction

    @property
    def collective_library(self) -> str:
        """'gloo' for CPU processes on shared memory, else 'nccl'."""
        return "gloo" if self.intra_fabric == "shm" else "nccl"

    def table(self, op: str, scope: str) -> MeasuredTable | None:
        for t in self.measured:
            if t.op == op and t.scope == scope:
                return t
        return None
