"""amsp validate / amsp schema: check a plan file; print the plan JSON Schema.

    amsp validate plan.json
"""

from __future__ import annotations

import click

from amsp_planner.cli import paths


@click.command()
@click.argument("plan_file", type=paths.Path(dir_okay=False))
def validate(plan_file):
    """Check a plan: JSON, format, version, schema, hashes, and the cost model's agreement."""
    from amsp_planner.plan import load_plan

    p = load_plan(plan_file)
    e = p.evaluation
    click.echo(f"{plan_file}: valid amsp plan v{p.doc['version']}: {p.job.model.name} on "
               f"{p.job.num_gpus} GPUs of {p.job.cluster.name}, strategy {e.strategy}, "
               f"{len(e.schedule)} schedule entries, step {e.step_s:.4f} s")


@click.command()
def schema():
    """Print the JSON Schema of plan files."""
    import json

    from amsp_planner.plan import json_schema

    click.echo(json.dumps(json_schema(), indent=2))
