"""amsp explain: why a plan chose what it chose.

    amsp explain plan.json
"""

from __future__ import annotations

import click


@click.command()
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def explain(plan_file, as_json):
    """The binding constraint, the marginal value of memory, runners-up, baselines, and the phase
    that dominates exposed communication."""
    from amsp_planner.plan import load_plan
    from amsp_planner.report.explain import explain_plan

    p = load_plan(plan_file)
    facts = explain_plan(p)
    if as_json:
        import json

        click.echo(json.dumps(facts, indent=2))
        return
    for line in facts["lines"]:
        click.echo(line)
