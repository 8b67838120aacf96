"""amsp export: a plan in another trainer's format (DeepSpeed, FSDP2, torchtitan, InternEvo).

    amsp export plan.json --to deepspeed -o ds_config.json
"""

from __future__ import annotations

import click

TARGET_CHOICES = ("deepspeed", "fsdp2", "torchtitan", "internevo")


def summary_lines(result, out_name: str | None) -> list[str]:
    """What the user reads: where it went, exact or not, the differences and caveats."""
    where = f"wrote {out_name}" if out_name else f"{result.target} config"
    if result.exact:
        lines = [f"{where} ({result.target}): expresses the plan exactly ({result.closest})"]
    else:
        lines = [f"{where} ({result.target}): the plan is not expressible in {result.target}; "
                 f"closest expressible strategy: {result.closest}"]
        lines += [f"  differs: {d}" for d in result.differences]
    lines += [f"  note: {n}" for n in result.notes]
    return lines


def run_check(target: str, result, job) -> str:
    """The target's own parser/config classes on what we wrote; one line saying what passed."""
    from amsp_planner.errors import AmspUserError

    try:
        if target == "deepspeed":
            import json

            from amsp_planner.exports.deepspeed import parse_with_deepspeed

            got = parse_with_deepspeed(json.loads(result.text), job.num_gpus)
            return f"check: DeepSpeedConfig/DeepSpeedZeroConfig accepted it: {got}"
        if target == "fsdp2":
            from amsp_planner.exports.fsdp2 import check_with_torch

            got = check_with_torch(result.text)
            return f"check: fully_shard applied it on a 1-rank CPU mesh: {got}"
        if target == "torchtitan":
            from amsp_planner.exports.torchtitan import check

            check(result.text, job.num_gpus)
            return "check: tomllib parsed it; fields match torchtitan's JobConfig"
        from amsp_planner.exports.internevo import check

        check(result.text, job.num_gpus, job.training.batch_seqs)
        return "check: exec'd it; InternEvo's data/model/parallel fields are consistent"
    except ImportError as e:
        raise AmspUserError(f"--check needs {e.name}: pip install -e '.[interop]' (DeepSpeed) "
                            "or '.[runtime]' (torch)") from None


@click.command()
@click.argument("plan_file", metavar="PLAN")
@click.option("--to", "target", required=True, type=click.Choice(TARGET_CHOICES),
              help="Target trainer.")
@click.option("-o", "--output", default=None,
              help="Write the file here (default: print it to stdout, the summary to stderr).")
@click.option("--check", "do_check", is_flag=True,
              help="Also parse the result with the target's own config classes (DeepSpeed, "
                   "FSDP2: needs them installed).")
def export(plan_file, target, output, do_check):
    """Export a plan's strategy to DeepSpeed, FSDP2, torchtitan or InternEvo.

    When the target cannot express the plan, exports the strategy the cost model rates best among
    those it can, and says what differs and what it costs.
    """
    from pathlib import Path

    from amsp_planner.exports import export as do_export
    from amsp_planner.plan import load_plan

    plan = load_plan(plan_file)
    result = do_export(target, plan.job, plan.strategy, plan.memory_limit)
    lines = summary_lines(result, output)
    if do_check:
        lines.append(run_check(target, result, plan.job))
    if output is None:
        click.echo(result.text, nl=False)
        for line in lines:
            click.echo(line, err=True)
        return
    try:
        Path(output).write_text(result.text)
    except OSError as e:
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(f"-o {output}: cannot write it ({e.strerror}): check the path") from None
    for line in lines:
        click.echo(line)
