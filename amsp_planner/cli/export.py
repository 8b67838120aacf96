"""amsp export: a plan in another trainer's format (DeepSpeed, FSDP2, torchtitan, InternEvo,
Megatron-Core).

    amsp export plan.json --to deepspeed -o ds_config.json
"""

from __future__ import annotations

import click

TARGET_CHOICES = ("deepspeed", "fsdp2", "torchtitan", "internevo", "megatron")


def summary_lines(result, out_name: str | None) -> list[str]:
    """What the user reads: where it went, exact or not, what changes and what it costs, the
    caveats. The changes are one line (every changed knob and engine behaviour), the cost one
    more."""
    where = f"wrote {out_name}" if out_name else f"{result.target} config"
    if result.exact:
        lines = [f"{where} ({result.target}): expresses the plan exactly ({result.closest})"]
    else:
        lines = [f"{where} ({result.target}): the plan is not expressible in {result.target}; "
                 f"closest expressible strategy: {result.closest}"]
    if result.differences:
        *changes, cost = result.differences
        lines += [f"  differs: {'; '.join(changes)}", f"  costs: {cost}"]
    lines += [f"  note: {n}" for n in result.notes]
    return lines


def plan_command(plan, engine: str) -> str:
    """`amsp plan` for the plan's job on `engine`: the model and cluster by preset name when the
    plan holds the preset as it is, else a placeholder for the spec file."""
    from amsp_planner.errors import AmspUserError
    from amsp_planner.specs import load_cluster, load_model

    j, t = plan.job, plan.job.training

    def preset(load, spec, what):
        try:
            same = load(spec.name) == spec
        except AmspUserError:
            same = False
        return spec.name if same else f"<the plan's {what} spec>"

    limit = plan.memory_limit / 2**30
    return (f"amsp plan --model {preset(load_model, j.model, 'model')} --gpus {j.num_gpus} "
            f"--cluster {preset(load_cluster, j.cluster, 'cluster')} --seq-len {t.seq_len} "
            f"--global-batch-seqs {t.batch_seqs}"
            + (f" --memory-limit {limit:g}" if plan.memory_limit != j.cluster.memory_bytes
               else "") + f" --engine {engine}"
            + (f" --precision fp8 --fp8-recipe {t.fp8_recipe}" if t.precision == "fp8"
               and t.fp8_recipe else f" --precision {t.precision}" if t.precision != "bf16"
               else ""))


def engine_note(plan, target: str, result) -> str | None:
    """When the plan was made for another engine: the target engine's own plan (the planner's
    rule on the job as the target runs it) against the exported strategy; a line saying how
    much faster it is and the command that makes it, when that is beyond the step-time band.
    None when the plan was made for the target, or the export is within the band of it."""
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.errors import InfeasibleError
    from amsp_planner.solver import solve
    from amsp_planner.solver.space import Preference

    if plan.job.engine == target:
        return None
    from amsp_planner.exports.fp8 import pin_recipe

    tjob = pin_recipe(plan.job).for_engine(target)  # an FP8 plan's recipe, not the target's
    pref = Preference.default()
    try:
        own = solve(tjob, plan.memory_limit, runners_up=0, preference=pref).best
    except InfeasibleError:
        return None
    own_s, own_step = own.strategy, own.step_s
    if tjob.model.is_moe:  # the solver's space spells expert triples the target may not run:
        # compare with the closest it runs (exports/moe.py), which is what an export would write
        from amsp_planner.exports.common import closest_expressible, expressible

        own_s, _, _, ev = closest_expressible(tjob, own_s, expressible(tjob, own_s),
                                              plan.memory_limit, target)
        own_step = ev.step_s
    got = evaluate(tjob, result.closest, plan.memory_limit)
    gain = got.step_s / own_step - 1
    if gain <= pref.band:
        return None
    cmd = plan_command(plan, target)
    return (f"the plan was made for {plan.job.engine}: {target}'s own best plan "
            f"({own_s.with_(grad_accum=None)}) is {gain * 100:.0f}% faster than this "
            f"export, beyond the +/-{pref.band * 100:.0f} % band: run `{cmd}` and export that")


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
            import importlib.util

            from amsp_planner.exports.fsdp2_check import check_in_child

            if importlib.util.find_spec("torch") is None:
                raise ImportError(name="torch")
            if job.training.precision == "fp8" and importlib.util.find_spec("torchao") is None:
                raise ImportError(name="torchao")  # convert_fp8 (exports/fp8.py)
            try:
                got = check_in_child(result.text)
            except RuntimeError as e:
                raise AmspUserError(f"--check: {e}") from None
            return f"check: fully_shard applied it on a 1-rank CPU mesh: {got}"
        if target == "torchtitan":
            from amsp_planner.exports.torchtitan import check, check_with_torchtitan

            want = check(result.text, job.num_gpus)
            got = check_with_torchtitan(result.text)
            if got != want:
                raise AmspUserError(f"--check: torchtitan parsed {got}, the export says {want}")
            return ("check: torchtitan's ConfigManager parsed the overrides onto "
                    "llama3_debugmodel; every field holds the value written")
        if target == "megatron":
            from amsp_planner.exports.megatron import check as megatron_check

            got = megatron_check(result.text, job.num_gpus, job.training.batch_seqs)
            return f"check: parsed the arguments back; they are consistent: {got}"
        from amsp_planner.exports.internevo import check

        check(result.text, job.num_gpus, job.training.batch_seqs)
        return "check: exec'd it; InternEvo's data/model/parallel fields are consistent"
    except ImportError as e:
        if e.name == "torchao":
            raise AmspUserError("--check needs torchao for an FP8 plan's conversion: pip install "
                                "torchao") from None
        raise AmspUserError(f"--check needs {e.name}: pip install -e '.[interop]' (DeepSpeed, "
                            "torchtitan) or '.[runtime]' (torch)") from None
    except ValueError as e:  # the target's own parser refused what we wrote: a bug here
        raise AmspUserError(f"--check: {e}") from None


def earlier_export(target: str, text: str):
    """Recognises a file this export may replace: an earlier export to the same target. A
    DeepSpeed config has no room for a marker, so an earlier one is a JSON object with only the
    top-level keys the export writes (a ds_config of your own has others: optimizer, "auto"...)."""
    from amsp_planner.outfile import contains

    if target != "deepspeed":
        return contains(f"Generated by `amsp export --to {target}`")
    import json

    keys = set(json.loads(text))

    def earlier(path) -> bool:
        from amsp_planner.errors import AmspUserError
        from amsp_planner.textfile import BadContent, parse, read_text

        try:
            doc = parse(read_text(path), "json")
        except (AmspUserError, BadContent):
            return False
        return isinstance(doc, dict) and "zero_optimization" in doc and set(doc) <= keys \
            and "auto" not in json.dumps(doc)

    return earlier


@click.command()
@click.argument("plan_file", metavar="PLAN")
@click.option("--to", "target", required=True, type=click.Choice(TARGET_CHOICES),
              help="Target trainer.")
@click.option("-o", "--output", default=None,
              help="Write the file here (default, or '-': print it to stdout, the summary to "
                   "stderr).")
@click.option("--check", "do_check", is_flag=True,
              help="Also parse the result with the target's own config classes (DeepSpeed, "
                   "FSDP2: needs them installed).")
def export(plan_file, target, output, do_check):
    """Export a plan's strategy to DeepSpeed, FSDP2, torchtitan, InternEvo or Megatron-Core.

    When the target cannot express the plan, exports the strategy the cost model rates best among
    those it can, and says what differs and what it costs.
    """

    from amsp_planner.exports import export as do_export
    from amsp_planner.plan import load_plan

    if output == "-":  # stdout, as `amsp plan -o -`
        output = None
    from amsp_planner.errors import AmspUserError, in_context

    plan = load_plan(plan_file)
    try:
        result = do_export(target, plan.job, plan.strategy, plan.memory_limit)
    except AmspUserError as e:
        raise in_context(e, f"--to {target}: this {plan.job.engine} plan ({plan.strategy}) "
                            "cannot be exported as made", "--to") from None
    lines = summary_lines(result, output)
    better = engine_note(plan, target, result)
    if better:
        lines.append(f"  note: {better}")
    from amsp_planner.cost.fp8 import GATHER_ONLY
    from amsp_planner.cost.fp8_notes import precision_label

    j = plan.job
    if j.training.precision == "fp8" and j.engine in GATHER_ONLY and target not in GATHER_ONLY:
        lines.append(f"  note: the plan priced its matmuls in bf16 ({j.engine}'s FP8 is its "
                     f"all-gathers); {target} runs the blocks' linears in "
                     f"{precision_label(j)}, which the costs above price")
    if do_check:
        lines.append(run_check(target, result, plan.job))
    if output is None:
        click.echo(result.text, nl=False)
        for line in lines:
            click.echo(line, err=True)
        return
    from amsp_planner.outfile import write_output

    what = f"an earlier `amsp export --to {target}` output (a config of your own?)"
    write_output(output, "-o", what, earlier_export(target, result.text), result.text)
    for line in lines:
        click.echo(line)
