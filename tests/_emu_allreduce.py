"""Worker of tests/test_emulate.py: all-reduce across the emulated nodes, reading the uplink's
byte counters around it (one rank per node).

    python -m amsp_planner.emulate --nodes 2 --nproc 1 -- tests/_emu_allreduce.py OUT 4194304 3
"""

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from amsp_planner.emulate import read_link_bytes


def main() -> None:
    out, size, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    t = torch.ones(size // 4, dtype=torch.float32)
    dist.all_reduce(t)  # connections up, warm
    dist.barrier()
    before = read_link_bytes()
    for _ in range(calls):
        dist.all_reduce(t)
    dist.barrier()  # the peer has everything: nothing of ours still waits in the qdisc
    after = read_link_bytes()
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = {"rank": rank, "world": world, "sum": float(t[0]),
           "tx": after["tx"] - before["tx"], "rx": after["rx"] - before["rx"]}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
