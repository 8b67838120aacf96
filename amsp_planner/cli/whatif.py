"""amsp whatif: sweep jobs and cluster edits, solve the optimal plan at every point.

    amsp whatif --model llama-70b --gpus 256,512,1024,2048 --set nic_gbit_per_s=100,200,400 \
        --plot out.png

Comma lists sweep (their cartesian product). Each point is solved exactly as `amsp plan` would
solve it; points that are not valid jobs or on which nothing fits are rows marked so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from amsp_planner.ckpt_setting import ckpt_option
from amsp_planner.cli import paths
from amsp_planner.cli.options import SECONDS, choice_options, engine_option
from amsp_planner.errors import AmspUserError
from amsp_planner.report.grid import format_option
from amsp_planner.whatif_grid import MAX_POINTS, MAX_POINTS_CEILING, check_list_length


def split_list(text: str | None, conv, option: str) -> tuple:
    """'64,128' -> (64, 128) with `conv` per item; one clear error naming the option."""
    if text is None:
        return (None,)
    check_list_length(str(text), option)
    items = [t.strip() for t in str(text).split(",")]
    if not all(items):
        raise AmspUserError(f"{option} '{text}': an empty item: write values separated by commas")
    out = []
    for t in items:
        try:
            out.append(conv(t))
        except (ValueError, TypeError):
            raise AmspUserError(f"{option} '{t}': not a valid value: {conv.__doc__}") from None
    if len(set(out)) != len(out):
        raise AmspUserError(f"{option} '{text}': a value is given twice: give each once")
    return tuple(out)


def _pos_int(t: str, hi: int = 2**20) -> int:
    """write positive integers up to 1048576, e.g. 64,128"""
    v = int(t)
    if not 1 <= v <= hi:  # amsp plan's ranges of --gpus and --seq-len
        raise ValueError
    return v


def _batch_seqs(t: str) -> int:
    """write positive integers up to 2**40, e.g. 1024,2048"""
    return _pos_int(t, 2**40)


def _pos_float(t: str, hi: float = 1e6) -> float:
    """write positive numbers, e.g. 40,80"""
    v = float(t)
    if not 0 < v <= hi:  # nan compares false: refused too
        raise ValueError
    return v


def _memory_gib(t: str) -> float:
    """write GiB per GPU in (0, 4096], e.g. 40,80 (as --memory-limit of amsp plan)"""
    return _pos_float(t, 4096.0)


def _price(t: str) -> float:
    """write prices of one GPU-hour in (0, 1e6], e.g. 2.5"""
    return _pos_float(t, 1e6)


def _name(t: str) -> str:
    """write names separated by commas"""
    return t


def _batch(t: str) -> str:
    """write token counts with an optional K/M/G suffix, e.g. 4M,16M"""
    from amsp_planner.specs import parse_batch

    parse_batch(t)
    return t


def parse_set_lists(sets: tuple[str, ...]) -> tuple[tuple[str, tuple], ...]:
    """('nic_gbit_per_s=100,200',) -> (('nic_gbit_per_s', (100, 200)),)."""
    from amsp_planner.specs.loader import parse_value, split_set

    out = []
    for item in sets:
        key, value = split_set(item, "VALUE[,VALUE...]", "200,400")
        out.append((key, split_list(value, parse_value, f"--set {key}")))
    return tuple(out)


@click.command()
@click.option("--model", "-m", "models", required=True,
              help="Model presets or spec files, comma-separated (each is a series).")
@click.option("--gpus", "-n", required=True, help="GPU counts, comma-separated, e.g. 64,256,1024.")
@click.option("--cluster", "-c", "clusters", default=None,
              help="Cluster presets or spec files, comma-separated (default: dgx-a100-hdr).")
@click.option("--compare-clusters", default=None, metavar="A,B",
              help="Two or more clusters side by side for the same jobs (instead of --cluster).")
@click.option("--gpu-type", "gpu_types", default=None,
              help="GPU types to put in the cluster, comma-separated (a preset GPU name or a "
                   "unique prefix: a100-sxm4-40gb, h100, h200, v100).")
@click.option("--set", "sets", multiple=True, metavar="KEY=V1,V2",
              help="Edit a cluster field, sweeping its comma-separated values: gpus_per_node, "
                   "intra_gbyte_per_s, nics_per_node, nic_gbit_per_s, oversubscription, "
                   "gpu.memory_gib, ... Derived key node_gbit_per_s: NIC Gbit/s of a whole node, "
                   "spread evenly over its NICs (nic_gbit_per_s = node_gbit_per_s / "
                   "nics_per_node). Repeatable.")
@click.option("--seq-len", "seq_lens", default="4096", show_default=True,
              help="Tokens per sequence, comma-separated.")
@click.option("--global-batch", "global_batches", default=None,
              help="Global batch in tokens, comma-separated; K/M/G are powers of 2 (default 4M).")
@click.option("--global-batch-seqs", "global_batch_seqs", default=None,
              help="Global batch in sequences, comma-separated (instead of --global-batch).")
@click.option("--memory-limit", "memory_limits", default=None,
              help="Memory per GPU in GiB, comma-separated (default: the GPU's memory).")
@click.option("--micro-batch", type=click.IntRange(min=1), default=None,
              help="Pin sequences per GPU per micro-batch (default: searched).")
@click.option("--activation-checkpointing", metavar="auto|on|off|K|op|moe", default="auto",
              show_default=True)
@click.option("--no-flash-attention", is_flag=True, help="Count s^2 attention activations.")
@click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--grad-accum-dtype", type=click.Choice(["bf16", "fp32"]), default="bf16",
              show_default=True)
@click.option("--no-zeropp", is_flag=True, help="Search without qwZ, hpZ and qgZ.")
@choice_options
@engine_option
@click.option("--objective", type=click.Choice(["time", "comm"]), default="time",
              show_default=True)
@click.option("--solver", type=click.Choice(["highs", "cbc", "exhaustive"]), default="exhaustive",
              show_default=True, help="The exact enumeration over the ILP's tables (fast on many "
              "points), or the ILP on HiGHS or CBC: the same decisions (docs/planner.md).")
@click.option("--time-limit", type=SECONDS, default=30.0, show_default=True,
              help="Solver time limit per point, seconds.")
@click.option("--gpu-hour-price", default=None, metavar="USD[,USD...]",
              help="Price of one GPU-hour: one for all clusters, or one per cluster; adds "
                   "cost per billion tokens.")
@click.option("--csv", "csv_path", default=None, type=paths.Path(dir_okay=False),
              help="Write the rows as CSV.")
@click.option("--json", "json_path", default=None, type=paths.Path(dir_okay=False),
              help="Write the sweep and rows as JSON ('-': print it, as --format json does).")
@click.option("--plot", "plot_path", default=None, type=paths.Path(dir_okay=False),
              help="Write a PNG: MFU and tokens/s against the swept axis, strategy changes marked.")
@click.option("--x-axis", default=None,
              help="Axis of the plot (default: gpus if swept, else the first swept number).")
@format_option(json_flag=False)
@click.option("--workers", "-j", type=click.IntRange(min=1), default=None,
              help="Processes (default: the cores this process may use).")
@click.option("--max-points", type=click.IntRange(1, MAX_POINTS_CEILING), default=MAX_POINTS,
              show_default=True, help="Refuse a sweep of more points than this, before any work.")
@click.option("--progress/--no-progress", default=None,
              help="Show progress on stderr (default: on a terminal, for 8 points or more; "
                   "--progress off a terminal prints a line per tenth of the points).")
def whatif(models, gpus, clusters, compare_clusters, gpu_types, sets, seq_lens, global_batches,
           global_batch_seqs, memory_limits, micro_batch, activation_checkpointing,
           no_flash_attention, precision, grad_accum_dtype, no_zeropp, engine, objective, solver,
           time_limit, gpu_hour_price, csv_path, json_path, plot_path, x_axis, fmt, wide,
           workers, max_points, progress, headroom, quantization, tie_band, prefer):
    """Sweep GPU counts, models, clusters and cluster edits; the optimal plan at every point."""
    from amsp_planner import whatif as w
    from amsp_planner.report.grid import pick_format

    if json_path == "-":
        fmt = pick_format(fmt, True)
    from amsp_planner.report import whatif_report as rep

    check_output_paths(rep, {"--csv": csv_path, "--json": json_path, "--plot": plot_path})
    if compare_clusters and clusters:
        raise AmspUserError("give --cluster or --compare-clusters, not both")
    cl = split_list(compare_clusters or clusters, _name, "--compare-clusters"
                    if compare_clusters else "--cluster")
    if compare_clusters and len(cl) < 2:
        raise AmspUserError("--compare-clusters: give at least two clusters, e.g. A,B")
    if global_batches and global_batch_seqs:
        raise AmspUserError("give --global-batch or --global-batch-seqs, not both")
    batches = (split_list(global_batch_seqs, _batch_seqs, "--global-batch-seqs") if global_batch_seqs
               else split_list(global_batches, _batch, "--global-batch"))
    prices = ()
    if gpu_hour_price is not None:
        pv = split_list(gpu_hour_price, _price, "--gpu-hour-price")
        if len(pv) == 1:
            prices = ((None, pv[0]),)
        elif len(pv) == len(cl):
            prices = tuple(zip(cl, pv, strict=True))
        else:
            raise AmspUserError(f"--gpu-hour-price: give one price, or one per cluster "
                                f"({len(cl)}), got {len(pv)}")
    ckpt = ckpt_option(activation_checkpointing)
    from amsp_planner.engines import profile

    profile(engine).check_ckpt(ckpt, activation_checkpointing)
    opts = w.SolveOptions(micro_batch=micro_batch, activation_checkpointing=ckpt,
                          flash_attention=not no_flash_attention, precision=precision,
                          grad_accum_dtype=grad_accum_dtype, zeropp=not no_zeropp, engine=engine,
                          objective=objective, solver=solver, time_limit_s=time_limit,
                          gpu_hour_price=prices, headroom=headroom, quantization=quantization,
                          tie_band=tie_band, prefer=prefer)
    opts.preference()  # a bad --headroom / --tie-band is refused once, not at every point
    sweep = w.Sweep(
        models=split_list(models, _name, "--model"),
        gpus=split_list(gpus, _pos_int, "--gpus"),
        clusters=cl,
        gpu_types=split_list(gpu_types, _name, "--gpu-type"),
        sets=parse_set_lists(sets),
        seq_lens=split_list(seq_lens, _pos_int, "--seq-len"),
        global_batches=batches,
        memory_limits_gib=split_list(memory_limits, _memory_gib, "--memory-limit"),
        options=opts,
    )
    sweep.check_size(max_points)
    w.validate(sweep, max_points)
    from amsp_planner.cli.options import warn_seq_len
    from amsp_planner.specs import load_model

    for m in sweep.models:
        warn_seq_len(load_model(m), max(sweep.seq_lens), "seq_lens")
    from amsp_planner.cli.notes import note

    for line in w.memory_limit_warnings(sweep):
        note(line, "warning")
    x = pick_x_axis(sweep, x_axis)
    rows = _run_with_progress(w, sweep, workers, max_points, progress)

    if csv_path:
        rep.write("--csv", csv_path, rep.csv_text(rows))
    if json_path and json_path != "-":
        rep.write("--json", json_path, rep.to_json(sweep, rows))
    if plot_path:
        from amsp_planner.report.plots import sweep_figure

        fig = sweep_figure(rows, x, [a for a in sweep.varying() if a != x], rep.title(sweep))
        kind = Path(plot_path).suffix.lstrip(".").lower() or "png"
        rep.write("--plot", plot_path, lambda tmp: fig.savefig(tmp, format=kind))
    if fmt == "json":
        click.echo(rep.to_json(sweep, rows), nl=False)
        return
    if fmt == "csv":
        click.echo(rep.csv_text(rows), nl=False)
        return
    from amsp_planner.report.grid import emit

    grid = rep.compare_grid(sweep, rows) if compare_clusters else rep.sweep_grid(sweep, rows)
    wrote = [f"wrote {p}" for p in (csv_path, json_path, plot_path) if p and p != "-"]
    emit([grid, *rep.footnotes(rows), *wrote], fmt, wide)


def check_output_paths(rep, paths: dict[str, str | None]) -> None:
    """Before any work: no two outputs on one path, each writable and not something else
    (``outfile.check_outputs``), and a plot format matplotlib writes."""
    from amsp_planner.outfile import check_outputs

    check_outputs({o: (p, *rep.OUTPUTS[o]) for o, p in paths.items()})
    rep.check_outputs(paths)


def pick_x_axis(sweep, x_axis: str | None) -> str:
    """The plot's x axis: the one asked for (it must be swept), else gpus if swept, else the
    first swept number, else gpus."""
    varying = sweep.varying()
    numeric = [a for a in varying if a not in ("model", "cluster", "gpu_type")]
    if x_axis is not None:
        want = x_axis if x_axis in ("gpus", "seq_len", "global_batch", "memory_limit_gib") \
            else f"set:{x_axis}"
        if want not in numeric:
            names = ", ".join(a.removeprefix("set:") for a in numeric) or "none"
            raise AmspUserError(f"--x-axis {x_axis}: not a swept axis with numbers: use one of "
                                f"{names} (give it a comma list)")
        return want
    return "gpus" if "gpus" in numeric or not numeric else numeric[0]


def _run_with_progress(w, sweep, workers, max_points: int, show: bool | None):
    """Solve the sweep; progress on stderr (rich's bar on a terminal, plain lines with
    --progress elsewhere). Ctrl-C ends the workers and exits 130 with one line, before any
    output file is written."""
    n = len(sweep)
    tty = sys.stderr.isatty()
    show = (n >= 8 and tty) if show is None else show
    done = [0]

    def count(k: int) -> None:
        done[0] += k

    def solve():
        if not show:
            return w.run(sweep, workers, progress=count, max_points=max_points)
        if not tty:
            return w.run(sweep, workers, progress=_lines(n, count), max_points=max_points)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeRemainingColumn(),
                      console=Console(file=sys.stderr), transient=True) as prog:
            task = prog.add_task("solving", total=n)

            def advance(k: int) -> None:
                count(k)
                prog.advance(task, k)

            return w.run(sweep, workers, progress=advance, max_points=max_points)

    import signal

    from amsp_planner.runtime.lifecycle import Signalled, raising

    try:
        with raising(signal.SIGTERM, signal.SIGHUP):  # the sweep ends as on Ctrl-C
            return solve()
    except (KeyboardInterrupt, Signalled) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        click.echo(f"interrupted: {signal.Signals(signum).name}: {done[0]:,} of {n:,} points "
                   "solved; no file written", err=True)
        sys.exit(128 + signum)


def _lines(n: int, count):
    """A progress callback printing 'solved k of n points' at each further tenth."""
    step = max(1, n // 10)
    state = {"done": 0, "next": step}

    def report(k: int) -> None:
        count(k)
        state["done"] += k
        if state["done"] >= state["next"] or state["done"] == n:
            click.echo(f"solved {state['done']:,} of {n:,} points", err=True)
            state["next"] = (state["done"] // step + 1) * step

    return report
