"""Why a plan: re-solve around it to find what binds and what the alternatives cost."""

from __future__ import annotations

from amsp_planner.report.fmt import gib, secs

GIB = 1024**3


def _diff(a, b) -> str:
    """What differs between two strategies, in words."""
    out = []
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
              ("exposed backward", "exposed_backward_s"), ("exposed update", "exposed_update_s"))


def step_differences(chosen, other, threshold: float = 0.002) -> list[tuple[str, float]]:
    """The parts of the step (other minus chosen, seconds) that make the difference, largest
    first: each part whose change is at least `threshold` of the chosen step."""
    out = []
    for name, field in STEP_PARTS:
        d = getattr(other.time, field) - getattr(chosen.time, field)
        if abs(d) >= threshold * chosen.step_s:
            out.append((name, d))
    return sorted(out, key=lambda kv: -abs(kv[1]))


def explain_plan(p) -> dict:
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.errors import InfeasibleError
    from amsp_planner.solver import solve
    from amsp_planner.strategy import Strategy

    job, e, limit = p.job, p.evaluation, p.memory_limit
    doc = p.doc
    search = doc["inputs"].get("search", {})
    kw = {"objective": doc["inputs"].get("objective", "time"),
          "zeropp": search.get("zeropp", True), "runners_up": 0}
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
                 f"{secs(t.contention_s)} + exposed communication {secs(t.exposed_comm_s)}; most "
                 f"exposed: {top} ({secs(phases[top])})")
    if e.schedule:
        big = max(e.schedule, key=lambda s: s.time_s)
        lines.append(f"largest collective: {big.phase} {big.op} over {big.group} "
                     f"(size {big.group_size}, stride {big.stride}): {secs(big.time_s)} per step")
    mem = e.memory
    terms = {k: getattr(mem, k) for k in ("params", "grads", "optimizer", "hpz", "activations")}
    top_mem = max(terms, key=terms.get)
    lines.append(f"largest memory term: {top_mem} ({gib(terms[top_mem])} GiB)")

    # alternatives
    alts = []
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
    facts["lines"] = lines
    return facts
