"""Train a plan's model under its strategy, inside an initialised torch.distributed job.

    torchrun --nproc-per-node=4 -m amsp_planner.runtime.launch plan.json --steps 20

``train(job, strategy, cfg)`` is the core entry (plan files and tests both use it): it checks
the world against the plan, builds the rank groups, runs the steps, and returns a run report
(JSON-ready): measured bytes per schedule entry next to the plan's, step times, the runtime's
model-state bytes next to the memory model's, loss per step.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime import faults, lifecycle
from amsp_planner.runtime.collectives import Comm, Group
from amsp_planner.runtime.data import TokenSource
from amsp_planner.runtime.engine import OptimConfig, ShardedEngine
from amsp_planner.runtime.groups import build_groups
from amsp_planner.runtime.preflight import (  # noqa: F401 - this module's API too
    REPORT_KIND,
    check_report,
    check_steps,
    check_world,
    is_report,
)

STEP_PHASES = ("forward", "backward", "recompute", "grad_sync", "update")


@dataclass
class RunConfig:
    steps: int = 10
    """Optimizer steps to run (in total, counting resumed ones)."""
    seed: int = 0
    """Seed of the initial weights and of the data order."""
    data: str | None = None
    """None/'synthetic', 'stdlib', or a nanoGPT-style token file."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Save every K steps (0: never)."""
    resume: bool = False
    log_every: int = 1
    """Print progress every K steps on rank 0 (0: quiet)."""
    report_path: str | None = None
    resume_from: int | None = None
    """Resume from this checkpoint step instead of the latest."""
    verified: bool = False
    """The launcher verified the checkpoint's checksums already."""
    on_nonfinite: str = "stop"
    """A NaN/Inf loss or gradient norm: 'stop' the run (the last checkpoint is kept), or
    'skip' the step (checked before any update: one extra world all-reduce per step, phase
    'guard')."""
    fail_at_step: int | None = None
    """Testing aid: at that step this rank (``fail_rank``) fails the ``fail_mode`` way:
    'step' dies hard in the middle of the step, 'save' dies in that step's checkpoint save
    once its shards are written, 'nan' makes its gradients NaN, 'oom' limits its address
    space so the step runs out of memory."""
    fail_rank: int = -1
    fail_mode: str = "step"
    gate: str = "balanced"
    """A MoE model's routing (runtime/moe.py): 'balanced' (every expert the same tokens) or
    'topk' (the router's top-k with a capacity of S k / E tokens per expert per sequence)."""
    save_on_sigterm: bool = False
    """A SIGTERM (or the launcher's stop file) makes every rank save a checkpoint at the end
    of the step it runs and stop (``lifecycle.Stopped``); asked once per step with one
    uncounted all-reduce of one element."""


def world_info() -> tuple[int, int, int, int]:
    """(rank, world size, local world size, node index) from the launcher's environment."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", rank // local)))
    return rank, world, local, node


def fingerprint(job, strategy) -> int:
    """A 62-bit hash of what every rank must agree on: model, world, strategy, precision."""
    doc = json.dumps([job.model.model_dump(), job.training.model_dump(), job.num_gpus,
                      job.gpus_per_node, str(strategy)], sort_keys=True, default=str)
    return int(hashlib.sha256(doc.encode()).hexdigest()[:15], 16)


def setup(job, strategy, comm: Comm) -> tuple[dict[str, Group], int]:
    """Check the world, agree on the plan, build the groups (all counted in phase 'setup')."""
    rank, world, local, node = world_info()
    check_world(job, world, local)
    comm.phase = "setup"
    wg = Group("world", tuple(range(world)), rank, dist.group.WORLD, local, world // local)
    mine = torch.tensor([node, rank % local, fingerprint(job, strategy)], dtype=torch.int64,
                        device=comm.device)
    every = torch.empty(3 * world, dtype=torch.int64, device=comm.device)
    comm.all_gather(every, mine, wg)
    every = every.view(world, 3).tolist()
    for r, (nd, lr, fp) in enumerate(every):
        if fp != every[0][2]:
            raise AmspUserError(f"rank {r} runs a different plan (model, world or strategy) "
                                "than rank 0: launch every node with the same plan file")
        if r != nd * local + lr:
            raise AmspUserError(f"rank {r} is local rank {lr} of node {nd}: ranks must be "
                                "node-major (rank = node * per-node + local); launch with "
                                "torchrun's default rank assignment")
    node_of = [nd for nd, _, _ in every]
    return build_groups(strategy, rank, world, job.gpus_per_node, node_of,
                        job.model.is_moe), rank


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def train(job, strategy, cfg: RunConfig, evaluation=None, device: str = "cpu") -> dict:
    """Run `cfg.steps` steps of `job` under `strategy`; returns the run report (every rank)."""
    from amsp_planner.cost.evaluate import evaluate

    evaluation = evaluation or evaluate(job, strategy)
    comm = Comm(device)
    faults.at(doing="checking the world against the plan")
    groups, rank = setup(job, strategy, comm)
    engine = ShardedEngine(job, strategy, comm, groups, rank, cfg.optim, device, cfg.gate)
    N, n_micro, mb = job.num_gpus, evaluation.n_micro, strategy.micro_batch
    seq = job.training.seq_len
    source = TokenSource(cfg.data, job.model.vocab_size, seq, job.training.batch_seqs, cfg.seed)
    start = _start(engine, cfg, rank)
    # data-parallel rank d takes its rows; the t ranks of its TP group all run them
    per_rank = job.seqs_per_rank(strategy.tp)
    d = engine.dp_rank
    rows = slice(d * per_rank, (d + 1) * per_rank)
    losses, times, norms, skipped = [], [], [], []
    predicted = evaluation.step_s
    tokens_per_step = job.training.batch_tokens
    startup_peak = _peak_rss()
    _log(rank, f"training {job.model.name} on {N} ranks ({job.num_nodes} node(s)), strategy "
               f"{strategy}, {n_micro} micro-batch(es)/step, {tokens_per_step} tokens/step, "
               f"data {source.name}")
    caveat = uncalibrated(job.cluster)
    if caveat:
        _log(rank, f"note: the predicted step time ({predicted * 1e3:.1f} ms) is {caveat}; "
                   "the step lines leave it out")
    for step in range(start, cfg.steps):
        faults.at(step=step + 1, doing="running the step")
        fault = cfg.fail_mode if cfg.fail_at_step == step + 1 and cfg.fail_rank == rank else None
        t0 = time.perf_counter()
        loss, gnorm = _step(engine, source.batch(step, rows), n_micro, mb, N, cfg, fault, step)
        dt = time.perf_counter() - t0
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            if cfg.on_nonfinite != "skip":
                raise faults.JobFault(_nonfinite(loss, gnorm))
            skipped.append(step + 1)
            _log(rank, f"step {step + 1:>5}/{cfg.steps}  skipped: non-finite loss or gradients "
                       "(--on-nonfinite skip): no update")
            losses.append(None)
            norms.append(None)
            times.append(dt)
            continue
        losses.append(loss)
        norms.append(gnorm)
        times.append(dt)
        if cfg.log_every and (step + 1) % cfg.log_every == 0:
            pred = "" if caveat else f" (predicted {predicted * 1e3:.1f} ms)"
            _log(rank, f"step {step + 1:>5}/{cfg.steps}  loss {loss:.4f}  grad-norm {gnorm:.3f}  "
                       f"{tokens_per_step / dt:,.0f} tok/s  step {dt * 1e3:.1f} ms{pred}")
        due = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
        stop = cfg.save_on_sigterm and _stop_agreed(engine.device)
        if cfg.checkpoint_dir and (due or stop):
            from amsp_planner.runtime.checkpoint import save

            die = functools.partial(_die, rank, step + 1, "save") if fault == "save" else None
            path = save(engine, cfg.checkpoint_dir, step + 1, die)  # counted under "checkpoint"
            if stop:
                raise lifecycle.Stopped(step + 1, str(path))
    report = _finish(job, strategy, evaluation, engine, comm, losses, norms, times, start,
                     skipped, startup_peak)
    _log(rank, _done_line(report, losses, times, predicted, tokens_per_step, not caveat))
    _log(rank, report["verdict"]["line"])
    if cfg.report_path and rank == 0:
        faults.at(doing=f"writing the report {cfg.report_path}")
        try:
            write_report(cfg.report_path, report)
        except AmspUserError as e:  # checked writable before any step: a fault now, not input
            raise faults.RunFault(f"{e} (after every step ran)") from None
    report["_engine"] = engine
    return report


def uncalibrated(cluster) -> str | None:
    """Why the cluster's predicted step time is not to be compared with this run (None: it
    is): a cluster of CPU processes (``intra_fabric: shm``) without measured tables has the
    preset's placeholder figures, not this host's."""
    if cluster.intra_fabric == "shm" and not cluster.measured:
        return (f"not calibrated for {cluster.name} (placeholder figures, not this host's: "
                "amsp calibrate measures them)")
    return None


def _stop_agreed(device) -> bool:
    """Whether any rank was asked to save and stop (``--save-on-sigterm``): one all-reduce
    (MAX) of one element, outside the counted collectives, so every rank stops at the same
    step."""
    flag = torch.tensor([1.0 if lifecycle.stop_asked() else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _step(engine, batch, n_micro: int, mb: int, N: int, cfg: RunConfig, fault, step: int
          ) -> tuple[float, float]:
    """One optimizer step over the rank's rows of the global batch; (loss, grad norm). The
    gradients are of the mean over the N/t data-parallel ranks' rows; every one of the N ranks
    adds 1/N of its loss to the world all-reduce (a TP group's t ranks hold the same loss)."""
    loss_sum = 0.0
    for m in range(n_micro):
        chunk = batch[m * mb:(m + 1) * mb].to(engine.device, non_blocking=True)
        scale = 1.0 / (N // engine.tp * n_micro)
        if fault is not None and m == 0:
            scale = _inject(fault, engine.rank, step + 1, scale)
        loss_sum += engine.forward_backward(chunk[:, :-1], chunk[:, 1:], m, scale) / (N * n_micro)
    return engine.optimizer_step(loss_sum, guard=cfg.on_nonfinite == "skip")


def _done_line(report: dict, losses: list, times: list, predicted: float, tokens: int,
               calibrated: bool = True) -> str:
    good = [t for t, x in zip(times, losses, strict=True) if x is not None]
    if not good:
        return f"done: {len(times)} steps"
    med = sorted(good)[len(good) // 2]
    last = [x for x in losses if x is not None][-1]
    mem = report["memory"]
    return (f"done: {len(times)} steps, final loss {last:.4f}, median step {med * 1e3:.1f} ms "
            f"(predicted {predicted * 1e3:.1f} ms{'' if calibrated else ', not calibrated'}), "
            f"{tokens / med:,.0f} tok/s, model states "
            f"{sum(mem['measured'].values()) / 2**20:.2f} MiB/rank "
            f"(plan {mem['predicted_total'] / 2**20:.2f} MiB)")


def _start(engine, cfg: RunConfig, rank: int) -> int:
    """Resume from a checkpoint, or initialise the parameters; returns the first step."""
    if cfg.resume and cfg.checkpoint_dir:
        from amsp_planner.runtime.checkpoint import load, resume_step

        step = resume_step(cfg.checkpoint_dir, cfg.resume_from)
        if step is not None:
            start = load(engine, cfg.checkpoint_dir, step, cfg.verified)
            _log(rank, f"resumed from step {start} in {cfg.checkpoint_dir}")
            return start
    faults.at(doing="initialising the parameters")
    engine.init_params(cfg.seed)
    return 0


def _nonfinite(loss: float, gnorm: float) -> str:
    return (f"non-finite training (loss {loss:.4g}, grad-norm {gnorm:.4g}): stopped before "
            "saving (--on-nonfinite skip skips such steps instead)")


def _inject(mode: str, rank: int, step: int, scale: float) -> float:
    """Testing aid (``fail_at_step``): fail this rank's step the `mode` way."""
    if mode == "step":
        _die(rank, step, "step")
    if mode == "oom":
        import resource

        vm = _status_bytes("VmSize")
        resource.setrlimit(resource.RLIMIT_AS, (vm, resource.RLIM_INFINITY))
    return float("nan") if mode == "nan" else scale


def _die(rank: int, step: int, where: str) -> None:
    print(f"rank {rank}: dying in step {step} ({where}; fault injection)", file=sys.stderr,
          flush=True)
    os._exit(9)


def write_report(path: str, report: dict) -> None:
    from amsp_planner.outfile import write_output

    doc = {"kind": REPORT_KIND, **report}
    write_output(path, "--report", "an amsp run report", is_report,
                 json.dumps(doc, indent=1) + "\n")


def _finish(job, strategy, evaluation, engine, comm, losses, norms, times, start, skipped,
            startup_peak) -> dict:
    from amsp_planner.runtime.verdict import verdict

    ran = max(1, len(times))
    stepped = max(1, len(times) - len(skipped))
    step_rows = (comm.report(ran, ("forward", "backward", "recompute"))
                 + comm.report(stepped, ("grad_sync", "update")))
    report = _report(job, strategy, evaluation, engine, step_rows, comm.report(1, ("setup",)),
                     comm.report(1, ("checkpoint",)), losses, norms, times, start)
    report["guard"] = comm.report(ran, ("guard",))
    report["skipped_steps"] = skipped
    report["memory"]["startup_peak_rss"] = startup_peak
    ok, line = verdict(report["schedule"])
    report["verdict"] = {"ok": ok, "line": line}
    return report


def _status_bytes(key: str) -> int | None:
    """A /proc/self/status figure in bytes (Linux), for CPU runs."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss() -> int | None:
    """This process's peak resident set (bytes; Linux), for CPU runs."""
    return _status_bytes("VmHWM")


def _report(job, strategy, ev, engine, step_rows, setup_rows, ckpt_rows, losses, norms, times,
            start) -> dict:
    from amsp_planner.cost.memory import buffer_bytes, expert_bytes, model_state_bytes

    t = job.training
    predicted_mem = {**model_state_bytes(job.tp_phi(strategy.tp), strategy, t.param_bytes,
                                         t.grad_bytes),
                     **buffer_bytes(job, strategy), **expert_bytes(job, strategy)}
    measured = engine.state_bytes()
    sched = {(e.phase, e.op, e.group): e for e in ev.schedule}
    meas = {(r["phase"], r["op"], r["group"]): r for r in step_rows}
    entries = []
    for key in sorted(set(sched) | set(meas)):
        e, r = sched.get(key), meas.get(key)
        entries.append({
            "phase": key[0], "op": key[1], "group": key[2],
            "planned": None if e is None else {
                "calls_per_step": e.calls_per_step, "full_bytes_per_step": e.full_bytes_per_step,
                "group_size": e.group_size, "stride": e.stride,
                "members_per_node": e.members_per_node,
                "intra_bytes_per_rank_per_step": e.intra_bytes_per_rank_per_step,
                "inter_bytes_per_rank_per_step": e.inter_bytes_per_rank_per_step},
            "measured": r,
        })
    peak = None
    if torch.cuda.is_available() and engine.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(engine.device)
    return {
        "model": job.model.name, "num_gpus": job.num_gpus, "gpus_per_node": job.gpus_per_node,
        "strategy": str(strategy), "precision": t.precision, "n_micro": ev.n_micro,
        "start_step": start, "loss": losses, "grad_norm": norms, "step_s": times,
        "predicted_step_s": ev.step_s,
        "schedule": entries, "setup": setup_rows, "checkpoint": ckpt_rows,
        "memory": {"measured": measured, "predicted": predicted_mem,
                   "predicted_total": sum(predicted_mem.values()),
                   "device_peak_allocated": peak, "process_peak_rss": _peak_rss()},
        "optim": asdict(engine.optim),
    }
