"""amsp explain: why a plan chose what it chose, and how robust the choice is.

    amsp explain plan.json
    amsp explain plan.json --no-sensitivity     # skip the re-solves of the sensitivity
"""

from __future__ import annotations

import click


@click.command()
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-sensitivity", is_flag=True,
              help="Skip the equivalent candidates and the sensitivity of the choice to each "
                   "assumption (they re-solve the plan several dozen times).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes for the sensitivity's re-solves (default: one per core, at most 8).")
def explain(plan_file, as_json, no_sensitivity, workers):
    """The binding constraint, the marginal value of memory, runners-up, baselines, the phase
    that dominates exposed communication, the candidates the step-time model cannot tell apart,
    and the value of each assumption (comm/compute slowdown, inter-node bandwidth, compute
    efficiency, memory limit) at which the choice would change."""
    from amsp_planner.plan import load_plan
    from amsp_planner.report.explain import explain_plan

    p = load_plan(plan_file)
    facts = explain_plan(p, sensitivity=not no_sensitivity,
                         progress=lambda line: click.echo(line, err=True), workers=workers)
    if as_json:
        import json

        click.echo(json.dumps(facts, indent=2))
        return
    for line in facts["lines"]:
        click.echo(line)
