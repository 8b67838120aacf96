"""Worker of bench/fidelity.py: trains each strategy of a config for a few steps in one torchrun
launch, reading this node's uplink byte counters around the timed steps.

    torchrun --nproc-per-node=4 --nnodes=2 ... bench/_fidelity_worker.py CONFIG.json

CONFIG: {"out", "model", "cluster", "seq_len", "batch_seqs", "precision", "steps", "rounds",
"strategies": [[name, strategy string], ...]}. The strategies run round-robin, `rounds` times
`steps` steps each, so that a slow spell of the machine spreads over all of them rather than
landing on one. Rank 0 writes OUT/<name>.json: the last run report (schedule, bytes), the timed
step times of every round pooled (each round's first step, which builds the engine's buffers
and connections, left out), and the uplink bytes of every node summed over the rounds.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from amsp_planner.cost.job import Job
from amsp_planner.emulate import read_link_bytes
from amsp_planner.runtime.launch import leave
from amsp_planner.runtime.train import RunConfig, train
from amsp_planner.specs.loader import load_cluster, load_model
from amsp_planner.specs.training import TrainingSpec
from amsp_planner.strategy import parse_strategy_or_baseline


def link_bytes() -> torch.Tensor:
    """[tx, rx] of this node's uplink on local rank 0, zeros elsewhere (summed over ranks)."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and "AMSP_EMU_LINK" in os.environ:
        b = read_link_bytes()
        return torch.tensor([b["tx"], b["rx"]], dtype=torch.float64)
    return torch.zeros(2, dtype=torch.float64)


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.get("timeout_s", 300)))
    world, rank = dist.get_world_size(), dist.get_rank()
    t = TrainingSpec(seq_len=cfg["seq_len"], global_batch_seqs=cfg["batch_seqs"],
                     micro_batch=1, activation_checkpointing=False,
                     precision=cfg.get("precision", "bf16"))
    job = Job.create(load_model(cfg["model"]), load_cluster(cfg["cluster"]), t, world)
    pooled: dict[str, list[float]] = {}
    wire: dict[str, torch.Tensor] = {}
    for rnd in range(cfg.get("rounds", 1)):
        for name, text in cfg["strategies"]:
            s = parse_strategy_or_baseline(text, world, job.gpus_per_node)
            dist.barrier()
            before = link_bytes()
            rep = train(job, s, RunConfig(steps=cfg["steps"], log_every=0))
            dist.barrier()  # every byte of the steps has crossed the links
            delta = link_bytes() - before
            rows = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(rows, delta)
            rep.pop("_engine")
            pooled.setdefault(name, []).extend(rep["step_s"][1:])
            wire[name] = wire.get(name, 0) + torch.stack(rows)
            if rank == 0:
                local = job.gpus_per_node
                rep["timed_step_s"] = pooled[name]
                rep["rounds"] = rnd + 1
                rep["link_bytes"] = [{"tx": float(wire[name][n * local][0]),
                                      "rx": float(wire[name][n * local][1])}
                                     for n in range(world // local)]
                with open(os.path.join(cfg["out"], f"{name}.json"), "w") as f:
                    json.dump(rep, f)
                steps = sorted(rep["step_s"][1:])
                print(f"round {rnd + 1}: {name}: {s}: median step "
                      f"{steps[len(steps) // 2] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    dist.barrier()
    leave(0)  # every report is written


if __name__ == "__main__":
    main()
