"""The routed experts of a mixture-of-experts model as a parameter class of their own.

    amsp train plan.json      # strategy ep=E,...,ep.p=,ep.g=,ep.os= (docs/moe.md, docs/runtime.md)

Every MoE block's unit splits in two: its dense part (attention, norms, router, shared
experts), which the engine shards by the dense triple over all N ranks as any unit, and this
rank's E/e routed experts (rows ep_rank E/e .. of the ``experts`` parameter, the unit's last),
an expert unit that ``ExpertShards`` shards by the expert triple (ep.p, ep.g, ep.os) over the
expert-data-parallel (EDP) group, the N/e ranks holding the same experts. Its collectives are
the dense ones on their own groups (``EP_<kind>``, cost/communicators.py): the forward and
backward gathers over EP_P, the gradient reduce-scatter over EP_G, the step's EP_OS_shard
reduce-scatter and EP_OS_replica all-reduce, the update gather over EP_P_update; the token
all-to-alls run over the EP group (``EP``, runtime/moe.py).

Padding: ``Job.units`` (the dense parts, a multiple of N x the padding quantum) and
``Job.expert_units`` (a multiple of N/e x the quantum, so every expert factor, a divisor of N/e,
cuts it evenly).

Without expert tokens (``--strategy zero3`` on a MoE model) the expert units are still a class
of their own, on the dense triple at e = 1 (``Strategy.expert_factor``; their groups are the
dense ones under ``EP_`` names, and there is no all-to-all): the schedule of
cost/moe_schedule.py, as docs/moe.md says an engine without expert parallelism shards it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amsp_planner.runtime import model as M
from amsp_planner.runtime import moe as MOE
from amsp_planner.runtime.gather import Gathers, _alias
from amsp_planner.runtime.groups import EXPERT_KINDS, members
from amsp_planner.runtime.layout import UnitLayout
from amsp_planner.runtime.optim import StepBoundary
from amsp_planner.runtime.reduce import GradReduce
from amsp_planner.runtime.state import ShardState
from amsp_planner.strategy import PAD_QUANTUM


def expert_ranks(strategy, world: int, gpus_per_node: int, rank: int) -> tuple[int, int]:
    """(EP rank, EDP rank) of `rank`: its place in its EP group and in its EDP group."""
    lay = strategy.expert_layout(world, gpus_per_node)
    ep = members(rank, lay.ep_size, lay.ep_stride).index(rank)
    return ep, members(rank, lay.edp_size, lay.edp_stride).index(rank)


@dataclass(frozen=True)
class _Factors:
    """The expert triple in the shape of a Strategy for the engine's bases (no ZeRO++)."""

    s_p: int
    s_g: int
    s_os: int
    hpz: int = 1
    qwz: bool = False
    qgz: bool = False
    quant_block: int = PAD_QUANTUM


class ExpertShards(ShardState, Gathers, GradReduce, StepBoundary):
    """This rank's expert units: the states, gathers, gradient path and step of the expert
    class (the engine's bases, on this class's units, factors and groups)."""

    def __init__(self, engine, groups: dict):
        job, s, m = engine.job, engine.s, engine.job.model
        self.job, self.comm, self.device, self.optim = job, engine.comm, engine.device, engine.optim
        self.pdt, self.gdt = engine.pdt, engine.gdt
        p, g, o = (s.expert_factor(c) for c in ("p", "g", "os"))
        self.strategy, self.s = s, _Factors(p, g, o)
        self.groups = {k: groups["EP_" + k] for k in EXPERT_KINDS} | {"world": groups["world"]}
        N, R = job.num_gpus, job.gpus_per_node
        self.e = s.expert_layout(N, R).ep_size
        self.ep_rank, self.edp_rank = expert_ranks(s, N, R, engine.rank)
        self.moe_units = [i for i, x in enumerate(m.unit_expert_params()) if x]
        """The engine's units that have an expert unit, in order."""
        self.n_local = m.num_experts // self.e
        per = self.n_local * m.expert_params()
        self.units = [u for u in job.expert_units(self.e) if u]
        """Padded elements of each expert unit (``Job.expert_units``)."""
        self.max_unit = max(self.units)
        self.layouts = [UnitLayout(u, p, g, o) for u in self.units]
        self.real = [per] * len(self.units)
        shape = (self.n_local, 3 * m.hidden_size * MOE.expert_width(m))
        self.specs = [[(MOE.EXPERTS, shape)] for _ in self.units]
        self.offsets = [M.offsets(x) for x in self.specs]
        self.tied, self.tp, self.tp_rank = False, 1, 0
        self.rep_slices = [[] for _ in self.units]
        d = self.edp_rank
        self.i_p, self.i_os, self.i_h = d % p, d % o, 0
        self.step_count = 0
        self._alloc()

    def logical_range(self, k: int) -> tuple[int, int]:
        """[a, b) of this rank's experts in the logical unit of expert unit k."""
        return MOE.expert_slice(self.job.model, self.moe_units[k], self.e, self.ep_rank)

    def os_pieces(self, k: int, what: str) -> list[tuple[torch.Tensor, int]]:
        """(tensor, logical offset): this rank's OS shard of `what` of expert unit k, less
        its padding, where it lies in the logical unit (checkpoints)."""
        lay, real = self.layouts[k], self.real[k]
        off = lay.os_off(self.i_os)
        n = max(0, min(lay.os_len, real - off))
        return [(getattr(self, what)[k][:n], self.logical_range(k)[0] + min(off, real))]

    def full_parts(self, what: str) -> list[torch.Tensor]:
        """Every expert unit's [E x expert] fp32 `what`, in expert order, assembled on every
        rank by a world all-gather (phase 'export')."""
        world = self.groups["world"]
        N, R = self.job.num_gpus, self.job.gpus_per_node
        places = [expert_ranks(self.strategy, N, R, r) for r in range(N)]
        out = []
        for k, lay in enumerate(self.layouts):
            allg = torch.empty(lay.os_len * N, dtype=torch.float32, device=self.device)
            self.comm.phase = "export"
            self.comm.all_gather(allg, getattr(self, what)[k], world)
            full = torch.empty(self.e, lay.size, dtype=torch.float32, device=self.device)
            for r, (ep, d) in enumerate(places):
                oo = lay.os_off(d % self.s.s_os)
                full[ep, oo:oo + lay.os_len] = allg[r * lay.os_len:(r + 1) * lay.os_len]
            out.append(full[:, :self.real[k]].reshape(-1))
        return out


class ExpertClass:
    """What ``engine.ShardedEngine`` adds for the expert class (a base of it)."""

    def _split_experts(self, gate: str) -> None:
        """Before the layouts: the dense parts' specs and sizes (their padded units are
        ``Job.units`` already), the expert units, the EP context and the routing."""
        self.xp, self.epc, self.x_of = None, None, {}
        self.routing = MOE.Routing(MOE.check_gate(gate), self.job.training.expert_imbalance)
        m = self.job.model
        if not m.is_moe:
            return
        self.specs = [[x for x in u if x[0] != MOE.EXPERTS] for u in self.specs]
        self.offsets = [M.offsets(u) for u in self.specs]
        self.real = [r - x for r, x in zip(self.real, m.unit_expert_params(), strict=True)]
        self.xp = ExpertShards(self, self.groups)
        self.epc = MOE.EPContext(self.comm, self.groups["EP"], self.routing)
        self.x_of = {i: k for k, i in enumerate(self.xp.moe_units)}

    def _init_experts(self, i: int, full: torch.Tensor) -> None:
        """Expert unit of unit i from its logical fp32 values."""
        k = self.x_of[i]
        a, b = self.xp.logical_range(k)
        flat = torch.zeros(self.xp.layouts[k].size, dtype=torch.float32)
        flat[:b - a] = full[a:b]
        self.xp._load_unit(k, flat.to(self.device))

    def _expert_leaf(self, i: int, xbuf: torch.Tensor, leaves: dict) -> None:
        """Unit i's expert leaf over its gathered expert unit, registered with the saved-
        tensor hooks as unit U + i."""
        key = self.num_units + i
        self._cur[key] = xbuf
        self._live[xbuf.untyped_storage().data_ptr()] = key
        view = M.views(xbuf, self.xp.specs[self.x_of[i]])[MOE.EXPERTS]
        leaves[MOE.EXPERTS] = _alias(view).requires_grad_(True)

    def _reduce_experts(self, j: int, grad: torch.Tensor, micro: int) -> None:
        """Unit j's expert gradient into its expert G shard (over EP_G when ep.g > 1)."""
        xp, k = self.xp, self.x_of[j]
        target = xp._grad_target(k)
        xp._deposit(k, target, {MOE.EXPERTS: grad}, True)
        if xp.s.s_g > 1:
            xp._reduce(k, target, micro)


class _Pair:
    """A unit's gathers in flight: its dense part and (a MoE block's) expert unit."""

    def __init__(self, dense, expert=None):
        self.dense, self.expert, self.xbuf = dense, expert, None

    def wait(self) -> torch.Tensor:
        buf = self.dense.wait()
        self.xbuf = self.expert.wait() if self.expert is not None else None
        return buf


def fetch_unit(engine, i: int, phase: str) -> _Pair:
    """Start gathering unit i (and its expert unit) for `phase`."""
    dense = engine._fetch(i, phase)
    if i not in engine.x_of:
        return _Pair(dense)
    return _Pair(dense, engine.xp._fetch(engine.x_of[i], phase))
