"""amsp plan: the best sharding for a job, written as a plan file.

    amsp plan --model llama-7b --gpus 1024
"""

from __future__ import annotations

import functools
import time

import click

from amsp_planner.cli import paths
from amsp_planner.cli.notes import note
from amsp_planner.cli.options import (
    SECONDS,
    build_job,
    build_preference,
    choice_options,
    ep_option,
    job_options,
    no_cyclic_gc,
    parse_ep,
    parse_pp,
    parse_tp,
    pp_option,
    tp_option,
)
from amsp_planner.report.grid import format_option, pick_format


@click.command()
@job_options
@click.option("--strategy", "-s", default=None,
              help="Evaluate this strategy instead of searching (string form or baseline name).")
@click.option("--strategy-from", "strategy_from", default=None, type=paths.Path(dir_okay=False),
              help="Evaluate the strategy of a DeepSpeed ds_config.json instead of searching.")
@click.option("--objective", type=click.Choice(["time", "comm"]), default="time",
              show_default=True, help="Minimise step time, or total communication time.")
@click.option("--solver", type=click.Choice(["highs", "cbc", "exhaustive"]), default="highs",
              show_default=True, help="The ILP on HiGHS or CBC, or the exact enumeration over "
              "the ILP's tables (docs/planner.md).")
@click.option("--time-limit", type=SECONDS, default=30.0, show_default=True,
              help="Solver time limit in seconds.")
@click.option("--no-zeropp", is_flag=True, help="Search without qwZ, hpZ and qgZ.")
@tp_option
@pp_option
@ep_option
@choice_options
@click.option("--runners-up", type=click.IntRange(0, 20), default=0, show_default=True,
              help="Also list the next N candidates by step time.")
@click.option("-o", "--output", default="plan.json", show_default=True,
              help="Plan file to write ('-' for none).")
@format_option
def plan(**kw):
    """Find the best strategy for a job and write the plan file.

    --format json prints the plan file's JSON; csv the chosen, runners-up and baselines rows.
    """
    with no_cyclic_gc():
        _plan(**kw)


def _is_plan_file(path) -> bool:
    from amsp_planner.plan import is_plan_file  # imported only when the file exists

    return is_plan_file(path)


def _import_output(fmt: str) -> None:
    """The modules that write the plan and its report (about 0.08 s of imports: pydantic's
    plan models, rich), imported while the ILP's solver threads solve (``solve(idle=...)``;
    report.grid is imported with this module)."""
    import amsp_planner.plan  # noqa: F401

    if fmt != "json":
        import rich.console  # noqa: F401
        import rich.table  # noqa: F401

        import amsp_planner.report.plan_report
        import amsp_planner.report.tables  # noqa: F401


def _plan(strategy, strategy_from, objective, solver, time_limit, no_zeropp, runners_up, output,
          fmt, as_json, wide, headroom, quantization, tie_band, prefer, tp, ep, pp, **opts):
    from amsp_planner.cost.evaluate import (
        as_priced,
        best_baseline,
        engine_runs,
        evaluate,
        evaluate_baselines,
    )
    from amsp_planner.strategy import parse_strategy_or_baseline

    t0 = time.perf_counter()
    fmt = pick_format(fmt, as_json)
    if output != "-":  # an unwritable or wrong -o is refused before the search, not after
        from amsp_planner.outfile import check_output

        check_output(output, "-o", "an amsp plan", _is_plan_file)
    tp, ep, pp = parse_tp(tp), parse_ep(ep), parse_pp(pp)
    job, limit = build_job(**opts, pp=pp, given=strategy)
    if ep is not None and (strategy is not None or strategy_from is not None
                           or not job.model.is_moe):
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(f"--ep {ep}: " + ("the given strategy fixes it: write ep=E in the "
                            "strategy string or drop --ep" if job.model.is_moe else
                            f"{job.model.name} has no routed experts: drop --ep"))
    pref = build_preference(headroom, quantization, tie_band, job=job, prefer=prefer)
    if tp is not None and (strategy is not None or strategy_from is not None):
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(f"--tp {tp}: the given strategy fixes the tensor-parallel degree: "
                            "write tp=T in the strategy string (e.g. tp=8,p=8,g=8,os=8) or drop "
                            "--tp")
    if pp != 1 and (strategy is not None or strategy_from is not None):
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(f"--pp {pp}: the given strategy fixes the pipeline degree: write "
                            "pp=P in the strategy string (e.g. tp=8,pp=4,p=1,g=1,os=8) or drop --pp")
    if strategy is not None and strategy_from is not None:
        from amsp_planner.errors import AmspUserError

        raise AmspUserError("give --strategy or --strategy-from, not both")
    if strategy is not None and opts.get("activation_checkpointing", "auto") != "auto":
        from amsp_planner.errors import AmspUserError

        raise AmspUserError(f"--activation-checkpointing {opts['activation_checkpointing']}: "
                            f"--strategy {strategy} fixes the strategy, its checkpointing "
                            "included: write ckpt, ckpt=K or ckpt=op in a strategy string "
                            "(e.g. p=8,g=8,os=8,ckpt=12) or drop the option")
    if strategy is not None and opts.get("micro_batch") is not None:
        from amsp_planner.strategy_baselines import with_micro_batch

        strategy = with_micro_batch(strategy, opts["micro_batch"])
    if strategy is None and strategy_from is None:
        job.profile.check_ckpt(job.training.activation_checkpointing,
                               opts.get("activation_checkpointing"), job.model.num_layers)
    if strategy is not None or strategy_from is not None:
        if strategy_from is not None:
            from amsp_planner.exports.deepspeed import strategy_for_job
            from amsp_planner.strategy_baselines import check_ds_micro_batch

            s = strategy_for_job(strategy_from, job)
            check_ds_micro_batch(s, opts.get("micro_batch"), strategy_from)
            strategy = str(s)
        else:
            s = parse_strategy_or_baseline(strategy, job.num_gpus, job.gpus_per_node)
        if s.grad_accum is not None:  # checked against the batch, then the job's to derive:
            job.n_micro(s)  # the plan file writes the accumulation in decision.grad_accum
            s = s.with_(grad_accum=None)
        s = as_priced(job, s)  # --fp8-all-gather on: written with its fp8ag
        best = evaluate(job, s, limit)
        why = engine_runs(job, s)
        if why:
            note(f"{job.profile.title} does not run {s} ({why}): priced as given; `amsp export` "
                 "translates it to the closest strategy the engine runs", kind="warning")
        from amsp_planner.errors import AmspUserError

        try:
            baselines = evaluate_baselines(job, limit, s.micro_batch, s.ckpt_value, s.tp, s.cp)
        except AmspUserError as e:  # a pipeline's batch may not divide over pp=1's ranks
            if s.pp == 1:
                raise
            baselines = {}
            note(f"named baselines (pp=1) not priced: {e}")
        best_bl = best_baseline(baselines)
        runners, solver_info, solve_s, refs = [], None, 0.0, {}
    else:  # the ILP, or with pp > 1 the pipeline search (solver/pipeline_search.py)
        from amsp_planner.solver import solve

        r = solve(job, limit, objective=objective, solver=solver, zeropp=not no_zeropp,
                  runners_up=runners_up, time_limit_s=time_limit, preference=pref, tp=tp,
                  idle=functools.partial(_import_output, fmt), ep=ep, pp=pp)
        best, runners, baselines, best_bl = r.best, r.runners_up, r.baselines, r.best_baseline
        refs = {k: v for k, v in (("fastest", r.fastest), ("fastest_lossless", r.fastest_lossless))
                if v is not None}
        for said in r.notes:  # e.g. a solver fallback, the named baselines not priced at pp=1
            note(said)
        st = r.stats
        solver_info = None if pp > 1 else {
            "name": st.solver, "status": st.status, "objective": objective,
            "num_variables": st.num_variables, "num_constraints": st.num_constraints,
            "solves": st.solves}
        solve_s = st.solve_time_s
    search = {"zeropp": not no_zeropp, "micro_batch": job.training.micro_batch,
              "activation_checkpointing": job.training.activation_checkpointing,
              "given_strategy": strategy, "preference": pref.to_dict(),
              **({"tp": tp} if tp is not None else {}),
              **({"pp": pp} if pp > 1 else {}),
              **({"ep": ep} if ep is not None else {})}
    from amsp_planner.plan import build_doc, canonical_text, write_plan

    doc = build_doc(job, best, runners_up=runners, baselines=baselines, solver=solver_info,
                    objective=objective, search=search, solve_time_s=solve_s,
                    build_time_s=time.perf_counter() - t0, references=refs)
    written = None
    if output != "-":
        written = write_plan(output, doc)
    if fmt == "json":
        click.echo(canonical_text(doc), nl=False)
        return
    from amsp_planner.cost.fp8_notes import precision_label
    from amsp_planner.report.grid import emit
    from amsp_planner.report.plan_report import components_grid, time_lines
    from amsp_planner.report.tables import (
        compare_grid,
        engine_line,
        inapplicable_line,
        memory_grid,
        schedule_grid,
    )

    m, t = job.model, job.training
    out: list = [f"{m.name} ({m.num_params / 1e9:.2f}B params) on {job.num_gpus} GPUs of "
                 f"{job.cluster.name}: {t.batch_tokens:,} tokens/step, seq {t.seq_len}, "
                 f"{precision_label(job)}; {engine_line(job)}"]
    if t.precision == "fp8":
        from amsp_planner.cost.fp8 import GATHER_ONLY, grid_note
        from amsp_planner.cost.fp8_notes import priced_note

        if job.engine in GATHER_ONLY or job.model.is_moe:
            out.append(priced_note(job.engine, job.model.is_moe, t.fp8_recipe))
        if grid := grid_note(job):
            out.append(grid)
    if best.strategy.tp > 1:
        out.append(tp_line(job, best))
    if job.model.is_moe:
        out.append(ep_line(job, best))
    if not best.fits:
        out.append(f"WARNING: the given strategy does not fit: {best.memory.total / 2**30:.2f} "
                   f"GiB > {limit / 2**30:.2f} GiB per GPU")
    out += [components_grid(best, job.gpus_per_node), memory_grid(best, job),
            schedule_grid(best, job)]
    out += time_lines(best, best_bl, job, pref, refs)
    rows = [("chosen", best)] + [(k.replace("_", " "), e) for k, e in refs.items()
                                 if str(e.strategy) != str(best.strategy)]
    rows += [(f"next {i + 1}", e) for i, e in enumerate(runners)]
    rows += list(baselines.items())
    table = compare_grid(rows, "chosen, fastest candidates and named baselines", ref=best,
                         band=pref.band, job=job)
    out.append(table)
    skipped = inapplicable_line(job, best.strategy.tp, best.strategy.ckpt_value)
    if skipped:
        out.append(skipped)
    if solver_info:
        out.append(f"solver: {solver_info['name']} {solver_info['status']}, "
                   f"{solver_info['num_variables']} variables, {solver_info['num_constraints']} "
                   f"constraints, {solver_info['solves']} solves in {solve_s:.3f} s")
    if written:
        out.append(f"wrote {written}")
    emit(out, fmt, wide, csv_of=table)


def ep_line(job, e) -> str:
    """One line on where a mixture of experts' routed experts go (docs/moe.md)."""
    s = e.strategy
    lay = s.expert_layout(job.num_gpus, job.gpus_per_node)
    where = ("strided across the nodes" if s.ep_span else
             "consecutive ranks, inside each node" if lay.ep_size <= job.gpus_per_node
             else "consecutive ranks over whole nodes")
    trip = "/".join(str(s.expert_factor(c)) for c in ("p", "g", "os"))
    return (f"experts: e={s.ep} ({job.model.num_experts // s.ep} of {job.model.num_experts} "
            f"routed experts per rank, EP group {where}); dense p/g/os = {s.s_p}/{s.s_g}/"
            f"{s.s_os} over {job.num_gpus} ranks, expert p/g/os = {trip} over the "
            f"{lay.edp_size} ranks holding the same experts; all-to-alls "
            f"{e.time.ep_comm_s:.3f} s/step on the critical path")


def tp_line(job, e) -> str:
    """One line on the tensor parallelism of a strategy (t > 1)."""
    t = e.strategy.tp
    return (f"tensor parallel: tp={t} inside each node (ranks t*d .. t*d+{t - 1} form TP group "
            f"d), x {job.num_gpus // t} data-parallel ranks over which p/g/os shard; TP "
            f"collectives {e.time.tp_comm_s:.3f} s/step on the critical path")
