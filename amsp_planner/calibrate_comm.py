"""Calibration of the collectives: one (op, group, size) point timed on every member at once.

The process groups a calibration measures (each node's ranks, one rank per node), the buffers
and calls of each op (``OPS``; on gloo the reduce-scatter is the runtime's own ring), and the
timing of one point: a warm-up call, a probe that fixes how many calls fit the point's time
budget (max-reduced, so every member agrees), a barrier, the timed calls; the slowest member's
time. Bus bandwidth follows nccl-tests: factor(m) * size / time, factor (m-1)/m for
all-gather, reduce-scatter and all-to-all, 2(m-1)/m for all-reduce.

``amsp_planner/calibrate.py`` runs the grid.
torch is imported inside the functions.
"""

from __future__ import annotations

import time

from amsp_planner.calibrate_compute import sync, torch_dtype
from amsp_planner.calibrate_config import CalibrationConfig, World

_BUS = {"all_gather": lambda m: (m - 1) / m, "reduce_scatter": lambda m: (m - 1) / m,
        "all_to_all": lambda m: (m - 1) / m, "all_reduce": lambda m: 2 * (m - 1) / m}


def process_groups(world: World):
    """(intra group of this rank or None, inter group of this rank or None); all ranks create
    every group in the same order, as torch requires."""
    import torch.distributed as dist

    r, n = world.local_size, world.nodes
    intra = inter = None

    def back(pg, ranks):
        # a two-member group's second connection, as the runtime's groups have (Group.pg_back)
        if len(ranks) == 2:
            _BACK[id(pg)] = dist.new_group(ranks)

    if r > 1:
        for node in range(n):
            ranks = list(range(node * r, (node + 1) * r))
            pg = dist.group.WORLD if n == 1 else dist.new_group(ranks)
            back(pg, ranks)
            if world.rank in ranks:
                intra = pg
    if n > 1:
        ranks = [node * r for node in range(n)]
        pg = dist.group.WORLD if r == 1 else dist.new_group(ranks)
        back(pg, ranks)
        if world.rank in ranks:
            inter = pg
    return intra, inter


_BACK: dict[int, object] = {}
"""id(process group) -> its second connection, for groups of two."""


def _call(op: str, bufs, group) -> None:
    import torch.distributed as dist

    inp, out = bufs
    if op == "all_gather":
        dist.all_gather_single(out, inp, group=group)
    elif op == "reduce_scatter":
        if inp.device.type == "cpu":  # measure what the runtime runs on gloo
            from amsp_planner.runtime.collectives import Group, _ring_reduce_scatter

            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            g = Group("calibrate", ranks, ranks.index(dist.get_rank()), group,
                      pg_back=_BACK.get(id(group)))
            _ring_reduce_scatter(out, inp, g)
        else:
            dist.reduce_scatter_single(out, inp, group=group)
    elif op == "all_reduce":
        dist.all_reduce(inp, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp, group=group)
    else:  # pragma: no cover - OPS is closed
        raise AssertionError(op)


def _buffers(op: str, elems: int, m: int, dtype, device: str):
    import torch

    full = torch.ones(elems, dtype=dtype, device=device)
    if op == "all_gather":
        return torch.ones(elems // m, dtype=dtype, device=device), full
    if op == "reduce_scatter":
        return full, torch.empty(elems // m, dtype=dtype, device=device)
    if op == "all_reduce":
        return full, None
    return full, torch.empty_like(full)


def _max_over(group, value: float, device: str) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure_point(op: str, size_bytes: int, group, cfg: CalibrationConfig, device: str
                  ) -> tuple[int, float]:
    """(size actually used, bus bandwidth in bytes/s) of `op` on `group` at `size_bytes`."""
    import torch.distributed as dist

    dtype = torch_dtype(cfg)
    esize = dtype.itemsize
    m = dist.get_world_size(group)
    elems = max(m, size_bytes // esize // m * m)
    bufs = _buffers(op, elems, m, dtype, device)
    _call(op, bufs, group)  # warm-up: connections, allocator
    sync(device)
    t0 = time.perf_counter()
    _call(op, bufs, group)
    sync(device)
    probe = _max_over(group, time.perf_counter() - t0, device)
    iters = int(min(cfg.max_iters, max(cfg.min_iters, cfg.seconds_per_point / max(probe, 1e-9))))
    dist.barrier(group=group)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        _call(op, bufs, group)
    sync(device)
    per_call = _max_over(group, (time.perf_counter() - t0) / iters, device)
    return elems * esize, _BUS[op](m) * elems * esize / per_call
