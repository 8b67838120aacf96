"""Worker for the multi-process tests: runs several training runs in one torchrun launch.

    torchrun --nproc-per-node=4 tests/runtime/_mp_worker.py CONFIG.json

CONFIG: {"out": DIR, "runs": [{"name", "strategy", "precision", "seq_len", "batch_seqs",
"steps", "data", "grad_accum_dtype", "expert_imbalance", "model", "gate", "link_bytes", the
checkpoint options}]}.
Rank 0 writes DIR/<name>.json (the run report; with "link_bytes", on an emulated cluster, the
bytes node 0's uplink carried during train()) and DIR/<name>.pt (final unpadded fp32
parameters and Adam moments).
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from amsp_planner.cost.job import Job
from amsp_planner.runtime.launch import leave
from amsp_planner.runtime.train import RunConfig, train
from amsp_planner.specs.loader import load_cluster, load_model
from amsp_planner.specs.training import TrainingSpec
from amsp_planner.strategy import parse_strategy_or_baseline


def make_job(run: dict, world: int) -> Job:
    t = TrainingSpec(seq_len=run.get("seq_len", 32), global_batch_seqs=run.get("batch_seqs", 2 * world),
                     precision=run.get("precision", "fp32"),
                     grad_accum_dtype=run.get("grad_accum_dtype", "bf16"),
                     expert_imbalance=run.get("expert_imbalance", 1.0))
    return Job.create(load_model(run.get("model", "tiny")), load_cluster("cpu-local"), t, world)


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.get("timeout_s", 60)))
    world, rank = dist.get_world_size(), dist.get_rank()
    for run in cfg["runs"]:
        job = make_job(run, world)
        s = parse_strategy_or_baseline(run["strategy"], world, job.gpus_per_node)
        rc = RunConfig(steps=run.get("steps", 3), data=run.get("data"), log_every=0,
                       checkpoint_dir=run.get("checkpoint_dir"),
                       checkpoint_every=run.get("checkpoint_every", 0),
                       resume=run.get("resume", False), gate=run.get("gate", "balanced"))
        link = run.get("link_bytes")  # on an emulated cluster: this node's uplink counters
        if link:
            from amsp_planner.emulate import read_link_bytes

            dist.barrier()
            before = read_link_bytes()
        rep = train(job, s, rc)
        if link:
            dist.barrier()
            after = read_link_bytes()
            rep["link_bytes"] = {k: after[k] - before[k] for k in after}
        eng = rep.pop("_engine")
        states = {k: eng.full_units(k) for k in ("master", "exp_avg", "exp_avg_sq")}
        if rank == 0:
            out = os.path.join(cfg["out"], run["name"])
            with open(out + ".json", "w") as f:
                json.dump(rep, f)
            torch.save(states, out + ".pt")
    dist.barrier()
    leave(0)  # every result is written


if __name__ == "__main__":
    main()
