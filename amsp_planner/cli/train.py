"""amsp train: execute a plan with the bundled torch runtime and prove it.

    amsp train plan.json --steps 20 --data stdlib --report run.json
"""

from __future__ import annotations

import click

from amsp_planner.cli import paths


@click.command()
@click.argument("plan_file", type=paths.Path(dir_okay=False))
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Optimizer steps to run (in total, counting resumed ones).")
@click.option("--data", default=None,
              help="Token file (nanoGPT-style uint16 .bin; .u32 for uint32), 'stdlib' (a "
                   "byte-level corpus of Python's standard library) or 'synthetic' (default).")
@click.option("--checkpoint-dir", type=paths.Path(file_okay=False), default=None,
              help="Directory for torch.distributed.checkpoint checkpoints.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Save every K steps (0: never).")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint (any plan of "
                                             "the same model).")
@click.option("--resume-from", type=click.IntRange(min=1), default=None,
              help="With --resume: the checkpoint step to resume from (default: the latest).")
@click.option("--on-nonfinite", type=click.Choice(["stop", "skip"]), default="stop",
              show_default=True,
              help="A NaN/Inf loss or gradient norm: stop (the last checkpoint is kept) or skip "
                   "the step (no update; one more small all-reduce per step).")
@click.option("--gate", type=click.Choice(["balanced", "topk"]), default="balanced",
              show_default=True,
              help="A mixture-of-experts model's routing: balanced (every expert gets the same "
                   "tokens: exact all-to-all bytes) or topk (the router's top-k, a capacity of "
                   "S k / E tokens per expert per sequence, the overflow dropped).")
@click.option("--force", is_flag=True,
              help="Run even when the host checks (device type, ranks per core or GPU, memory) "
                   "say the plan does not suit this host.")
@click.option("--report", "report", type=paths.Path(dir_okay=False), default=None,
              help="Write the run report (JSON): measured vs planned bytes, times, memory, loss.")
@click.option("--save-on-sigterm", is_flag=True,
              help="On SIGTERM (a batch scheduler ending or preempting the job), save a "
                   "checkpoint at the end of the current step, then stop (exit 143). Needs "
                   "--checkpoint-dir and --checkpoint-every.")
@click.option("--lr", type=float, default=1e-3, show_default=True,
              help="AdamW learning rate, finite, in (0, 1].")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the initial weights and the data order, 0 .. 2**32-1.")
@click.option("--local-nodes", is_flag=True,
              help="Run every node of a multi-node plan on this host (loopback).")
@click.option("--node-rank", type=click.IntRange(min=0), default=None,
              help="This node's index, when running one node of a multi-node plan.")
@click.option("--master-addr", default=None, help="Host of node 0 (multi-node).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None)
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Processes per node (must match the plan; checked before launching).")
@click.option("--timeout", "timeout_s", type=click.IntRange(min=5), default=300, show_default=True,
              help="Process-group timeout in seconds: the longest a rank waits for a dead peer.")
@click.option("--cpu", is_flag=True, help="Use gloo on CPU even when CUDA is available.")
@click.option("--fail-at-step", type=int, default=None, hidden=True)
@click.option("--fail-rank", type=int, default=-1, hidden=True)
@click.option("--fail-mode", type=click.Choice(["step", "save", "nan", "oom"]), default="step",
              hidden=True)
def train(plan_file, steps, data, checkpoint_dir, checkpoint_every, resume, resume_from,
          on_nonfinite, gate, force, save_on_sigterm, report, lr, seed, local_nodes, node_rank, master_addr,
          master_port, nproc_per_node, timeout_s, cpu, fail_at_step, fail_rank, fail_mode):
    """Train the plan's model under the plan's sharding (torchrun; gloo on CPU, NCCL on GPU)."""
    import importlib.util
    import os

    from amsp_planner.errors import AmspUserError

    if importlib.util.find_spec("torch") is None:  # imported only where needed: refusals are fast
        raise AmspUserError("amsp train needs the runtime extra: pip install -e '.[runtime]'")
    from amsp_planner.runtime import worker as W

    if report and checkpoint_dir:  # two outputs of one command on one path: refused first
        rep, ck = os.path.realpath(report), os.path.realpath(checkpoint_dir)
        if rep == ck:
            raise AmspUserError(f"--report and --checkpoint-dir name the same path {report}: "
                                "give the report a path of its own")
    opts = {"steps": steps, "data": data, "checkpoint_dir": checkpoint_dir,
            "checkpoint_every": checkpoint_every, "resume": resume, "resume_from": resume_from,
            "on_nonfinite": on_nonfinite, "gate": gate,
            "report": os.path.abspath(report) if report else None, "seed": seed,
            "optim": {"lr": lr}, "timeout_s": timeout_s, "cpu": cpu,
            "fail_at_step": fail_at_step, "fail_rank": fail_rank, "fail_mode": fail_mode,
            "save_on_sigterm": save_on_sigterm}
    plan_path = os.path.abspath(plan_file)
    if W.inside_launch():
        W.worker(plan_path, opts)  # every check on every rank; leaves with the rank's code
    import signal

    from amsp_planner.runtime.lifecycle import EXIT_SIGNALLED, Signalled, raising

    # the launcher's checks, preflight (with --resume the checkpoint's SHA-256) and the
    # report run while no rank does: a stop signal there ends it in one line; during the
    # job the launcher's own handlers (lifecycle.Signals) take over from these
    try:
        with raising(signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            return _launch(plan_path, opts, local_nodes, node_rank, master_addr, master_port,
                           nproc_per_node, force)
    except Signalled as e:
        click.echo(f"interrupted: {e.line_name}: the launcher stopped while no rank was "
                   "running (checkpoints untouched)", err=True)
        return EXIT_SIGNALLED.get(e.signum, 128 + e.signum)


def _launch(plan_path, opts, local_nodes, node_rank, master_addr, master_port,
            nproc_per_node, force) -> int:
    """Check the options and the plan, then launch (``runtime.launch.launch``)."""
    from amsp_planner.errors import AmspUserError
    from amsp_planner.plan import load_plan
    from amsp_planner.runtime import launch as L
    from amsp_planner.runtime import worker as W
    from amsp_planner.runtime.preflight import check_options

    check_options(opts)
    W.check_run_options(opts)
    plan = load_plan(plan_path)
    if plan.strategy.pp > 1:  # before the node checks: the runtime has no pipeline stages
        from amsp_planner.runtime.support import check_tp

        check_tp(plan.strategy, plan.job)
    if plan.job.training.precision == "fp8" and plan.job.engine != "amsp":
        # the runtime's FP8 is its parameter all-gather (runtime/fp8.py; docs/fp8.md): FP8
        # matmuls planned for another engine would not be what it runs
        raise AmspUserError(f"amsp train: this FP8 plan is for --engine {plan.job.engine} (FP8 "
                            "matmuls); the bundled runtime runs FP8 in its all-gathers only: "
                            "plan with --engine amsp --precision fp8, or --precision bf16")
    return L.launch(plan_path, plan, opts, local_nodes=local_nodes, node_rank=node_rank,
                    master_addr=master_addr, master_port=master_port,
                    nproc_per_node=nproc_per_node, force=force)
