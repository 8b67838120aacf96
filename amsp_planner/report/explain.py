"""Why a plan: re-solve around it to find what binds and what the alternatives cost.

``explain_plan`` (``amsp explain``): the binding constraint (memory, or none) and what more
memory would buy, the runners-up and the parts of the step they differ in, the equivalent
candidates within the step-time model's error band, the other tensor-parallel degrees, then the
sensitivity of the choice to each assumption (``report/sensitivity.py``).
"""

from __future__ import annotations

from amsp_planner.errors import AmspUserError
from amsp_planner.report.fmt import GIB, gib, secs
from amsp_planner.report.sensitivity import (  # noqa: F401 - also this module's API
    ASSUMPTIONS,
    SCAN_FACTORS,
    _decision,
    _diff,
    _side_factors,
    scaled_job,
    search_side,
    sensitivity,
    sensitivity_line,
    solve_options,
)

STEP_PARTS = (("compute", "compute_s"), ("kernels", "kernel_s"), ("optimizer", "optimizer_s"),
              ("contention", "contention_s"), ("exposed forward", "exposed_forward_s"),
              ("exposed backward", "exposed_backward_s"), ("exposed update", "exposed_update_s"),
              ("TP collectives", "tp_comm_s"), ("all-to-alls", "ep_comm_s"))


def step_differences(chosen, other, threshold: float = 0.002) -> list[tuple[str, float]]:
    """The parts of the step (other minus chosen, seconds) that make the difference, largest
    first: each part whose change is at least `threshold` of the chosen step."""
    out = []
    for name, field in STEP_PARTS:
        d = getattr(other.time, field) - getattr(chosen.time, field)
        if abs(d) >= threshold * chosen.step_s:
            out.append((name, d))
    return sorted(out, key=lambda kv: -abs(kv[1]))


def a2a_differences(chosen, other, threshold: float = 0.002) -> list[tuple[str, float, float]]:
    """The token all-to-alls that separate two evaluations (mixture of experts): per phase
    (forward, backward, recompute), other minus chosen seconds and NIC GiB per rank and step,
    each phase whose seconds change by at least `threshold` of the chosen step."""
    def by_phase(ev):
        return {e.phase: (e.time_s, e.inter_bytes_per_rank_per_step / GIB)
                for e in ev.schedule if e.op == "all_to_all"}

    a, b = by_phase(chosen), by_phase(other)
    out = []
    for phase in ("forward", "backward", "recompute"):
        (sa, na), (sb, nb) = a.get(phase, (0.0, 0.0)), b.get(phase, (0.0, 0.0))
        if abs(sb - sa) >= threshold * chosen.step_s:
            out.append((phase, sb - sa, nb - na))
    return out


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
    from amsp_planner.cost.evaluate import engine_runs, evaluate
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
        pref = kw["preference"]
        order = ", ".join(pref.tie_breaks) or "none"
        within = f"within {pref.band * 100:.1f} % of the fastest" if pref.band else "among equal steps"
        lines.append("binding constraint: none. Memory is not binding: more memory would not make "
                     f"the step faster ({gib(limit - e.memory.total)} GiB headroom; {within}, "
                     f"the plan's tie-breaks in turn: {order}).")

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
                 + (f" (all-to-alls {secs(t.ep_comm_s)})" if t.ep_comm_s else "")
                 + (f" + pipeline bubble {secs(t.bubble_s)}" if t.bubble_s else "")
                 + (f" + the slowest rank's lag {secs(t.straggler_s)}" if t.straggler_s else "")
                 + (f" + per-rank sync {secs(t.sync_s)}" if t.sync_s else "")
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
        # priced as the plan is: on the engine it is explained for (`amsp explain --engine`
        # re-prices the plan; the plan file's figures are its own engine's)
        why = engine_runs(job, other)
        if why:
            lines.append(f"  {name:10s} {r['strategy']}: not run by {job.engine} ({why})")
            continue
        try:
            ev_other = evaluate(job, other, limit)
        except AmspUserError as why:  # explained on another engine, which cannot run it
            reason = str(why).removeprefix(f"--strategy {other}: ").split(": use ")[0]
            lines.append(f"  {name:10s} {r['strategy']}: not run by {job.engine} ({reason})")
            continue
        d_step = ev_other.step_s / e.step_s - 1
        d_mem = (ev_other.memory.total - e.memory.total) / GIB
        fit = "" if ev_other.fits else " (does not fit)"
        parts = step_differences(e, ev_other)
        lines.append(f"  {name:10s} {r['strategy']}: {d_step * 100:+.2f}% step time, "
                     f"{d_mem:+.2f} GiB{fit}; differs by {_diff(e.strategy, other)}")
        if parts:
            lines.append("             " + ", ".join(
                f"{k} {v * 1e3:+.1f} ms" for k, v in parts))
        a2a = a2a_differences(e, ev_other)
        if a2a:
            lines.append("             all-to-alls: " + ", ".join(
                f"{ph} {v * 1e3:+.1f} ms ({nic:+.2f} GiB over the NIC)" for ph, v, nic in a2a))
        facts["alternatives"].append({"name": name, "strategy": r["strategy"],
                                      "step_rel": d_step, "memory_gib_delta": d_mem,
                                      "step_parts_s": dict(parts),
                                      "all_to_all_s": {ph: v for ph, v, _ in a2a}})
    if job.cluster.gpu.arch in ("hopper", "blackwell"):  # GPUs with FP8 tensor cores
        from amsp_planner.report.fp8_sensitivity import fp8_crossover, fp8_lines

        facts["fp8"] = fp8_crossover(job, e.strategy)
        lines += fp8_lines(facts["fp8"], job)
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
    pp = kw.get("pp", 1)
    if given or resolved != chosen or pp > 1:
        why = (f"the plan evaluates the given strategy {given}" if given else
               f"re-solving the plan's inputs picks {resolved or 'nothing'}, not the plan's "
               "strategy (a plan from another amsp version?)" if resolved != chosen else
               f"each re-solve of a --pp {pp} plan enumerates every stage strategy (tens of "
               "seconds); scan one assumption with amsp whatif --set instead")
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


