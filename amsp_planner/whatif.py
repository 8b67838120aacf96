"""What-if sweeps: the optimal plan at every point of a grid of jobs and clusters.

    amsp whatif --model llama-13b,llama2-70b --gpus 64,256,1024,4096 --global-batch 16M \
        --set node_gbit_per_s=100,200,400,800 --plot scaling.png

A ``Sweep`` (``whatif_grid.py``: the axes, points, options and rows) holds one list of values
per axis; its points are their cartesian product, in a fixed order, so rows come back in the
same order however many processes solve them. This module checks the axis values, builds and
solves each point, and runs the points in a process pool.

Every point is solved by ``solver.solve`` on a Job built exactly as ``amsp plan`` builds it
(same loaders, same TrainingSpec, same memory limit), so a row equals ``amsp plan``'s decision and
predictions for the same inputs. What is shared between points is computed once per process:
parsed specs (``load_model``'s cache, ``_cluster`` here), and each (cluster, GPU count)'s
topology, whose max-flow bandwidths are the costliest part of building a job.

A point that is not a valid job (a global batch the GPUs do not divide, a cluster edit the spec
rejects) or on which nothing fits becomes a row with ``status`` 'invalid' or 'infeasible' and the
one-line reason, never an exception.

Derived cluster key: ``node_gbit_per_s`` is the NIC bandwidth of a whole node, spread evenly
over its NICs (``nic_gbit_per_s = node_gbit_per_s / nics_per_node``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

from amsp_planner.errors import AmspUserError, InfeasibleError
from amsp_planner.whatif_grid import (  # noqa: F401 - this API
    AXES,
    MAX_POINTS,
    Point,
    Row,
    SolveOptions,
    Sweep,
)

GIB = 1024**3
NODE_KEY = "node_gbit_per_s"
"""Derived --set key: Gbit/s of all NICs of a node together."""


# ----- specs, shared between points of one process -------------------------------------------
def gpu_presets() -> dict[str, Any]:
    """GPU types of the cluster presets, by their lower-case name (e.g. 'h100-sxm5-80gb')."""
    from amsp_planner.specs.loader import list_presets

    out = {}
    for name in list_presets("cluster"):
        gpu = _cluster(name, ()).gpu
        out.setdefault(gpu.name.lower(), gpu)
    return out


def resolve_gpu_type(name: str):
    """The GpuSpec of a GPU name, or of a unique prefix of one ('h100', 'v100')."""
    types = gpu_presets()
    key = name.lower()
    if key in types:
        return types[key]
    hits = [k for k in types if k.startswith(key)]
    if len(hits) == 1:
        return types[hits[0]]
    names = ", ".join(g.name for g in types.values())
    what = "matches several GPU types" if hits else "is not a known GPU type"
    raise AmspUserError(f"--gpu-type '{name}' {what}: use one of {names}")


@lru_cache(maxsize=256)
def _cluster(name: str | None, overrides: tuple[tuple[str, Any], ...]):
    from amsp_planner.specs import load_cluster

    return load_cluster(name, dict(overrides) if overrides else None)


def cluster_overrides(cluster: str | None, gpu_type: str | None, sets: dict[str, Any]
                      ) -> tuple[tuple[str, Any], ...]:
    """The load_cluster overrides of a point: GPU type first, then the --set keys, with
    node_gbit_per_s turned into nic_gbit_per_s over the node's NICs."""
    out: dict[str, Any] = {}
    if gpu_type is not None:
        out.update((f"gpu.{k}", v) for k, v in resolve_gpu_type(gpu_type).model_dump().items())
    for key, value in sets.items():
        if key == NODE_KEY:
            nics = sets.get("nics_per_node", _cluster(cluster, ()).nics_per_node)
            if not isinstance(nics, int) or nics < 1:
                nics = _cluster(cluster, ()).nics_per_node  # the spec check reports it
            out["nic_gbit_per_s"] = value / nics
        else:
            out[key] = value
    return tuple(out.items())


def check_set_key(key: str) -> None:
    """Raise AmspUserError unless `key` names a cluster field (or node_gbit_per_s)."""
    from amsp_planner.specs.cluster import ClusterSpec, GpuSpec

    top = sorted(k for k in ClusterSpec.model_fields if k not in ("measured", "name", "gpu"))
    parts = key.split(".")
    if parts == [NODE_KEY]:
        return
    if len(parts) == 2 and parts[0] == "gpu":
        if parts[1] in GpuSpec.model_fields:
            return
        raise AmspUserError(f"--set {key}: no such GPU field: use one of "
                            + ", ".join(f"gpu.{k}" for k in GpuSpec.model_fields))
    if len(parts) == 1 and parts[0] in top:
        return
    raise AmspUserError(f"--set {key}: no such cluster field: use one of {', '.join(top)}, "
                        f"gpu.<field>, or {NODE_KEY} (NIC Gbit/s per node)")


def validate(sweep: Sweep, max_points: int = MAX_POINTS) -> None:
    """Check the sweep's size (``Sweep.check_size``), then every axis value on its own (specs
    load, --set values pass the spec's checks); raise AmspUserError with one line for the first
    bad one. Combinations are checked per point."""
    from amsp_planner.specs import load_model

    if len(sweep) == 0:
        raise AmspUserError("the sweep has no points: give at least one value per option")
    sweep.check_size(max_points)
    for m in sweep.models:
        load_model(m)
    for c in sweep.clusters:
        _cluster(c, ())
    for g in sweep.gpu_types:
        if g is not None:
            resolve_gpu_type(g)
    keys = [k for k, _ in sweep.sets]
    if len(set(keys)) != len(keys):
        raise AmspUserError("--set: a key is given twice: give each key once, with a comma list")
    if NODE_KEY in keys and "nic_gbit_per_s" in keys:
        raise AmspUserError(f"--set: give {NODE_KEY} or nic_gbit_per_s, not both")
    for key, values in sweep.sets:
        check_set_key(key)
        for v in values:
            if key == NODE_KEY and (isinstance(v, bool) or not isinstance(v, int | float)
                                    or v <= 0):
                raise AmspUserError(f"--set {key}={v}: must be a positive number of Gbit/s")
            for c in sweep.clusters:
                _cluster(c, cluster_overrides(c, None, {key: v}))


def memory_limit_warnings(sweep: Sweep) -> list[str]:
    """One line per --memory-limit above the GPU memory of a cluster it is swept with (after
    --gpu-type and --set edits), as amsp plan warns: those points are planned as if the GPU
    had that much."""
    limits = sorted({v for v in sweep.memory_limits_gib if v is not None})
    if not limits:
        return []
    keys = [k for k, _ in sweep.sets]
    gpu_gib: dict[str, float] = {}
    for c, g in itertools.product(sweep.clusters, sweep.gpu_types):
        for values in itertools.product(*(v for _, v in sweep.sets)):
            spec = _cluster(c, cluster_overrides(c, g, dict(zip(keys, values, strict=True))))
            gib, name = spec.memory_bytes / GIB, f"{spec.name} with {spec.gpu.name}"
            gpu_gib[name] = min(gpu_gib.get(name, gib), gib)
    out = []
    for lim in limits:
        over = [f"{n} ({gib:g} GiB)" for n, gib in gpu_gib.items() if lim > gib * (1 + 1e-9)]
        if over:
            out.append(f"--memory-limit {lim:g} GiB is above the GPU memory of "
                       f"{', '.join(over)}: those points are planned as if it had that much "
                       "(--set gpu.memory_gib=N sweeps a larger GPU)")
    return out


# ----- one point ------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _topology(cluster_key: tuple, num_gpus: int):
    from amsp_planner.topology import Topology

    return Topology(_cluster(*cluster_key), num_gpus)


def build_point_job(p: Point, opt: SolveOptions):
    """(Job, memory limit in bytes) of a point, as `amsp plan` builds them. Points that differ
    only in the memory limit share one Job object (so the solver's tables, which do not depend
    on the limit, are built once for them: solver/exhaustive.py)."""
    lim = p.get("memory_limit_gib")
    values = tuple(kv for kv in p.values if kv[0] != "memory_limit_gib")
    job = _point_job(values, opt)
    return job, (lim * GIB if lim is not None else job.cluster.memory_bytes)


@lru_cache(maxsize=64)
def _point_job(values: tuple, opt: SolveOptions):
    p = Point(-1, values)
    from pydantic import ValidationError

    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_model, parse_batch
    from amsp_planner.specs.option_names import training_error

    model = load_model(p.get("model"))
    key = (p.get("cluster"), cluster_overrides(p.get("cluster"), p.get("gpu_type"), p.sets))
    cluster = _cluster(*key)
    gb = p.get("global_batch")
    tokens = parse_batch(gb) if isinstance(gb, str) else None
    seqs = gb if isinstance(gb, int) else None
    try:
        t = TrainingSpec(seq_len=p.get("seq_len"), global_batch_tokens=tokens,
                         global_batch_seqs=seqs, micro_batch=opt.micro_batch,
                         activation_checkpointing=opt.activation_checkpointing,
                         flash_attention=opt.flash_attention, precision=opt.precision,
                         grad_accum_dtype=opt.grad_accum_dtype)
    except ValidationError as e:
        raise AmspUserError(training_error(e)) from None
    cluster, split = Job.fit_nodes(cluster, p.get("gpus"))
    job = Job.create(model, cluster, t, p.get("gpus"), opt.engine)
    if split is None:  # the cluster as given: its topology is shared by the points that use it
        job = dataclasses.replace(job, topology=_topology(key, job.num_gpus))
    return job


def _price(opt: SolveOptions, cluster: str | None) -> float | None:
    for name, price in opt.gpu_hour_price:
        if name is None or name == cluster:
            return price
    return None


def _usd_per_btok(price: float | None, gpus: int, tokens_per_s: float) -> float | None:
    if price is None:
        return None
    return price * gpus / 3600 / tokens_per_s * 1e9


def solve_point(p: Point, opt: SolveOptions, ceiling: float | None = None) -> Row:
    """Solve one point; user errors and infeasibility become the row's status. `ceiling`:
    ``Preference.ceiling`` (amsp_planner/monotone.py)."""
    from amsp_planner.solver import solve

    try:
        job, limit = build_point_job(p, opt)
    except AmspUserError as e:
        return Row(p, "invalid", str(e))
    base = dict(cluster_name=job.cluster.name, nodes=job.num_nodes,
                batch_tokens=job.training.batch_tokens)
    try:
        pref = opt.preference(job)
        if ceiling is not None:
            pref = dataclasses.replace(pref, ceiling=ceiling)
        r = solve(job, limit, objective=opt.objective, solver=opt.solver, zeropp=opt.zeropp,
                  runners_up=0, time_limit_s=opt.time_limit_s, preference=pref)
    except InfeasibleError as e:
        return Row(p, "infeasible", str(e), **base)
    except AmspUserError as e:
        return Row(p, "invalid", str(e), **base)
    b = r.best
    s = b.strategy
    price = _price(opt, p.get("cluster"))
    row = Row(
        p, "ok", **base, strategy=str(s),
        sharding=",".join(t for t in str(s).split(",")
                          if t != "ckpt" and not t.startswith(("mb=", "ga=", "ckpt="))),
        memory_gib=b.memory.total / GIB, step_s=b.step_s, compute_s=b.time.compute_s,
        optimizer_s=b.time.optimizer_s, exposed_comm_s=b.time.exposed_comm_s,
        tokens_per_s=b.tokens_per_s, mfu=b.mfu,
        inter_gib_per_gpu=b.bytes_per_rank("inter") / GIB,
        usd_per_btok=_usd_per_btok(price, job.num_gpus, b.tokens_per_s), band=pref.band,
    )
    bb = r.best_baseline
    if bb is not None:
        name, e = bb
        row.baseline, row.baseline_strategy = name, str(e.strategy)
        row.baseline_memory_gib, row.baseline_step_s = e.memory.total / GIB, e.step_s
        row.baseline_tokens_per_s, row.baseline_mfu = e.tokens_per_s, e.mfu
        row.baseline_usd_per_btok = _usd_per_btok(price, job.num_gpus, e.tokens_per_s)
    return row


def _solve_chunk(opt: SolveOptions, points: list[Point], axes: list = ()) -> list[Row]:
    """The rows of `points`, kept monotone along `axes` (whole groups of
    ``monotone.groups``; amsp_planner/monotone.py)."""
    from amsp_planner.monotone import enforce

    rows = [solve_point(p, opt) for p in points]
    return enforce(opt, list(axes), rows, lambda p, c: solve_point(p, opt, c), build_point_job)


# ----- the sweep ------------------------------------------------------------------------------
def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _chunks(points: list[Point], size: int) -> Iterator[list[Point]]:
    for i in range(0, len(points), size):
        yield points[i:i + size]


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which ends them (no traceback per worker), and
    end at once on the SIGTERM it ends them with (not through the parent's handler)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def run(sweep: Sweep, workers: int | None = None,
        progress: Callable[[int], None] | None = None, max_points: int = MAX_POINTS) -> list[Row]:
    """Solve every point, in point order; `progress(k)` is called as k more points finish.

    Refuses a sweep above `max_points` first (``Sweep.check_size``). Runs in this process when
    one worker suffices, else in a pool of min(points, workers) processes fed consecutive chunks
    of points (neighbours share specs and topologies). Along an axis where more is never slower,
    a point's choice is then kept no slower than the choice before it (amsp_planner/monotone.py).
    The workers ignore SIGINT: on Ctrl-C (KeyboardInterrupt here) the pool is terminated before
    the interrupt goes on, so no worker outlives the sweep.
    """
    from amsp_planner.monotone import monotone_axes

    sweep.check_size(max_points)
    return _run(sweep, workers, progress, monotone_axes(sweep))


def _run(sweep: Sweep, workers: int | None, progress: Callable[[int], None] | None,
         axes: list) -> list[Row]:
    points = sweep.points()
    n = len(points)
    workers = max(1, min(n, workers or default_workers()))
    rows: list[Row] = []
    if workers == 1:
        from amsp_planner.monotone import enforce, groups

        for group in groups(points, axes) if axes else [points]:
            part = []
            for p in group:
                part.append(solve_point(p, sweep.options))
                if progress:
                    progress(1)
            rows += enforce(sweep.options, axes, part,
                            lambda p, c: solve_point(p, sweep.options, c), build_point_job)
        return sorted(rows, key=lambda r: r.point.index)
    import multiprocessing as mp
    from functools import partial

    import amsp_planner.solver  # noqa: F401  (imported once, before the fork)

    # chunks of whole memory-limit x GPU-count groups where they are small: the points of a
    # group that differ only in the limit share one job and its solver tables in a worker
    group = len(sweep.memory_limits_gib) * len(sweep.gpus)
    size = max(1, min(16, n // (workers * 4)))
    if len(sweep.memory_limits_gib) > 1 and group <= 32 and n >= 2 * workers * group:
        size = group
    chunks = list(_chunks(points, size))
    if axes:  # whole groups of points along the monotone axes, each kept monotone where solved
        from amsp_planner.monotone import groups

        chunks = groups(points, axes)
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    pool = ctx.Pool(workers, initializer=_ignore_sigint)
    try:
        for chunk in pool.imap(partial(_solve_chunk, sweep.options, axes=axes), chunks):
            rows.extend(chunk)
            if progress:
                progress(len(chunk))
        pool.close()
    except BaseException:  # Ctrl-C or a worker's error: end every worker now
        pool.terminate()
        raise
    finally:
        pool.join()
    return sorted(rows, key=lambda r: r.point.index)
