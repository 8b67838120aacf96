"""amsp compare: the named baselines (and given strategies) side by side; with several
precisions (--precision bf16,fp8) the same job in each, row by row.

    amsp compare --model llama-7b --gpus 1024
    amsp compare --model llama3-8b --gpus 64 --cluster dgx-h100-ndr --engine torchtitan \\
        --precision bf16,fp8
"""

from __future__ import annotations

import click

from amsp_planner.cli.options import build_job, job_options
from amsp_planner.report.grid import format_option, pick_format


def _jobs(precisions: tuple[str, ...], opts: dict) -> dict:
    """{precision: (job, limit)}. FP8 built first, so that its one-line refusal (engine, GPU,
    recipe) comes before any note; each note printed once though every job repeats it. The
    FP8 options are passed to the FP8 job only when another precision is listed beside it."""
    import contextlib
    import io
    import sys

    if len(precisions) > 1 and "fp8" not in precisions:
        from amsp_planner.errors import AmspUserError

        for key, default in (("fp8_recipe", "auto"), ("fp8_all_gather", "auto")):
            if opts.get(key) not in (None, default):
                flag = "--" + key.replace("_", "-")
                raise AmspUserError(f"{flag} is set but --precision {','.join(precisions)} has no "
                                    f"fp8: add fp8 to the list, or drop {flag}")
    order = sorted(precisions, key=lambda p: p != "fp8")
    seen: set[str] = set()
    jobs = {}
    for p in order:
        o = dict(opts, precision=p)
        if p != "fp8" and "fp8" in precisions:
            o.update(fp8_recipe="auto", fp8_all_gather="auto")
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            jobs[p] = build_job(**o)
        for line in buf.getvalue().splitlines():
            if line not in seen:
                seen.add(line)
                print(line, file=sys.stderr)
    return {p: jobs[p] for p in precisions}


def _gain(a, b) -> float:
    """Tokens/s of evaluation b over a, as a fraction."""
    return a.step_s / b.step_s - 1


def precision_lines(by_prec: dict) -> list[str]:
    """Per precision after the first: its fastest fitting row against the first precision's,
    and the range of the same strategy's gain; what FP8 is priced on."""
    from amsp_planner.cost.fp8_notes import precision_label

    (job0, rows0), *rest = by_prec.values()
    out = []
    for job, rows in rest:  # the rows of every precision are the same strategies in order
        pairs = list(zip(rows0, rows, strict=True))  # the same strategies, fitting in both
        fitting = [p for p in pairs if p[0][1].fits and p[1][1].fits]
        same = [(n, _gain(e0, e)) for (n, e0), (_, e) in fitting or pairs]
        fit0 = [(n, e) for n, e in rows0 if e.fits]
        fit = [(n, e) for n, e in rows if e.fits]
        line = f"{precision_label(job)} vs {precision_label(job0)} on {job.engine}: "
        if fit0 and fit:
            (na, a), (nb, b) = (min(x, key=lambda ne: ne[1].step_s) for x in (fit0, fit))
            line += (f"fastest fitting {na} {a.step_s:.3f} s -> {nb} {b.step_s:.3f} s, "
                     f"tokens/s {_gain(a, b) * 100:+.1f}%")
        else:
            line += "no fitting row in " + precision_label(job if fit0 else job0)
        if same:
            lo, hi = min(same, key=lambda x: x[1]), max(same, key=lambda x: x[1])
            line += "; the same strategy" + ("" if fitting else ", none fitting in both")
            line += (f": {lo[1] * 100:+.1f}% ({lo[0]})" if lo is hi or len(same) == 1 else
                     f": {lo[1] * 100:+.1f}% ({lo[0]}) to {hi[1] * 100:+.1f}% ({hi[0]})")
        out.append(line)
    return out + fp8_notes([j for j, _ in by_prec.values()])


def fp8_notes(jobs) -> list[str]:
    """What the FP8 job's figures cover and the grid that prices its linears (none without
    an FP8 job)."""
    f8 = [j for j in jobs if j.training.precision == "fp8"]
    if not f8:
        return []
    from amsp_planner.cost.fp8 import grid_note
    from amsp_planner.cost.fp8_notes import priced_note

    j = f8[0]
    return [priced_note(j.engine, j.model.is_moe, j.training.fp8_recipe),
            *(n for n in map(grid_note, f8) if n)]


def _check_baseline_batch(job, tp: int, mb: int) -> None:
    """The named baselines run the job over N / tp data-parallel ranks: a global batch that
    does not divide over them is one line naming the --tp (if any) under which it would."""
    from amsp_planner.errors import AmspUserError

    b, n = job.training.batch_seqs, job.num_gpus
    if b % (n // tp * mb) == 0:
        return
    fits = [x for x in job.tp_options() if x > tp and b % (n // x * mb) == 0]
    from amsp_planner.cost.job import batch_source

    raise AmspUserError(
        f"global batch of {b:,} sequences ({batch_source(job.training)}): not a multiple of the "
        f"baselines' {n // tp} data-parallel "
        f"ranks x micro-batch {mb} (--tp {tp}): give "
        + (f"--tp {fits[0]} ({n // fits[0]} ranks), " if fits else "")
        + f"a global batch that is a multiple of {n // tp * mb} sequences, or fewer GPUs")


@click.command()
@job_options(precisions=True)
@click.option("--strategy", "-s", "strategies", multiple=True,
              help="Also evaluate this strategy, e.g. 'p=1,g=1,os=8,mb=1' (repeatable).")
@click.option("--strategy-from", "strategy_from", default=None, metavar="DS_CONFIG",
              help="Also evaluate the strategy a DeepSpeed ds_config.json runs (row 'ds_config').")
@click.option("--tp", "tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel degree inside the node of the baselines (their sharding is "
                   "over the GPUs / tp data-parallel ranks).")
@format_option
def compare(strategies, strategy_from, fmt, as_json, wide, tp, precision, **opts):
    """Predict memory, bytes and step time of the named baselines for one job."""
    from amsp_planner.cost.evaluate import as_priced, engine_runs, evaluate, evaluate_baselines
    from amsp_planner.solver.space import tp_choices
    from amsp_planner.strategy import parse_strategy_or_baseline

    fmt = pick_format(fmt, as_json)
    jobs = _jobs(precision, opts)
    job, limit = jobs[precision[0]]
    if tp > 1:
        tp_choices(job, tp, auto=False)  # one line naming --tp and the degrees that work
    t = job.training
    mb = t.micro_batch or 1
    ckpt = t.activation_checkpointing or False
    _check_baseline_batch(job, tp, mb)
    if t.micro_batch is not None:  # a given string without mb= takes --micro-batch
        from amsp_planner.strategy_baselines import with_micro_batch

        strategies = [with_micro_batch(x, t.micro_batch) for x in strategies]
    given = [parse_strategy_or_baseline(x, job.num_gpus, job.gpus_per_node) for x in strategies]
    if strategy_from is not None:
        from amsp_planner.exports.deepspeed import strategy_for_job
        from amsp_planner.strategy_baselines import check_ds_micro_batch

        ds = strategy_for_job(strategy_from, job)
        check_ds_micro_batch(ds, t.micro_batch, strategy_from)
    by_prec = {}
    for p, (j, lim) in jobs.items():
        rows = list(evaluate_baselines(j, lim, mb, ckpt, tp).items())
        keep = j.training.precision == "fp8" or "fp8" not in precision
        mine = [as_priced(j, s if keep else s.with_(fp8ag=False))
                for s in given]  # an FP8 gather is the FP8 rows' only; none: refused as plan does
        names = ["given"] if len(mine) == 1 else [f"given {i}" for i in range(1, len(mine) + 1)]
        rows += [(n if engine_runs(j, s) is None else f"{n}, not run by {j.engine}",
                  evaluate(j, s, lim)) for n, s in zip(names, mine, strict=True)]
        if strategy_from is not None:
            rows.append(("ds_config", evaluate(j, ds, lim)))
        by_prec[p] = (j, rows)
    multi = len(precision) > 1
    if multi:  # the same strategy's rows together, one per precision
        rows = [(f"{n} {p}", by_prec[p][1][i][1]) for i, (n, _) in enumerate(by_prec[precision[0]][1])
                for p in precision]
    else:
        rows = by_prec[precision[0]][1]
    hint = None
    if not any(e.fits for _, e in rows):
        from amsp_planner.report.tables import fit_hint

        hint = fit_hint(job, limit, mb, ckpt, tp)
    notes = precision_lines(by_prec) if multi else fp8_notes([job])
    from amsp_planner.cost.fp8_notes import precision_label
    if fmt == "json":
        import json

        doc = {
            "model": job.model.name, "cluster": job.cluster.name, "gpus": job.num_gpus,
            "engine": job.engine,
            "params": job.model.num_params, "padded_params": job.phi,
            "batch_tokens": t.batch_tokens, "seq_len": t.seq_len,
            "rows": [{"name": n, "precision": precision[0], **e.to_dict()} for n, e in rows],
            "hint": hint,
        }
        doc["precisions"] = [precision_label(by_prec[p][0]) for p in precision]
        doc["precision_notes"] = notes
        if multi:
            doc["rows"] = [{"name": n.rsplit(" ", 1)[0], "precision": n.rsplit(" ", 1)[1],
                            **e.to_dict()} for n, e in rows]
        click.echo(json.dumps(doc, indent=2))
        return
    from amsp_planner.report.grid import emit
    from amsp_planner.report.tables import compare_grid, inapplicable_line

    prec = (", " + " vs ".join(precision_label(by_prec[p][0]) for p in precision)
            if multi or t.precision != "bf16" else "")
    title = (f"{job.model.name} ({job.model.num_params / 1e9:.2f}B) on {job.num_gpus} GPUs of "
             f"{job.cluster.name}, {t.batch_tokens:,} tokens/step, seq {t.seq_len}{prec}"
             + (f", tp={tp} x {job.num_gpus // tp} data-parallel ranks" if tp > 1 else ""))
    fitting = [e for _, e in rows if e.fits]
    ref = min(fitting, key=lambda e: e.step_s) if fitting else None
    from amsp_planner.solver.space import validated_band

    # ties as the planner calls them: the job's validated relative band (docs/planner.md)
    out = [compare_grid(rows, title, ref=ref, band=validated_band(job), job=job,
                        by_identity=multi), *notes]
    skipped = inapplicable_line(job, tp, ckpt)
    if skipped:
        out.append(skipped)
    if hint:
        out.append(hint)
    emit(out, fmt, wide)
