"""Gathered parameters and gradient buffers of an engine that fetches per module (DeepSpeed
ZeRO-3, ``Execution.gather_grouping == 'module'``), as the engine holds them: a replay of its
parameter coordinator over one step's module trace (docs/memory.md, "DeepSpeed ZeRO-3").

DeepSpeed 0.19.8, ``deepspeed/runtime/zero/partitioned_param_coordinator.py``:
  fetch_sub_module     the module's own parameters are gathered on its pre-forward (or
                       pre-backward) hook if not already prefetched; then parameters of the next
                       modules in the recorded trace are prefetched, one parameter at a time,
                       while the elements prefetched in this call stay under
                       min(max_live - available, prefetch_bucket) (``__n_available_params``
                       counts every gathered element, prefetched ones included);
  release_sub_module   after the module ran, its parameters are freed unless they are persistent
                       or used again within the next ``max_reuse_distance`` elements of the trace
                       (``__params_to_release``): with checkpointing, a block's small modules
                       stay gathered from their recomputation to their backward;
  persistent           parameters under ``param_persistence_threshold`` elements are gathered
                       once and kept whole (``ds_persist``), counted in the available elements.
Defaults (``deepspeed/runtime/zero/config.py``): prefetch_bucket_size 5e7, max_live_parameters
1e9, max_reuse_distance 1e9, param_persistence_threshold 1e5, reduce_bucket_size 5e8 (the first,
the third and the last are ``Execution`` values of the deepspeed profile).

Gradients (``deepspeed/runtime/zero/stage3.py``, ``stage_1_and_2.py``): with
contiguous_gradients (default True) one IPG bucket of ``reduce_bucket_size`` elements is
allocated once (stage 1-2 add a second only with overlap_comm, off there by default); each
parameter's gradient is produced whole by autograd and copied into the bucket, so the largest
parameter's whole gradient exists beside it.
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache
from itertools import accumulate

from amsp_planner.cost.job import Job

MAX_LIVE = 1_000_000_000
"""deepspeed/runtime/zero/config.py max_live_parameters (stage3_max_live_parameters) = 1e9."""
MAX_REUSE = 1_000_000_000
"""deepspeed/runtime/zero/config.py max_reuse_distance (stage3_max_reuse_distance) = 1e9."""


def module_tensors(job: Job) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Elements of each parameter of (the embedding, a block, the head), in execution order;
    with tied embeddings the head uses the embedding's table again."""
    from amsp_planner.cost.unit_tensors import unit_tensors

    emb, block, head = unit_tensors(job.model)
    if job.model.tied_embeddings:
        head = (*head, emb[0])
    return emb, block, head


def _trace(emb: tuple[int, ...], block: tuple[int, ...], head: tuple[int, ...], layers: int,
           tied: bool, recompute: bool) -> tuple[list[int], list[int]]:
    """(parameter id, elements) of every module call of one step, in order: forward, then
    backward (with `recompute`, each block's forward again before its backward)."""
    ids: dict[tuple, int] = {}

    def pid(key):
        return ids.setdefault(key, len(ids))

    emb_ids = [pid(("e", i)) for i in range(len(emb))]
    head_ids = [emb_ids[0] if tied and i == len(head) - 1 else pid(("h", i))
                for i in range(len(head))]
    blocks = [[pid(("b", k, i)) for i in range(len(block))] for k in range(layers)]
    size = {**dict(zip(emb_ids, emb, strict=True)), **dict(zip(head_ids, head, strict=True))}
    for b in blocks:
        size.update(zip(b, block, strict=True))
    order = emb_ids + [p for b in blocks for p in b] + head_ids
    order += head_ids[::-1]
    for b in blocks[::-1]:
        order += (b if recompute else []) + b[::-1]
    order += emb_ids[::-1]
    return order, [size[p] for p in order]


def _replay(order: list[int], sizes: list[int], bucket: int, max_live: int, reuse: int,
            persistent: int, fetched: list[int] | None = None) -> int:
    """Peak gathered elements (persistent ones included) over the trace (module docstring);
    `fetched`, when given, gets the parameter id of every gather appended (fetch or
    prefetch)."""
    n = len(order)
    nxt, seen = [n] * n, {}
    for i in range(n - 1, -1, -1):
        nxt[i], seen[order[i]] = seen.get(order[i], n), i
    prefix = [0, *accumulate(sizes)]
    live: dict[int, int] = {}
    avail, peak, ptr = persistent, persistent, 0
    for i, p in enumerate(order):
        if p not in live:
            live[p] = sizes[i]
            avail += sizes[i]
            if fetched is not None:
                fetched.append(p)
        ptr = max(ptr, i + 1)
        room, got = min(max_live - avail, bucket), 0
        while ptr < n and got < room:
            q = order[ptr]
            if q not in live:
                live[q] = sizes[ptr]
                avail += sizes[ptr]
                got += sizes[ptr]
                if fetched is not None:
                    fetched.append(q)
            ptr += 1
        peak = max(peak, avail)
        # freed unless used again within `reuse` elements of the modules that follow, or
        # already prefetched for that next use
        j = nxt[i]
        if j >= n or (bisect_left(prefix, prefix[i + 1] + reuse) <= j and j >= ptr):
            avail -= live.pop(p)
    return peak


def _gathered(emb: tuple[int, ...], block: tuple[int, ...], head: tuple[int, ...], layers: int,
              tied: bool, recompute: bool, threshold: int) -> tuple[list[int], list[int], list[int]]:
    """(the whole trace's parameter ids, then the ids and elements of the calls the engine
    gathers: every parameter of ``threshold`` elements or more; the rest stay whole)."""
    order, sizes = _trace(emb, block, head, layers, tied, recompute)
    keep = [i for i, x in enumerate(sizes) if x >= threshold]
    return order, [order[i] for i in keep], [sizes[i] for i in keep]


@lru_cache(maxsize=256)
def _peak(emb: tuple[int, ...], block: tuple[int, ...], head: tuple[int, ...], layers: int,
          tied: bool, bucket: int, threshold: int, max_live: int, reuse: int) -> int:
    persistent = sum(x for x in (*emb, *head) if x < threshold) + layers * sum(
        x for x in block if x < threshold)
    return max(_replay(*_gathered(emb, block, head, layers, tied, recompute, threshold)[1:],
                       bucket, max_live, reuse, persistent)
               for recompute in (False, True))


@lru_cache(maxsize=256)
def _regather(emb: tuple[int, ...], block: tuple[int, ...], head: tuple[int, ...], layers: int,
              tied: bool, bucket: int, threshold: int, max_live: int, reuse: int) -> float:
    gathered = sum(x for x in block if x >= threshold)
    if not gathered:
        return 0.0
    got = []
    for recompute in (False, True):
        order, ids, sizes = _gathered(emb, block, head, layers, tied, recompute, threshold)
        first = len(emb) + layers // 2 * len(block)  # a middle block, away from both ends
        size = dict(zip(order[first:first + len(block)], block, strict=True))
        fetched: list[int] = []
        _replay(ids, sizes, bucket, max_live, reuse, 0, fetched)
        got.append(sum(size[p] for p in fetched if p in size))
    # what the recomputation adds: its gather replaces the backward's, and a module freed
    # after it is gathered again for its backward
    return max(0.0, (got[1] - got[0]) / gathered)


def _limits(job: Job) -> tuple[int, int]:
    """(max live, reuse distance) in elements: the profile's, else DeepSpeed's defaults."""
    ex = job.profile.execution
    return ex.max_live_params or MAX_LIVE, ex.max_reuse_distance or MAX_REUSE


def regather_fraction(job: Job, tp: int = 1) -> float:
    """Of a checkpointed block's gathered elements, the share an engine with a reuse distance
    (``Execution.max_reuse_distance``) gathers a third time in the step: the recomputed
    forward gathers the block again, and a module whose own backward lies more than the reuse
    distance further on in the trace is freed after its recomputation and gathered once more
    for its backward (``__params_to_release``). Replayed over a step with every block
    recomputed and without: the difference of a middle block's gathered elements over its
    parameters' (one TP rank's shards). 0 for an engine without a reuse distance, and for a
    mixture of experts (its expert modules are not in the trace)."""
    ex = job.profile.execution
    if ex.max_reuse_distance is None or ex.gather_grouping == "unit" or job.model.is_moe:
        return 0.0
    emb, block, head = (tuple(x // tp for x in t) for t in module_tensors(job))
    return _regather(emb, block, head, job.model.num_layers, job.model.tied_embeddings,
                     ex.prefetch_bucket or 0, ex.persistence_threshold, *_limits(job))


def gathered_elements(job: Job) -> float:
    """The most parameter elements the engine holds gathered at once in one step (with or
    without checkpointing, whichever holds more), persistent parameters included."""
    ex = job.profile.execution
    emb, block, head = module_tensors(job)
    return float(_peak(emb, block, head, job.model.num_layers, job.model.tied_embeddings,
                       ex.prefetch_bucket or 0, ex.persistence_threshold, *_limits(job)))


def grad_bucket_elements(job: Job) -> float:
    """The IPG bucket and the largest parameter's whole gradient (module docstring)."""
    ex = job.profile.execution
    bucket = ex.reduce_elements(job.num_gpus) or 0
    return float(bucket + max(max(t) for t in module_tensors(job) if t))
