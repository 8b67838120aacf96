"""Why a plan: re-solve around it to find what binds and what the alternatives cost."""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.report.fmt import gib, secs

GIB = 1024**3


def _diff(a, b) -> str:
    """What differs between two strategies, in words."""
    out = []
    if a.tp != b.tp:
        out.append(f"tp {a.tp}->{b.tp}")
    for c, name in (("p", "P"), ("g", "G"), ("os", "OS")):
        if a.factor(c) != b.factor(c):
            out.append(f"{name} {a.factor(c)}->{b.factor(c)}")
    for field, name in (("qwz", "qwZ"), ("qgz", "qgZ")):
        if getattr(a, field) != getattr(b, field):
            out.append(f"{name} {'on' if getattr(b, field) else 'off'}")
    if a.ckpt_value != b.ckpt_value:
        out.append(f"checkpointing {b.ckpt_words}")
    if a.hpz != b.hpz:
        out.append(f"hpZ {a.hpz}->{b.hpz}")
    if a.micro_batch != b.micro_batch:
        out.append(f"micro-batch {a.micro_batch}->{b.micro_batch}")
    return ", ".join(out) or "same sharding"


STEP_PARTS = (("compute", "compute_s"), ("kernels", "kernel_s"), ("optimizer", "optimizer_s"),
              ("contention", "contention_s"), ("exposed forward", "exposed_forward_s"),
              ("exposed backward", "exposed_backward_s"), ("exposed update", "exposed_update_s"),
              ("TP collectives", "tp_comm_s"))


def step_differences(chosen, other, threshold: float = 0.002) -> list[tuple[str, float]]:
    """The parts of the step (other minus chosen, seconds) that make the difference, largest
    first: each part whose change is at least `threshold` of the chosen step."""
    out = []
    for name, field in STEP_PARTS:
        d = getattr(other.time, field) - getattr(chosen.time, field)
        if abs(d) >= threshold * chosen.step_s:
            out.append((name, d))
    return sorted(out, key=lambda kv: -abs(kv[1]))


EQUIVALENT_RUNNERS_UP = 5
"""Runners-up re-solved for the list of equivalent candidates."""


def equivalent_candidates(job, e, result) -> dict:
    """Runners-up and named baselines of a re-solve whose step time is within the validated
    relative band of the plan's (`e`): the model cannot tell them apart."""
    from amsp_planner.solver.space import validated_band

    band = validated_band(job)
    chosen = _decision(e.strategy)
    rows = [(f"runner-up {i + 1}", r) for i, r in enumerate(result.runners_up)]
    rows += list(result.baselines.items())
    out, seen = [], {chosen}
    for name, r in rows:
        margin = r.step_s / e.step_s - 1
        d = _decision(r.strategy)
        if r.fits and abs(margin) <= band and d not in seen:
            seen.add(d)
            out.append({"name": name, "strategy": d, "step_s": r.step_s,
                        "memory_gib": r.memory.total / GIB, "margin": margin})
    return {"band": band, "candidates": out}


def explain_plan(p, sensitivity: bool = True, progress=None, workers: int | None = None) -> dict:
    """Facts and text lines on why plan `p` chose what it chose; with `sensitivity`, also the
    equivalent candidates and the value of each assumption at which the choice changes
    (re-solving in `workers` processes, default one per core; `progress` gets a line before)."""
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.errors import InfeasibleError
    from amsp_planner.solver import solve
    from amsp_planner.strategy import Strategy

    job, e, limit = p.job, p.evaluation, p.memory_limit
    doc = p.doc
    opts = solve_options(doc)
    kw = {**opts, "runners_up": 0}
    lines = [f"plan: {e.strategy} for {job.model.name} on {job.num_gpus} GPUs of {job.cluster.name}"
             f" ({gib(e.memory.total)} of {gib(limit)} GiB per GPU, step {secs(e.step_s)})"]
    facts: dict = {"strategy": str(e.strategy)}

    # binding constraint: does more memory buy a faster plan?
    try:
        free = solve(job, float("inf"), **kw).best
    except InfeasibleError:
        free = e
    binding = free.step_s < e.step_s * (1 - 1e-9)
    facts["memory_binding"] = binding
    if binding:
        lines.append(f"binding constraint: memory per GPU. Without the limit the best plan is "
                     f"{free.strategy} at {secs(free.step_s)} needing {gib(free.memory.total)} GiB.")
        more = limit * 1.25
        try:
            e_more = solve(job, more, **kw).best
            gain = (e.step_s - e_more.step_s) / ((more - limit) / GIB)
        except InfeasibleError:
            e_more, gain = None, 0.0
        facts["marginal_s_per_gib"] = gain
        lines.append(f"marginal value of memory: {gain * 1e3:.3f} ms of step time per extra GiB "
                     f"(at {gib(more)} GiB: {e_more.strategy if e_more else '-'})")
    else:
        facts["marginal_s_per_gib"] = 0.0
        lines.append("binding constraint: none. Memory is not binding: more memory would not make "
                     "the step faster; among equal step times the plan takes the least memory "
                     f"({gib(limit - e.memory.total)} GiB headroom).")

    # what dominates
    t = e.time
    phases = {"forward": t.exposed_forward_s, "backward (incl. step-boundary sync)":
              t.exposed_backward_s, "update (after the optimizer)": t.exposed_update_s}
    top = max(phases, key=phases.get)
    facts["dominant_exposed_phase"] = top
    lines.append(f"step {secs(t.step_s)} = compute {secs(t.compute_s)} + kernels "
                 f"{secs(t.kernel_s)} + optimizer {secs(t.optimizer_s)} + contention "
                 f"{secs(t.contention_s)} + exposed communication {secs(t.exposed_comm_s)}"
                 + (f" (TP collectives {secs(t.tp_comm_s)})" if t.tp_comm_s else "")
                 + f"; most exposed: {top} ({secs(phases[top])})")
    if e.schedule:
        big = max(e.schedule, key=lambda s: s.time_s)
        lines.append(f"largest collective: {big.phase} {big.op} over {big.group} "
                     f"(size {big.group_size}, stride {big.stride}): {secs(big.time_s)} per step")
    mem = e.memory
    terms = {k: getattr(mem, k) for k in ("params", "grads", "optimizer", "hpz", "activations")}
    top_mem = max(terms, key=terms.get)
    lines.append(f"largest memory term: {top_mem} ({gib(terms[top_mem])} GiB)")

    _add_tensor_parallel(p, kw, facts, lines)

    # alternatives
    alts = []
    for name, r in doc["predictions"].get("references", {}).items():
        if r["strategy"] != str(e.strategy):
            alts.append((name.replace("_", " "), r))
    for r in doc.get("runners_up", []):
        alts.append(("runner-up", r))
    for name, b in doc.get("baselines", {}).items():
        alts.append((name, b))
    facts["alternatives"] = []
    for name, r in alts:
        other = Strategy.parse(r["strategy"])
        d_step = r["step_s"] / e.step_s - 1
        d_mem = (r["memory_bytes"] - e.memory.total) / GIB
        fit = "" if r["fits"] else " (does not fit)"
        parts = step_differences(e, evaluate(job, other, limit))
        lines.append(f"  {name:10s} {r['strategy']}: {d_step * 100:+.2f}% step time, "
                     f"{d_mem:+.2f} GiB{fit}; differs by {_diff(e.strategy, other)}")
        if parts:
            lines.append("             " + ", ".join(
                f"{k} {v * 1e3:+.1f} ms" for k, v in parts))
        facts["alternatives"].append({"name": name, "strategy": r["strategy"],
                                      "step_rel": d_step, "memory_gib_delta": d_mem,
                                      "step_parts_s": dict(parts)})
    if sensitivity:
        _add_sensitivity(p, opts, facts, lines, progress, workers)
    facts["lines"] = lines
    return facts


def _add_tensor_parallel(p, kw: dict, facts: dict, lines: list[str]) -> None:
    """The best plan at every other tensor-parallel degree the job admits (re-solved with the
    degree pinned), and what the chosen degree gains over each: why this t."""
    from amsp_planner.errors import InfeasibleError
    from amsp_planner.solver import solve

    job, e, limit = p.job, p.evaluation, p.memory_limit
    if kw.get("tp") is not None or p.doc["inputs"].get("search", {}).get("given_strategy"):
        return  # the degree was pinned or given: nothing was chosen
    opts = [t for t in job.tp_options() if t != e.strategy.tp]
    if not opts:
        return
    t0 = e.strategy.tp
    head = (f"tensor parallelism: tp={t0} chosen" if t0 > 1 else
            "tensor parallelism: tp=1 chosen (data parallel only)")
    if t0 > 1:
        head += (f", TP collectives {secs(e.time.tp_comm_s)} per step on the critical path, "
                 f"activations {gib(e.memory.activations)} GiB per GPU")
    lines.append(head + "; the best plan at each other degree:")
    rows = []
    for t in opts:
        try:
            r = solve(job, limit, **{**kw, "tp": t}).best
        except InfeasibleError:
            lines.append(f"  tp={t}: nothing fits")
            rows.append({"tp": t, "strategy": None})
            continue
        rel = r.step_s / e.step_s - 1
        why = ", ".join(f"{k} {v * 1e3:+.1f} ms" for k, v in step_differences(e, r)[:3])
        lines.append(f"  tp={t}: {r.strategy}: {rel * 100:+.2f}% step time, "
                     f"{(r.memory.total - e.memory.total) / GIB:+.2f} GiB, checkpointing "
                     f"{r.strategy.ckpt_words}" + (f"; {why}" if why else ""))
        rows.append({"tp": t, "strategy": str(r.strategy), "step_rel": rel,
                     "memory_gib_delta": (r.memory.total - e.memory.total) / GIB,
                     "ckpt": r.strategy.ckpt_value})
    facts["tensor_parallel"] = {"chosen": t0, "others": rows}


def _add_sensitivity(p, opts: dict, facts: dict, lines: list[str], progress, workers) -> None:
    from amsp_planner.errors import InfeasibleError
    from amsp_planner.solver import solve

    job, e, limit = p.job, p.evaluation, p.memory_limit
    chosen = _decision(e.strategy)
    # The re-solves (the runners-up here, tens in the scans below) run on the exact enumeration
    # over the ILP's tables (solver/exhaustive.py: the same decisions, about 10x faster) when it
    # reproduces the plan's choice at the current values; else on the plan's own solver.
    fast = {**opts, "solver": "exhaustive"}

    def resolve(kw):
        try:
            return solve(job, limit, runners_up=EQUIVALENT_RUNNERS_UP, **kw)
        except InfeasibleError:
            return None

    r = resolve(fast)
    kw = fast
    if r is None or _decision(r.best.strategy) != chosen:
        r, kw = resolve(opts), opts
    if r is not None:
        eq = equivalent_candidates(job, e, r)
        facts["equivalent"] = eq
        lines.append(f"equivalent candidates (step time within the {eq['band'] * 100:.1f}% "
                     f"relative band): {len(eq['candidates']) or 'none'}")
        for c in eq["candidates"]:
            lines.append(f"  {c['name']:11s} {c['strategy']}: {secs(c['step_s'])} "
                         f"({c['margin'] * 100:+.2f}%), {c['memory_gib']:.2f} GiB")
    given = p.doc["inputs"].get("search", {}).get("given_strategy")
    resolved = _decision(r.best.strategy) if r is not None else None
    if given or resolved != chosen:
        why = (f"the plan evaluates the given strategy {given}" if given else
               f"re-solving the plan's inputs picks {resolved or 'nothing'}, not the plan's "
               "strategy (a plan from another amsp version?)")
        facts["sensitivity"] = {"skipped": why}
        lines.append(f"sensitivity: skipped: {why}")
        return
    sens = sensitivity(job, limit, chosen, kw, progress=progress, workers=workers)
    sens["solver"] = kw.get("solver", "highs")
    facts["sensitivity"] = sens
    lines.append(f"sensitivity (re-solved {sens['solves']} times by {sens['solver']}; each flip to "
                 f"{sens['tolerance'] * 100:g}%, scanned to x{1 / SCAN_FACTORS[-1]:g}.."
                 f"x{SCAN_FACTORS[-1]:g}):")
    for s in sens["assumptions"]:
        lines.append(sensitivity_line(s, e.strategy))


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
    Assumption("compute_efficiency", "compute efficiency", "of peak for matmuls",
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
    return Job.create(job.model, cluster, job.training, job.num_gpus), limit


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
