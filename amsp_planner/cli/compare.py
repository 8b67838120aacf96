"""amsp compare: the named baselines (and given strategies) side by side.

    amsp compare --model llama-7b --gpus 1024
"""

from __future__ import annotations

import click

from amsp_planner.cli.options import build_job, job_options
from amsp_planner.report.grid import format_option, pick_format


@click.command()
@job_options
@click.option("--strategy", "-s", "strategies", multiple=True,
              help="Also evaluate this strategy, e.g. 'p=1,g=1,os=8,mb=1' (repeatable).")
@click.option("--strategy-from", "strategy_from", default=None, metavar="DS_CONFIG",
              help="Also evaluate the strategy a DeepSpeed ds_config.json runs (row 'ds_config').")
@click.option("--tp", "tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel degree inside the node of the baselines (their sharding is "
                   "over the GPUs / tp data-parallel ranks).")
@format_option
def compare(strategies, strategy_from, fmt, as_json, wide, tp, **opts):
    """Predict memory, bytes and step time of the named baselines for one job."""
    from amsp_planner.cost.evaluate import evaluate, evaluate_baselines
    from amsp_planner.solver.space import tp_choices
    from amsp_planner.strategy import parse_strategy_or_baseline

    fmt = pick_format(fmt, as_json)
    job, limit = build_job(**opts)
    if tp > 1:
        tp_choices(job, tp, auto=False)  # one line naming --tp and the degrees that work
    t = job.training
    mb = t.micro_batch or 1
    ckpt = t.activation_checkpointing or False
    rows = list(evaluate_baselines(job, limit, mb, ckpt, tp).items())
    for text in strategies:
        s = parse_strategy_or_baseline(text, job.num_gpus, job.gpus_per_node)
        rows.append(("given", evaluate(job, s, limit)))
    if strategy_from is not None:
        from amsp_planner.exports.deepspeed import strategy_for_job

        rows.append(("ds_config", evaluate(job, strategy_for_job(strategy_from, job), limit)))
    hint = None
    if not any(e.fits for _, e in rows):
        from amsp_planner.report.tables import fit_hint

        hint = fit_hint(job, limit, mb, ckpt, tp)
    if fmt == "json":
        import json

        doc = {
            "model": job.model.name, "cluster": job.cluster.name, "gpus": job.num_gpus,
            "params": job.model.num_params, "padded_params": job.phi,
            "batch_tokens": t.batch_tokens, "seq_len": t.seq_len,
            "rows": [{"name": n, **e.to_dict()} for n, e in rows],
            "hint": hint,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    from amsp_planner.report.grid import emit
    from amsp_planner.report.tables import compare_grid, inapplicable_line

    title = (f"{job.model.name} ({job.model.num_params / 1e9:.2f}B) on {job.num_gpus} GPUs of "
             f"{job.cluster.name}, {t.batch_tokens:,} tokens/step, seq {t.seq_len}"
             + (f", tp={tp} x {job.num_gpus // tp} data-parallel ranks" if tp > 1 else ""))
    fitting = [e for _, e in rows if e.fits]
    ref = min(fitting, key=lambda e: e.step_s) if fitting else None
    out = [compare_grid(rows, title, ref=ref)]
    skipped = inapplicable_line(job, tp)
    if skipped:
        out.append(skipped)
    if hint:
        out.append(hint)
    emit(out, fmt, wide)
