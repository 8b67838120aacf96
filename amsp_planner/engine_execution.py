"""How an engine groups and overlaps its collectives: the ``Execution`` part of an engine
profile (``engines.py``), which the schedule and the step-time model read (grouping into
calls, bucket sizes, when the gradient sync and the update gather run, per-call host time),
and the difference between two engines' executions in words (``execution_differences``), which
``amsp explain --engine`` and ``amsp export`` print. Every value carries its source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Execution:
    """How an engine turns the schedule's collectives into calls, and when it runs them: data
    the step model reads (cost/schedule.py ``call_groups``, docs/cost-model.md "Engines as they
    execute"). Every value is the engine's default; ``sources`` says where each is written."""

    gather_grouping: str = "unit"
    """'unit': one all-gather per unit (a block, the embedding, the head); 'module': one fetch
    per parameter-holding module, the modules fetched together coalesced into calls of at most
    ``prefetch_bucket`` elements; tensors under ``persistence_threshold`` elements are kept
    whole and never gathered; 'parameter': one call per parameter-holding module, never
    coalesced, the calls of one prefetch batch (up to ``prefetch_bucket`` elements) serialised
    (``cost/schedule.py`` ``on_demand``)."""
    persistence_threshold: int = 0
    """Parameters with fewer elements stay whole on every rank (not gathered)."""
    prefetch_bucket: int | None = None
    """Elements gathered ahead in one call ('module' grouping); None: one unit."""
    max_live_params: int | None = None
    """'module' grouping: the engine prefetches the next module's parameters only while the
    parameters it holds stay under this many elements; a module gathered after one at least
    this large is fetched on demand (``cost/schedule.py`` ``on_demand``). None: no limit."""
    max_reuse_distance: int | None = None
    """'module' grouping: after a module runs, the engine frees its gathered parameters unless
    they are used again within this many elements of the module trace. With checkpointing, a
    recomputed module whose own backward comes later than that is gathered a third time in
    the step (``cost/module_fetch.py`` ``regather_fraction``). None: each unit's parameters
    are gathered once for forward and once for backward (its recomputation included)."""
    prefetch_depth: int = 1
    """Units gathered ahead of the one computing (the step model prices one)."""
    reduce_bucket: int | None = None
    """Elements per gradient-reduction call; None: one call per unit. A bucket larger than a
    unit reduces several units' gradients at once: each unit is charged its share of the call."""
    reduce_bucket_per_rank: int = 0
    """The bucket grows with the data-parallel ranks d: max(reduce_bucket, this x d)."""
    update_bucket: int | None = None
    """Elements per all-gather call of the updated parameters after the step; None: per unit."""
    replicated_reduce: str = "reduce_scatter"
    """How gradients that are not sharded during backward (s_G = 1: DDP, ZeRO-1) reach the
    optimizer shard: 'reduce_scatter', or 'all_reduce' (the whole buffer is all-reduced and each
    rank keeps its slice: twice the bytes)."""
    sharded_reduce: str = "reduce_scatter"
    """How each micro-batch's gradients reach their G shard where gradients are sharded
    (s_G > 1): 'reduce_scatter', or 'all_reduce' (every rank receives the whole reduced
    gradient and keeps its slice: twice the bytes; the bucket is flattened into one buffer and
    copied back, two copies of it)."""
    zero2_reduce: str = "reduce_scatter"
    """How each micro-batch's gradients reach their G shard where gradients are sharded and
    parameters are not (s_P = 1 < s_G: ZeRO-2): 'reduce_scatter', or 'all_reduce' (each
    bucket is flattened into one buffer, all-reduced, and every rank copies back only the
    slices of its own partition: twice a reduce-scatter's bytes, one copy of the bucket and
    1/s_G of one more on the compute stream). ZeRO-3 (s_P > 1) is ``sharded_reduce``."""
    sync_overlap: bool = True
    """The once-per-step gradient reduction runs during the last backward, overlapped with it
    (True), or after backward, before the step (False: exposed)."""
    replicated_overlap: bool | None = None
    """The once-per-step reduction of unsharded gradients to their optimizer shard (s_G = 1 <
    s_OS: ZeRO-1, the ``replicated_reduce``) runs in the backward hooks of the last
    micro-batch, overlapped with it (True), or after backward (False: exposed); None: as
    ``sync_overlap``. The all-reduce across optimizer-state replicas stays ``sync_overlap``."""
    update_collective: str = "all_gather"
    """How the updated parameter shards reach the ranks that hold them: 'all_gather' (one
    collective per bucket), or 'broadcast' (one broadcast per rank of the group, each of that
    rank's shard of the whole model: NCCL's ring broadcast, its latency paid once per rank)."""
    update_overlap: bool = False
    """The all-gather of updated parameters after the step overlaps the next forward (True:
    one bucket in flight, the first exposed, the rest under the first micro-batch's forward,
    cost/step_time.py ``update_exposed``) or runs before it (False: exposed). Every profile's
    default is False; ``overlapped`` turns it on."""
    overlap_flags: str = ""
    """The engine's opt-in switches that turn on ``sync_overlap`` and ``update_overlap`` both
    (``training: {dp_overlap: true}``, ``Execution.overlapped``); empty: it has none."""
    gather_copy_out: bool = True
    """Each micro-batch's parameter all-gathers end with a copy of the gathered buffer out to
    the parameters (FSDP2's ``foreach_all_gather_copy_out``: read + write of the gathered
    unit at HBM bandwidth, on the compute stream). False: the engine gathers straight into
    the unsharded tensor the parameters are views of (FSDP1's FlatParameter)."""
    backward_prefetch: str = "pre"
    """When the next unit's backward all-gather is issued: 'pre' (before the current unit's
    gradient computation) or 'post' (after it, in its post-backward hook: FSDP1's
    BACKWARD_POST). Both are priced alike, the next gather in flight during the current
    unit's backward (docs/cost-model.md "FSDP1"): the collectives reach the one NCCL stream in
    the same order, and the CPU issues them ahead of the GPU."""
    launch_us: float = 0.0
    """Host time the engine adds per collective call (hooks, bucket bookkeeping, the launch),
    microseconds: it delays the call."""
    prefetch_overlap: bool = True
    """A prefetched parameter all-gather runs under the compute before it (cost/schedule.py
    ``on_demand``). False: the compute waits for each gather call, as if fetched on demand
    (``gather_grouping`` 'module' or 'parameter' only); the gradient reductions overlap as
    the other fields say."""
    reduce_host_us: float = 0.0
    """Host time per (member of the group x parameter tensor) of a gradient reduce-scatter,
    microseconds: an engine that interleaves every tensor's per-rank chunks into the send
    buffer in Python pays it on the thread that launches the backward kernels, so it adds to
    the backward's critical path (compute stream)."""
    gather_host_us: float = 0.0
    """Host time per (member of the group x gathered parameter) of a parameter all-gather,
    microseconds, on the compute stream's critical path: an engine that builds each gather's
    per-rank output list in Python and copies the result out rank by rank (DeepSpeed 0.3's
    ``_allgather_param`` into torch's list all-gather) pays it with the compute waiting."""
    sources: tuple[tuple[str, str], ...] = ()
    """(field, where it is written) for every value above that is not the default."""

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "")

    def overlapped(self) -> Execution:
        """This execution with its opt-in overlaps on (``overlap_flags``): the gradient
        reduction during the last backward, the update all-gather during the next forward."""
        return dataclasses.replace(self, sync_overlap=True, update_overlap=True,
                                   replicated_overlap=None)

    @property
    def replicated_overlaps(self) -> bool:
        """Whether the ZeRO-1 reduction (``replicated_overlap``) overlaps the last backward."""
        return self.sync_overlap if self.replicated_overlap is None else self.replicated_overlap

    def shard_reduce_overlaps(self, s_g: int) -> bool:
        """Whether the once-per-step reduction to the optimizer shard overlaps the last
        backward: unsharded gradients (s_G = 1, ZeRO-1) by ``replicated_overlaps``, sharded ones
        by ``sync_overlap``."""
        return self.replicated_overlaps if s_g == 1 else self.sync_overlap

    def reduce_elements(self, dp_ranks: int) -> int | None:
        """Elements per gradient-reduction call with `dp_ranks` data-parallel ranks."""
        if self.reduce_bucket is None:
            return None
        return max(self.reduce_bucket, self.reduce_bucket_per_rank * dp_ranks)



def execution_differences(a, b) -> list[str]:
    """'field x -> y' for every execution value (``Execution``) in which engine `b` runs a
    plan differently from engine `a`: what separates their predictions beyond the strategy
    and the gradient dtype (each value's source is ``b.execution.source(field)``)."""
    out = []
    for f in dataclasses.fields(Execution):
        x, y = getattr(a.execution, f.name), getattr(b.execution, f.name)
        if f.name != "sources" and x != y:
            none = {"max_live_params": "no limit", "max_reuse_distance": "none",
                    "replicated_overlap": "as sync_overlap"}.get(f.name, "per unit")
            out.append(f"{f.name} {_words(x, none)} -> {_words(y, none)}")
    return out


def _words(v, none: str = "per unit") -> str:
    if v is None:
        return none
    if v == "":
        return "none"
    if isinstance(v, bool):
        return "on" if v else "off"
    return f"{v:,}" if isinstance(v, int) else str(v)
