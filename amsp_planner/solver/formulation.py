"""The ILP's formulation: its variables and rows (the step-time rows are in
solver/step_rows.py), with coefficients from the tables (solver/tables.py). Solving it is
solver/ilp.py's; the choice rule, solver/choice.py's.

Sets: F = shard factors (``SearchSpace.factors``), Z = hpZ sizes > 1, J = activation options
(micro-batch b_j, checkpointing c_j: the first K of the L blocks, K = 0..L, or op-level) with
n_j = sequences per GPU / b_j micro-batches. Per option the tables hold the block class's
compute (with K of L checkpointed: the average, backward + (K/L) forward) and the activation
bytes, both from the cost model. Per micro-batch the block counts K = lo..hi >= 1 (three or
more in a row) are one option j = (b, 'K') with an integer k_j = K - lo: compute and memory are
affine in K there, so its tables hold the values at K = lo and the slopes per block.
Pairs: PG = {(p, g) in F^2 : p | g}, GO = {(g, o) : g | o}, PO = {(p, o) : p | o}.

Variables (binaries unless noted; times in seconds, memory in GiB):
  xPn_f, xPq_f   P factor f without / with qwZ            sum_f (xPn_f + xPq_f) = 1
  xGn_g, xGq_g   G factor g without / with qgZ            sum_g (xGn_g + xGq_g) = 1
  xO_o           OS factor o                              sum_o xO_o = 1
  h_z            hpZ of size z                            sum_z h_z <= 1
  y_j            activation option j                      sum_j y_j = 1
  k_j            integer, for j = (b, 'K'): K - lo        0 <= k_j <= (hi - lo) y_j
  zPG, zGO, zPO  in [0, 1]: the chosen pair (linearised products of the factor binaries)
  with xP_f = xPn_f + xPq_f, xG_g = xGn_g + xGq_g and
  [link]   sum_g zPG_pg = xP_p,  sum_p zPG_pg = xG_g   (likewise GO, PO)
           A pair exists only when it nests, so the links also enforce p | g | o; at binary
           x the links force z to the product x_p * x_g.
  [hpz]    vPn_f, vPq_f in [0, 1], the P choice without hpZ: vPn_f <= xPn_f, vPq_f <= xPq_f,
           sum_f (vPn_f + vPq_f) = 1 - H (H = sum_z h_z; at binary x, h: v_f = x_f (1 - H));
           h_z <= sum_{f in F: f > z, z | f} (xP_f - vPn_f - vPq_f)
  [qwz]    xPq_1 = 0;  [qgz] xGq_1 = 0
  [fp8ag]  a space of FP8 all-gathers (SearchSpace.fp8ag) beside the bf16 one: xPn_1 = 0
           (p = 1 gathers nothing: that strategy is the bf16 space's)
  [engine] with the engine's triples T (SearchSpace.triples): w_t binary, sum_t w_t = 1,
           xP_f = sum_{t in T: t_P = f} w_t (likewise G, OS); with qgz_needs_p,
           sum_g xGq_g <= sum_{f > 1} xP_f

Families: the factor binaries of a parameter class's components (P, G, OS), their
one-factor rows and the link rows of their nesting pairs are built by one loop over
``PARAM_CLASSES`` and each class's ``components`` and ``pairs`` (``Component``,
``ParamClass``): a further parameter class with its own (P, G, OS) is one more entry there
(with its tables), not a copy of these rows: a mixture of experts' routed experts are the
second, ``EXPERT`` (tag E, over ``SearchSpace.expert_factors``; their terms in the step and
memory rows: solver/expert_rows.py).

Memory per GPU (GiB), every term linear:
  tensors = sum_f xP_f P(f) + sum_g xG_g G(g) + sum_o xO_o O(o) + sum_z h_z H(z)
          + sum_f (xPn_f B_ag(f) + xPq_f B_agq(f)) + sum_g (xGn_g B_gr(g) + xGq_g B_grq(g))
          + st + sum_GO zGO S_step(g, o) + sum_j (y_j A_j + k_j dA_j)  (A_j: activations + loss peak)
          + F  (the space's fixed tensors: Transformer Engine's FP8 weight cache)
  st >= S_perm sum_{1<p<g} zPG_pg,  st >= S_perm sum_g xGq_g         [permuted gradient copy]
  comms = C_comm (sum_k u_k + [N > 1]) + sum_g xGq_g A2A(g)          [NCCL communicators]
  u_k >= every decision variable that puts a used group kind on ranks k = (size, stride):
        xP_f -> (f, 1), h_z -> (z, 1), xGn_g -> (g, 1), xGq_g -> (s0_g, 1) and (s1_g, R),
        zGO_go -> (o/g, g), xO_o -> (N/o, o), zPO_po -> (o/p, p)  (size > 1; world (N, 1) is
        always used, so its key has no u). Kinds on the same ranks share one communicator.
  [memory]  tensors (1 + frag) + comms + context <= limit
"""

from __future__ import annotations

from dataclasses import dataclass

from amsp_planner.solver.expert_rows import ExpertRows
from amsp_planner.solver.space import GROUPS, MEMORY, RECOMPUTE, STEP
from amsp_planner.solver.step_rows import StepRows, dot
from amsp_planner.solver.tables import GIB
from amsp_planner.strategy import Strategy, ckpt_fields


@dataclass(frozen=True)
class Component:
    """One sharded state of a parameter class: its factor binaries (``plain``, and
    ``quant`` for the factors that have a quantized collective) and the tables of the GiB a
    factor holds (``mem``: the state; ``buf``: the plain and quantized buffers)."""

    key: str
    """Its name in the pair names (zPG) and the engine rows (engine_P_f)."""
    row: str
    """Its name in the one-factor row (one_P_factor)."""
    plain: str
    """Prefix of the plain binaries (xPn_f)."""
    quant: str | None = None
    """Prefix of the quantized binaries (xPq_f), None without a quantized variant."""
    quant_table: str | None = None
    """The table whose keys are the factors with a quantized variant (qwZ: agq)."""
    mem: str = ""
    buf: tuple[str, str] | None = None


@dataclass(frozen=True)
class ParamClass:
    """A class of parameters sharded on its own: its components and the pairs of them whose
    factors must nest (p | g, g | o, p | o), each a set of pair variables with link rows."""

    tag: str
    """Suffix of its variables' and rows' names ('' for the dense parameters)."""
    components: tuple[Component, ...]
    pairs: tuple[tuple[str, str], ...]
    factors: str = "factors"
    """The SearchSpace field of its factor options."""


DENSE = ParamClass("", (
    Component("P", "P", "xPn", "xPq", "agq", "mem_p", ("buf_ag", "buf_agq")),
    Component("G", "G", "xGn", "xGq", "qgz", "mem_g", ("buf_gr", "buf_grq")),
    Component("O", "OS", "xO", mem="mem_o"),
), pairs=(("P", "G"), ("G", "O"), ("P", "O")))
EXPERT = ParamClass("E", (
    Component("P", "P", "xPn", mem="e_mem_p", buf=("e_buf_ag", "e_buf_ag")),
    Component("G", "G", "xGn", mem="e_mem_g", buf=("e_buf_gr", "e_buf_gr")),
    Component("O", "OS", "xO", mem="e_mem_o"),
), pairs=(("P", "G"), ("G", "O"), ("P", "O")), factors="expert_factors")
"""A mixture of experts' routed experts (docs/moe.md): their own (P, G, OS) over the ranks
holding the same experts, at the space's expert-parallel degree; no ZeRO++ variants."""
PARAM_CLASSES = (DENSE, EXPERT)
"""The parameter classes the formulation builds a (P, G, OS) family for (those a space has:
``Formulation.classes``)."""


@dataclass
class FactorVars:
    """A component's factor binaries; called with a factor f, what is 1 when f is chosen:
    the plain binary, plus the quantized one where f has it."""

    plain: dict
    quant: dict

    def __call__(self, f):
        return self.plain[f] + self.quant[f] if f in self.quant else self.plain[f]


def _tag(j: tuple[int, int | str]) -> str:
    """Name part of activation option j = (micro-batch, K blocks or 'op')."""
    return f"mb{j[0]}_ck{j[1]}"


class Formulation(StepRows, ExpertRows):
    """The variables and rows of one job's space (``_build``): set by ``StrategyIlp`` (pulp,
    job, space, T, prob, objective, memory_limit) before it calls ``_build``."""

    @property
    def classes(self) -> tuple[ParamClass, ...]:
        """The parameter classes of this space: the dense one, and the experts' in a
        mixture-of-experts space."""
        return tuple(c for c in PARAM_CLASSES if getattr(self.space, c.factors))

    def _build(self) -> None:
        pulp, T, sp = self.pulp, self.T, self.space
        prob = self.prob
        B = prob.add_variable  # attached to the model as created (PuLP 4 style)
        lin = pulp.lpSum
        self.x = {}
        for cls in self.classes:
            F = getattr(sp, cls.factors)
            for c in cls.components:
                keys = getattr(T, c.quant_table) if c.quant else ()
                self.x[c.key + cls.tag] = FactorVars(
                    {f: B(f"{c.plain}{cls.tag}_{f}", cat="Binary") for f in F},
                    {f: B(f"{c.quant}{cls.tag}_{f}", cat="Binary") for f in F if f in keys})
        xP, xG, xO = self.x["P"], self.x["G"], self.x["O"]
        self.xPn, self.xPq, self.xGn, self.xGq, self.xO = (xP.plain, xP.quant, xG.plain,
                                                           xG.quant, xO.plain)
        self.h = {z: B(f"h_{z}", cat="Binary") for z in T.hpz}
        J = list(T.fwd)
        self.y = {j: B(f"y_{_tag(j)}", cat="Binary") for j in J}
        self.k = {j: B(f"k_{_tag(j)}", lowBound=0, upBound=hi - lo, cat="Integer")
                  for j, (lo, hi) in T.krange.items()}
        for cls in self.classes:
            for c in cls.components:
                x = self.x[c.key + cls.tag]
                prob += (lin(x(f) for f in getattr(sp, cls.factors)) == 1,
                         f"one_{c.row}{cls.tag}_factor")
        prob += lin(self.y.values()) == 1, "one_activation_option"
        for j, kj in self.k.items():
            lo, hi = T.krange[j]
            prob += kj <= (hi - lo) * self.y[j], f"blocks_{_tag(j)}_need_option"
        if self.h:
            prob += lin(self.h.values()) <= 1, "at_most_one_hpz"
        self._add_hpz(xP)
        self._add_engine(xP, xG)
        self._add_expert_engine()
        self.z = {}
        for cls in self.classes:
            for a, b in cls.pairs:
                self.z[a + b + cls.tag] = self._pairs(a + b + cls.tag, self.x[a + cls.tag],
                                                      self.x[b + cls.tag],
                                                      getattr(sp, cls.factors))
        self.zPG, self.zGO, self.zPO = self.z["PG"], self.z["GO"], self.z["PO"]

        self._add_time(xP, xG, J)
        self.recompute_expr = dot(pulp, [*((self.y[j], T.rec[j]) for j in J),
                                         *((kj, T.drec[j]) for j, kj in self.k.items())])
        self._add_memory(xP, J)
        # phase 2 caps the objective through this variable's upper bound (None: no cap)
        self.cap = B("objective_cap")
        prob += self.step_expr <= self.cap, "objective_cap"
        self.caps = {MEMORY: B("memory_cap"), GROUPS: B("groups_cap"),
                     RECOMPUTE: B("recompute_cap"), STEP: self.cap}
        prob += self.mem_expr <= self.caps[MEMORY], "memory_cap"
        prob += self.groups_expr <= self.caps[GROUPS], "groups_cap"
        prob += self.recompute_expr <= self.caps[RECOMPUTE], "recompute_cap"
        if self.memory_limit != float("inf"):
            prob += self.mem_expr <= self.memory_limit / GIB, "memory_per_gpu"
        prob.setObjective(self.step_expr)

    def _pairs(self, name: str, left: FactorVars, right: FactorVars, F) -> dict:
        """Pair variables z_ab in [0, 1] for the nesting pairs (a | b) of two components'
        factors F, and their link rows: each row's sum is the left choice, each column's the
        right one ([link])."""
        prob, lin = self.prob, self.pulp.lpSum
        z = {(a, b): prob.add_variable(f"z{name}_{a}_{b}", lowBound=0, upBound=1)
             for a in F for b in F if b % a == 0}
        for a in F:
            prob.addConstraint(lin(v for (i, _), v in z.items() if i == a) == left(a),
                               f"link_{name}_row_{a}")
        for b in F:
            prob.addConstraint(lin(v for (_, k), v in z.items() if k == b) == right(b),
                               f"link_{name}_col_{b}")
        return z

    def _add_hpz(self, xP: FactorVars) -> None:
        """[hpz]: the P choice without hpZ, vPn_f = xPn_f (1 - H), vPq_f = xPq_f (1 - H),
        H = sum_z h_z (at binary x and h the rows force the products); hpZ of size z only on a
        P factor it divides: h_z <= sum of those xP_f H = xP_f - v_f."""
        prob, lin, F = self.prob, self.pulp.lpSum, self.space.factors
        B = prob.add_variable
        self.vPn = {f: B(f"vPn_{f}", lowBound=0) for f in F}
        self.vPq = {f: B(f"vPq_{f}", lowBound=0) for f in self.xPq}
        for name, v, x in (("n", self.vPn, self.xPn), ("q", self.vPq, self.xPq)):
            for f, vf in v.items():
                prob += vf <= x[f], f"p{name}_{f}_without_hpz"
        prob += (lin([*self.vPn.values(), *self.vPq.values()]) == 1 - lin(self.h.values()),
                 "p_without_hpz")
        for z, hz in self.h.items():
            prob += hz <= lin(xP(f) - self.vPn[f] - self.vPq.get(f, 0) for f in F
                              if f > z and f % z == 0), f"hpz_{z}_on_p"

    def _add_engine(self, xP: FactorVars, xG: FactorVars) -> None:
        """The engine's restrictions (SearchSpace.triples, qgz_needs_p): one binary w_t per
        allowed triple t = (p, g, o), sum_t w_t = 1, and each factor binary the sum of the w_t
        that use it (so x picks an allowed triple, and w follows from x); qgZ at most where
        s_P > 1."""
        sp, prob, lin = self.space, self.prob, self.pulp.lpSum
        if sp.triples is not None:
            w = {t: prob.add_variable("w_{}_{}_{}".format(*t), cat="Binary") for t in sp.triples}
            prob += lin(w.values()) == 1, "one_engine_triple"
            for i, c in enumerate(DENSE.components):
                x = self.x[c.key]
                for f in sp.factors:
                    prob += x(f) == lin(v for t, v in w.items() if t[i] == f), f"engine_{c.key}_{f}"
        if sp.fp8ag and not sp.fp8_alone and 1 in self.xPn:  # p = 1: the bf16 space's
            prob += self.xPn[1] == 0, "fp8ag_needs_p"
        if sp.qgz_needs_p and self.xGq:
            prob += (lin(self.xGq.values()) <= lin(xP(f) for f in sp.factors if f > 1),
                     "engine_qgz_needs_p")

    def _add_memory(self, xP: FactorVars, J: list) -> None:
        """The memory rows and ``mem_expr`` (GiB per GPU): the components' states and buffers
        by factor, hpZ's copy, the staging copy, the step buffer, activations, communicators."""
        pulp, T, prob, lin = self.pulp, self.T, self.prob, self.pulp.lpSum
        st = prob.add_variable("staging", lowBound=0)
        self.st = st
        self.st_bounds = [T.perm * lin(v for (p, g), v in self.zPG.items() if 1 < p < g)]
        if self.xGq:
            self.st_bounds.append(T.perm * lin(self.xGq.values()))
        for i, bound in enumerate(self.st_bounds):
            prob += st >= bound, f"staging_{i}"
        states = []
        for cls in self.classes:
            for c in cls.components:
                x, mem = self.x[c.key + cls.tag], T.get(c.mem)
                if c.buf is None:
                    states += [(v, mem[f]) for f, v in x.plain.items()]
                    continue
                plain, quant = T.get(c.buf[0]), T.get(c.buf[1])
                states += [(v, mem[f] + plain[f]) for f, v in x.plain.items()]
                states += [(v, mem[f] + quant[f]) for f, v in x.quant.items()]
        states += self._expert_memory()
        tensors = dot(pulp, [
            *states, *((v, T.mem_h[z]) for z, v in self.h.items()),
            (st, 1.0), *((v, T.step_buf[k]) for k, v in self.zGO.items()),
            *((self.y[j], T.act[j]) for j in J), *((kj, T.dact[j]) for j, kj in self.k.items())])
        tensors += T.fixed
        gpu = self.job.cluster.gpu
        self.mem_expr = (tensors * (1 + gpu.fragmentation_fraction) + self._comm_expr(xP)
                         + gpu.context_reserve_gib)

    def _comm_expr(self, xP):
        """GiB of NCCL communicators: one per distinct (size, stride) of the used group kinds.
        Sets ``groups_expr``, the number of process groups (used by the tie-break)."""
        T, job, lin = self.T, self.job, self.pulp.lpSum
        self.u_bounds = {}
        t = self.space.tp  # data-parallel kinds: sizes over the N/t ranks, strides x t
        n, r = job.num_gpus // t, max(1, job.gpus_per_node // t)
        world = (job.num_gpus, 1)
        uses = [((f, t), xP(f)) for f in self.xPn if f > 1]
        uses += [((z, t), v) for z, v in self.h.items()]
        uses += [((g, t), v) for g, v in self.xGn.items() if g > 1]
        for g, v in self.xGq.items():
            uses += [((min(g, r), t), v), ((max(1, g // r), r * t), v)]
        uses += [((o // g, g * t), v) for (g, o), v in self.zGO.items() if o > g]
        uses += [((n // o, o * t), v) for o, v in self.xO.items() if o < n]
        uses += [((o // p, p * t), v) for (p, o), v in self.zPO.items() if o > p]
        uses += self._expert_uses()
        for key, v in uses:
            if key[0] > 1 and key != world:
                self.u_bounds.setdefault(key, []).append(v)
        self.u = {k: self.prob.add_variable(f"u_{k[0]}_{k[1]}", lowBound=0)
                  for k in self.u_bounds}
        for k, bounds in self.u_bounds.items():
            for i, b in enumerate(bounds):
                self.prob += self.u[k] >= b, f"comm_{k[0]}_{k[1]}_{i}"
        # always used: the world (N > 1) and, with t > 1, the TP group unless it is the world
        self.groups_floor = (1 if job.num_gpus > 1 else 0) + (1 if 1 < t < job.num_gpus else 0)
        self.groups_expr = lin(self.u.values()) + self.groups_floor
        if not T.comm:
            return 0
        a2a = lin(v * T.a2a[g] for g, v in self.xGq.items())
        return T.comm * self.groups_expr + a2a + (T.experts or {}).get("ep_comm", 0.0)


    def _decode(self) -> Strategy:
        val = self.pulp.value

        def pick(d):
            chosen = [k for k, v in d.items() if (val(v) or 0) > 0.5]
            return chosen[0] if chosen else None

        p = pick(self.xPn) or pick(self.xPq)
        g = pick(self.xGn) or pick(self.xGq)
        o = pick(self.xO)
        mb, ck = pick(self.y)
        if ck == "K":
            ck = self.T.krange[mb, ck][0] + round(val(self.k[mb, ck]))
        ex = {}
        if EXPERT in self.classes:
            sp = self.space
            ex = dict(ep=sp.ep, ep_span=sp.ep_span, ep_p=pick(self.x["PE"].plain),
                      ep_g=pick(self.x["GE"].plain), ep_os=pick(self.x["OE"].plain))
        return Strategy(s_p=p, s_g=g, s_os=o, qwz=pick(self.xPq) is not None,
                        fp8ag=self.space.fp8ag and p > 1, hpz=pick(self.h) or 1, qgz=pick(self.xGq) is not None, tp=self.space.tp,
                        micro_batch=mb, **ckpt_fields(ck, self.job.model.num_layers), **ex)

    def _objective(self) -> float:
        """Objective of the current solution in seconds."""
        return self.pulp.value(self.step_expr) * self.T.time_unit

    def _memory(self) -> float:
        """Memory (GiB) of the current solution, with the staging term at its true value
        (the variable is only bounded below, so it may float up when memory is not minimised)."""
        val = self.pulp.value
        true_st = max(val(b) or 0.0 for b in self.st_bounds)
        frag = self.job.cluster.gpu.fragmentation_fraction
        extra_u = sum((val(self.u[k]) or 0.0) - max(val(b) or 0.0 for b in bounds)
                      for k, bounds in self.u_bounds.items())
        return (val(self.mem_expr) - (1 + frag) * ((val(self.st) or 0.0) - true_st)
                - self.T.comm * extra_u)

    def _decision_vars(self):
        """The decision binaries: every family's factor binaries, hpZ's, the options'."""
        for cls in self.classes:
            for c in cls.components:
                x = self.x[c.key + cls.tag]
                yield from x.plain.values()
                yield from x.quant.values()
        for d in (self.h, self.y):
            yield from d.values()

    def _quant_vars(self):
        """The binaries of quantized collectives (qwZ, qgZ) of every family."""
        return [v for cls in self.classes for c in cls.components
                for v in self.x[c.key + cls.tag].quant.values()]

