"""amsp explain: why a plan chose what it chose, and how robust the choice is.

    amsp explain plan.json
    amsp explain plan.json --no-sensitivity     # skip the re-solves of the sensitivity
    amsp explain plan.json --engine deepspeed     # as DeepSpeed would run it
"""

from __future__ import annotations

import click

from amsp_planner.cli import paths
from amsp_planner.engines import ENGINES


@click.command()
@click.argument("plan_file", type=paths.Path(dir_okay=False))
@click.option("--engine", type=click.Choice(ENGINES), default=None,
              help="Explain the plan as this engine runs it: what changes, what it costs, then "
                   "the explanation on that engine (default: the engine the plan was made for).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-sensitivity", is_flag=True,
              help="Skip the equivalent candidates and the sensitivity of the choice to each "
                   "assumption (they re-solve the plan several dozen times).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes for the sensitivity's re-solves (default: one per core, at most 8).")
def explain(plan_file, engine, as_json, no_sensitivity, workers):
    """The binding constraint, the marginal value of memory, runners-up, baselines, the phase
    that dominates exposed communication, the candidates the step-time model cannot tell apart,
    and the value of each assumption (comm/compute slowdown, inter-node bandwidth, compute
    efficiency, memory limit) at which the choice would change."""
    import dataclasses

    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.plan import load_plan
    from amsp_planner.report.explain import explain_plan

    p = load_plan(plan_file)
    made_for = p.job.engine
    head, changes = [], []
    if engine is not None and engine != made_for:
        from amsp_planner.errors import AmspUserError, in_context
        from amsp_planner.exports import TARGETS, target_module
        from amsp_planner.exports.common import translate

        why = target_module(engine).WHY if engine in TARGETS else None
        try:
            s, exact, tjob, changes = translate(p.job, p.strategy, engine, p.memory_limit, why)
        except AmspUserError as e:
            msg = str(e)
            if msg.startswith(f"--to {engine}: "):  # the export's wording of the same refusal
                e = AmspUserError(msg[len(f"--to {engine}: "):].replace(
                    ": use another target", ": explain it on another --engine"))
            raise in_context(e, f"--engine {engine}: this {made_for} plan ({p.strategy}) "
                                "cannot be priced on it as made", "--engine") from None
        how = "the plan's strategy" if exact else "the closest strategy it runs"
        head.append(f"engine: {engine} (the plan was made for {made_for}) runs {s}, {how}")
        if changes:
            *knobs, cost = changes
            head += [f"  differs: {'; '.join(knobs)}", f"  costs: {cost}"]
        # the search's pinned degrees follow the strategy the engine runs (its re-solves)
        search = dict(p.doc["inputs"].get("search", {}))
        search.update({k: getattr(s, k) for k in ("tp", "pp") if search.get(k) is not None})
        doc = {**p.doc, "inputs": {**p.doc["inputs"], "search": search}}
        p = dataclasses.replace(p, doc=doc, job=tjob, strategy=s,
                                evaluation=evaluate(tjob, s, p.memory_limit))
    elif made_for != "amsp":
        head.append(f"engine: {made_for}")
    facts = explain_plan(p, sensitivity=not no_sensitivity,
                         progress=lambda line: click.echo(line, err=True), workers=workers)
    facts.update(engine=p.job.engine, made_for=made_for, engine_changes=changes)
    facts["lines"] = head + facts["lines"]
    if as_json:
        import json

        click.echo(json.dumps(facts, indent=2))
        return
    for line in facts["lines"]:
        click.echo(line)
