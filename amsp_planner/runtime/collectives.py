"""The one collective wrapper: every byte the runtime sends passes through ``Comm`` and is counted.

    python -m pytest tests/runtime -q -k accounting

Counting is per (phase, op, group): calls, the full tensor bytes of every call (the gathered
tensor of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce, the send
buffer of an all-to-all) and the ring-convention bytes derived from them. The group's size,
stride and members per node come from the real rank lists, never from a plan: this module
imports no cost model on purpose, so that comparing its counts with the plan's schedule is a
real test (DESIGN.md section 3).

Ring convention per rank: all-gather, reduce-scatter, all-to-all (m-1)/m * full; all-reduce
2(m-1)/m * full. Split in- and cross-node like a hierarchical algorithm: k members per node,
g nodes: all-gather / reduce-scatter intra (k-1)/k * full, inter (g-1)/g * full/k (all-reduce
twice that); all-to-all intra (k-1)/m * full, inter (g-1)/g * full.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """A rank group as this rank sees it: its kind name, members and process group."""

    name: str
    ranks: tuple[int, ...]
    index: int
    """This rank's position in ``ranks`` (its shard index in the group)."""
    pg: object = field(compare=False, repr=False)
    """The torch ProcessGroup (None for a group of one)."""
    members_per_node: int = 1
    nodes: int = 1
    pg_back: object = field(default=None, compare=False, repr=False)
    """For a group of two: a second ProcessGroup over the same members, so that a ring's two
    directions use separate connections (gloo serialises the two directions of one pair:
    12.6 MB/s each way instead of 23.9 on a 25 MB/s emulated link)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def stride(self) -> int:
        return self.ranks[1] - self.ranks[0] if len(self.ranks) > 1 else 1


class Work(NamedTuple):
    """A pending collective; ``wait()`` blocks until its output is ready."""

    handle: object
    then: object = None
    """Called once after the wait (completes an emulated collective)."""

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        if self.then is not None:
            self.then()


_DONE = Work(None)


def ring_bytes(op: str, full: float, size: int, members_per_node: int, nodes: int
               ) -> tuple[float, float]:
    """(intra, inter) ring-convention bytes per rank of one collective of `full` bytes."""
    m, k, g = size, members_per_node, nodes
    if m <= 1:
        return 0.0, 0.0
    if op == "all_to_all":
        return (k - 1) / m * full, (g - 1) / g * full
    intra, inter = (k - 1) / k * full, (g - 1) / g * full / k
    if op == "all_reduce":
        return 2 * intra, 2 * inter
    return intra, inter


RS_AS_ALL_REDUCE_ENV = "AMSP_GLOO_RS_AS_ALL_REDUCE"


def _ring_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """Ring reduce-scatter by point-to-point sends: member i ends with the sum of chunk i.

    Step s (1..m-1): send the running partial sum of chunk (i - s) to the next member, receive
    the partial of chunk (i - s - 1) from the previous one and add this member's own piece of
    it. Each member sends m-1 chunks: (m-1)/m of the input, the ring convention.
    """
    m, i, n = group.size, group.index, out.numel()
    chunks = inp.view(m, n)
    nxt, prv = group.ranks[(i + 1) % m], group.ranks[(i - 1) % m]
    send_pg = recv_pg = group.pg
    if m == 2 and group.pg_back is not None:  # member 0 sends on pg, member 1 on pg_back
        send_pg, recv_pg = (group.pg, group.pg_back) if i == 0 else (group.pg_back, group.pg)
    acc = chunks[(i - 1) % m].clone()
    buf = torch.empty_like(acc)
    for step in range(1, m):
        reqs = [dist.isend(acc, nxt, group=send_pg), dist.irecv(buf, prv, group=recv_pg)]
        for req in reqs:
            req.wait()
        acc, buf = buf, acc
        acc.add_(chunks[(i - step - 1) % m])
    out.copy_(acc)


class Comm:
    """Issues collectives on ``Group``s and counts them under the current phase."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.rs_by_all_reduce = (self.device.type == "cpu"
                                 and os.environ.get(RS_AS_ALL_REDUCE_ENV, "0") == "1")
        """Run reduce-scatters as all-reduces (opt-in on gloo; see [Note: gloo reduce-scatter])."""
        self.phase = "setup"
        self._calls: dict[tuple, int] = defaultdict(int)
        self._bytes: dict[tuple, int] = defaultdict(int)
        self._groups: dict[tuple, Group] = {}

    # ----- counting ---------------------------------------------------------------------
    def _count(self, op: str, group: Group, full_bytes: int) -> None:
        key = (self.phase, op, group.name)
        self._calls[key] += 1
        self._bytes[key] += int(full_bytes)
        self._groups[key] = group

    def report(self, steps: int = 1, phases: tuple[str, ...] | None = None) -> list[dict]:
        """Per (phase, op, group): calls and bytes per step (divided by `steps`)."""
        rows = []
        for (phase, op, name), calls in sorted(self._calls.items()):
            if phases is not None and phase not in phases:
                continue
            g = self._groups[(phase, op, name)]
            full = self._bytes[(phase, op, name)]
            intra, inter = ring_bytes(op, full, g.size, g.members_per_node, g.nodes)
            rows.append({
                "phase": phase, "op": op, "group": name, "group_size": g.size,
                "stride": g.stride, "members_per_node": g.members_per_node,
                "calls_per_step": calls / steps, "full_bytes_per_step": full / steps,
                "intra_bytes_per_rank_per_step": intra / steps,
                "inter_bytes_per_rank_per_step": inter / steps,
            })
        return rows

    # ----- collectives ------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Group,
                   async_op: bool = False) -> Work:
        """Concatenate every member's `inp` into `out`, in member order."""
        assert out.numel() == inp.numel() * group.size and out.dtype == inp.dtype
        if group.size == 1:
            out.copy_(inp)
            return _DONE
        self._count("all_gather", group, out.nbytes)
        return Work(dist.all_gather_single(out, inp, group=group.pg, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: Group,
                       async_op: bool = False) -> Work:
        """Sum `inp` over the members; member i gets chunk i in `out`."""
        assert inp.numel() == out.numel() * group.size and out.dtype == inp.dtype
        if group.size == 1:
            out.copy_(inp)
            return _DONE
        if not self.rs_by_all_reduce:
            self._count("reduce_scatter", group, inp.nbytes)
            if self.device.type == "cpu":
                _ring_reduce_scatter(out, inp, group)
                return _DONE
            return Work(dist.reduce_scatter_single(out, inp, group=group.pg, async_op=async_op))
        # [Note: gloo reduce-scatter] gloo's own reduce-scatter takes about twice as long as its
        # all-reduce of the same input (1.6M bf16 on 4 ranks: 8.5 ms vs 8.3 ms here, 13.7 vs
        # 7.6 ms under load), so on CPU the reduce-scatter runs as a ring of point-to-point
        # sends (`_ring_reduce_scatter`, 3.7 ms): the same collective, exactly (m-1)/m of the
        # input on the wire per rank, but synchronous (on CPU processes compute and
        # communication share the cores, so there is nothing to overlap; the cluster spec's
        # overlap_efficiency says so). With AMSP_GLOO_RS_AS_ALL_REDUCE=1 it runs instead as an
        # in-place all-reduce of the input (which the caller is done with) keeping this
        # member's chunk: that sends twice the reduce-scatter's ring bytes and is counted as
        # the all-reduce it is, so the run report then shows the difference from the plan.
        self._count("all_reduce", group, inp.nbytes)
        n = out.numel()
        chunk = inp[group.index * n:(group.index + 1) * n]
        handle = dist.all_reduce(inp, group=group.pg, async_op=async_op)
        if not async_op:
            out.copy_(chunk)
            return _DONE
        return Work(handle, lambda: out.copy_(chunk))

    def all_reduce(self, t: torch.Tensor, group: Group, async_op: bool = False,
                   op: str = "sum") -> Work:
        """Sum (or `op` 'max') `t` over the members, in place."""
        if group.size == 1:
            return _DONE
        self._count("all_reduce", group, t.nbytes)
        rop = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return Work(dist.all_reduce(t, op=rop, group=group.pg, async_op=async_op))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: Group,
                   async_op: bool = False) -> Work:
        """Equal chunks: chunk j of `inp` goes to member j; chunk i of `out` came from member i."""
        assert out.numel() == inp.numel() and inp.numel() % group.size == 0
        if group.size == 1:
            out.copy_(inp)
            return _DONE
        self._count("all_to_all", group, inp.nbytes)
        return Work(dist.all_to_all_single(out, inp, group=group.pg, async_op=async_op))

    def barrier(self, group: Group) -> None:
        """A barrier as a counted 4-byte all-reduce (so nothing escapes the count)."""
        self.all_reduce(torch.zeros(1, dtype=torch.float32, device=self.device), group)
