"""Where a plan's decision changes: each assumption of the cost model scaled until the solver
picks another strategy.

For each assumption (``ASSUMPTIONS``: the memory limit, link bandwidths and latencies, compute
rates), the cluster field is scaled by ``SCAN_FACTORS`` (and their inverses) in each direction,
re-solving at each step with the search the plan ran (``solve_options``); the first multiple
that changes the choice is bisected down to ``TOLERANCE``. The searches run in a process pool
(``default_workers``). ``sensitivity_line`` tells one assumption's result in one line.

Used by ``report/explain.py`` (``amsp explain``); ``_diff`` says in words how two strategies
differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from amsp_planner.report.fmt import GIB


def _diff(a, b) -> str:
    """What differs between two strategies, in words."""
    out = []
    if a.tp != b.tp:
        out.append(f"tp {a.tp}->{b.tp}")
    for c, name in (("p", "P"), ("g", "G"), ("os", "OS")):
        if a.factor(c) != b.factor(c):
            out.append(f"{name} {a.factor(c)}->{b.factor(c)}")
    for field, name in (("qwz", "qwZ"), ("qgz", "qgZ"), ("fp8ag", "FP8 all-gather")):
        if getattr(a, field) != getattr(b, field):
            out.append(f"{name} {'on' if getattr(b, field) else 'off'}")
    if a.ckpt_value != b.ckpt_value:
        out.append(f"checkpointing {b.ckpt_words}")
    if a.hpz != b.hpz:
        out.append(f"hpZ {a.hpz}->{b.hpz}")
    if a.micro_batch != b.micro_batch:
        out.append(f"micro-batch {a.micro_batch}->{b.micro_batch}")
    if a.has_experts or b.has_experts:  # a mixture of experts: e, its placement, the triple
        if a.ep != b.ep:
            out.append(f"ep {a.ep}->{b.ep}")
        if a.ep_span != b.ep_span:
            where = {False: "in the node", True: "spanning nodes"}
            out.append(f"EP placement {where[a.ep_span]}->{where[b.ep_span]}")
        for c, name in (("p", "P"), ("g", "G"), ("os", "OS")):
            if a.expert_factor(c) != b.expert_factor(c):
                out.append(f"expert {name} {a.expert_factor(c)}->{b.expert_factor(c)}")
    for field, name in (("cp", "cp"), ("pp", "pp"), ("vpp", "vpp")):
        if getattr(a, field, 1) != getattr(b, field, 1):
            out.append(f"{name} {getattr(a, field, 1)}->{getattr(b, field, 1)}")
    return ", ".join(out) or "same sharding"


# ----- sensitivity: where the decision changes -------------------------------------------------
SCAN_FACTORS = (2.0, 4.0)
"""Multiples of the current value scanned in each direction (and their inverses) before
bisecting; the scan stops at the first multiple that changes the choice."""


TOLERANCE = 0.01
"""Bisection stops once the bracket around a flip is this tight (relative)."""


def solve_options(doc: dict) -> dict:
    """The keywords of `solve()` that reproduce the search a plan ran: its objective, solver and
    search restrictions (zeropp, pinned micro-batch / checkpointing, and any other restriction
    the plan records under a name `solve()` takes)."""
    import inspect

    from amsp_planner.solver import solve

    inp = doc["inputs"]
    search = dict(inp.get("search", {}))
    accepted = set(inspect.signature(solve).parameters) - {"job", "memory_limit", "runners_up"}
    kw = {"objective": inp.get("objective", "time"), "zeropp": search.pop("zeropp", True)}
    if doc.get("solver", {}).get("name") in ("highs", "cbc"):
        kw["solver"] = doc["solver"]["name"]
    ckpt = search.pop("activation_checkpointing", None)
    if ckpt is not None:
        kw["ckpt"] = ckpt
    from amsp_planner.solver.space import Preference

    kw["preference"] = Preference.from_dict(search.pop("preference", None))
    kw.update({k: v for k, v in search.items() if k in accepted and v is not None})
    return kw


def _decision(strategy) -> str:
    return str(strategy.with_(grad_accum=None))


@dataclass(frozen=True)
class Assumption:
    """One input of the cost model that a plan's choice rests on, and how to scale it."""

    key: str
    label: str
    unit: str
    fields: tuple[str, ...]
    """The cluster fields (``--set`` keys) scaled together; empty: the memory limit."""
    display: float
    """Multiplier from the first field's unit to the unit shown (Gbit/s to GB/s: 1/8; the memory
    limit's bytes to GiB)."""


ASSUMPTIONS = (
    Assumption("comm_compute_slowdown", "comm/compute slowdown", "s per s of overlapped comm",
               ("gpu.comm_compute_slowdown",), 1.0),
    Assumption("inter_node_bandwidth", "inter-node bandwidth", "GB/s per NIC",
               ("nic_gbit_per_s",), 1 / 8),
    Assumption("compute_efficiency", "compute efficiency", "of peak for matmuls (attention's "
               "fraction scaled with it)",
               ("gpu.achievable_fraction", "gpu.attention_fraction"), 1.0),
    Assumption("memory_limit", "memory limit", "GiB per GPU", (), 1 / GIB),
)


def _field(cluster_data: dict, key: str):
    v = cluster_data
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return v


def scaled_job(job, limit: float, a: Assumption, factor: float):
    """(job, memory limit) with assumption `a` scaled by `factor`, through the ``--set``
    overrides; inter-node bandwidth also scales measured inter-node tables."""
    from amsp_planner.cost.job import Job
    from amsp_planner.specs.cluster import ClusterSpec
    from amsp_planner.specs.loader import apply_overrides

    if not a.fields:
        return job, limit * factor
    data = job.cluster.model_dump(mode="json")
    sets = {k: _field(data, k) * factor for k in a.fields if _field(data, k) is not None}
    data = apply_overrides(data, sets)
    if a.key == "inter_node_bandwidth":
        data["measured"] = [
            {**t, "points": [{**pt, "busbw_gbyte_per_s": pt["busbw_gbyte_per_s"] * factor}
                             for pt in t["points"]]} if t["scope"] == "inter" else t
            for t in data.get("measured", [])]
    cluster = ClusterSpec.model_validate(data)
    made = Job.create(job.model, cluster, job.training, job.num_gpus, job.engine, *job.split)
    return replace(made, settings=job.settings), limit


def _upper_bound(key: str) -> float:
    """The largest value the spec allows for cluster field `key` (its ``le``), or inf."""
    from amsp_planner.specs.cluster import ClusterSpec, GpuSpec

    parts = key.split(".")
    info = (GpuSpec if parts[0] == "gpu" else ClusterSpec).model_fields[parts[-1]]
    return min((m.le for m in info.metadata if getattr(m, "le", None) is not None),
               default=float("inf"))


def _max_factor(job, a: Assumption) -> float:
    """The largest multiple scanned upward: 4x, or less where a field reaches its bound."""
    data = job.cluster.model_dump(mode="json")
    caps = [_upper_bound(k) / v for k in a.fields if (v := _field(data, k))]
    return min([SCAN_FACTORS[-1], *caps])


def _side_factors(job, a: Assumption, side: str) -> list[float]:
    """The multiples scanned on one side, nearest first (above: capped at the field's bound)."""
    if side == "below":
        return [1 / f for f in SCAN_FACTORS]
    top = min(SCAN_FACTORS[-1], _max_factor(job, a))
    return [f for f in sorted({min(f, top) for f in SCAN_FACTORS}) if f > 1.0]


def search_side(job, limit: float, a: Assumption, side: str, chosen: str, kw: dict,
                tol: float = TOLERANCE) -> tuple[tuple[float, float, str | None] | None, int]:
    """On one side of the current value of `a`: scan, then bisect in log space, for the first
    multiple at which re-solving picks a decision other than `chosen`. Returns ((last multiple
    that keeps it, first that changes it, the decision there: None if nothing fits) or None
    when nothing changes within the scan, number of solves)."""
    from amsp_planner.errors import InfeasibleError
    from amsp_planner.solver import solve

    cache: dict[float, str | None] = {1.0: chosen}

    def pick(f: float) -> str | None:
        if f not in cache:
            j, lim = scaled_job(job, limit, a, f)
            try:
                cache[f] = _decision(solve(j, lim, runners_up=0, **kw).best.strategy)
            except InfeasibleError:
                cache[f] = None
        return cache[f]

    held, flip = 1.0, None
    for f in _side_factors(job, a, side):
        if pick(f) != chosen:
            flip = f
            break
        held = f
    if flip is None:
        return None, len(cache) - 1
    while max(held, flip) / min(held, flip) > 1 + tol:
        mid = (held * flip) ** 0.5
        if pick(mid) == chosen:
            held = mid
        else:
            flip = mid
    return (held, flip, cache[flip]), len(cache) - 1


def _search_task(args):
    return search_side(*args)


def default_workers() -> int:
    """Processes for the sensitivity searches: one per core, at most one per search."""
    import os

    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(2 * len(ASSUMPTIONS), n or 1))


def sensitivity(job, limit: float, chosen: str, kw: dict, *, tol: float = TOLERANCE,
                workers: int | None = None, progress=None) -> dict:
    """For each assumption: the values below and above the current one at which re-solving
    picks a decision other than `chosen` (scan to SCAN_FACTORS, then bisect to `tol`). The
    searches are independent; with `workers` > 1 they run in that many processes."""
    data = job.cluster.model_dump(mode="json")
    out, tasks = [], []
    for a in ASSUMPTIONS:
        base = limit if not a.fields else _field(data, a.fields[0])
        entry = {"name": a.key, "label": a.label, "unit": a.unit,
                 "fields": list(a.fields) or ["memory_limit"], "value": base * a.display,
                 "below": None, "above": None}
        out.append(entry)
        if base == 0:
            entry.update(low=0.0, high=0.0, note="zero, so scaling it cannot change the choice")
            continue
        for side in ("below", "above"):
            factors = _side_factors(job, a, side)
            entry["low" if side == "below" else "high"] = base * (
                factors[-1] if factors else 1.0) * a.display
            if factors:
                tasks.append((entry, a, base, side))
        entry["high_is_cap"] = _max_factor(job, a) < SCAN_FACTORS[-1]
    workers = default_workers() if workers is None else max(1, workers)
    args = [(job, limit, a, side, chosen, kw, tol) for _, a, _, side in tasks]
    workers = min(workers, max(1, len(args)))
    if progress:
        progress(f"sensitivity: {len(tasks)} searches of up to "
                 f"{len(SCAN_FACTORS) + _bisections(tol)} solves each, {workers} process(es)")
    def done(i, r):
        if progress:
            _, a, _, side = tasks[i]
            progress(f"sensitivity: {a.label}, {side}: "
                     f"{'changes' if r[0] else 'holds'} ({r[1]} solves)")

    results, workers = _run_searches(args, workers, done)
    solves = 0
    for (entry, a, base, side), (found, n) in zip(tasks, results, strict=True):
        solves += n
        if found is not None:
            held, flip, becomes = found
            entry[side] = {"value": base * (held * flip) ** 0.5 * a.display,
                           "holds_at": base * held * a.display,
                           "changes_at": base * flip * a.display, "becomes": becomes}
    return {"tolerance": tol, "scan_factors": list(SCAN_FACTORS), "solves": solves,
            "workers": workers, "assumptions": out}


def _run_searches(args: list, workers: int, done=None) -> tuple[list, int]:
    """search_side over `args` in `workers` processes (in this one where processes cannot be
    started), calling `done(i, result)` as each finishes; (results, processes used)."""
    results: list = [None] * len(args)

    def finish(i, r):
        results[i] = r
        if done:
            done(i, r)

    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from concurrent.futures.process import BrokenProcessPool

        try:
            with ProcessPoolExecutor(workers,
                                     mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = {pool.submit(_search_task, a): i for i, a in enumerate(args)}
                for f in as_completed(futures):
                    finish(futures[f], f.result())
            return results, workers
        except (OSError, BrokenProcessPool):
            pass
    for i, a in enumerate(args):
        if results[i] is None:
            finish(i, _search_task(a))
    return results, 1


def _bisections(tol: float) -> int:
    import math

    step = SCAN_FACTORS[0]
    return max(0, math.ceil(math.log2(math.log(step) / math.log(1 + tol))))


def _num(v: float) -> str:
    return f"{v:.3g}"


def sensitivity_line(s: dict, chosen) -> str:
    from amsp_planner.strategy import Strategy

    head = f"  {s['label']} {_num(s['value'])} {s['unit']}: "
    if s.get("note"):
        return head + s["note"]
    lo = _num(s["below"]["value"]) if s["below"] else f"{_num(s['low'])} or less"
    hi = (_num(s["above"]["value"]) if s["above"] else
          f"{_num(s['high'])} (its maximum)" if s.get("high_is_cap") else f"{_num(s['high'])}+")
    text = head + f"the choice holds from {lo} to {hi}"
    for side, word in (("below", "below"), ("above", "above")):
        f = s[side]
        if f:
            to = ("nothing fits" if f["becomes"] is None else
                  f"it becomes {f['becomes']} ({_diff(chosen, Strategy.parse(f['becomes']))})")
            text += f"; {word} {_num(f['value'])} {to}"
    if not s["below"] and not s["above"]:
        text += " (no change in the range scanned)"
    return text
