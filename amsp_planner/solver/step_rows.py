"""The step-time rows of the ILP: the cost model's step (cost/step_time.py) as linear
constraints over the formulation's variables (solver/formulation.py), and its big-M bounds.

Per-micro-batch collective times (tables T from the cost model's schedule, see
``tables.tables_for``): C_f = sum_f xPn_f T_ag(f) + xPq_f T_agq(f) (forward gathers);
C_bag = sum_f vPn_f T_ag(f) + vPq_f T_agq(f) + sum_z h_z T_hpz(z) (backward gathers: the
  forward ones without hpZ, hpZ's with it; [hpz]);
C_g = sum_g xGn_g T_rs(g) + xGq_g T_qgz(g); C_b = C_bag + C_g. With an engine that gathers a
recomputed block again (Tables.regather r > 0), the block's C_bag and its backward gather
kernels gain r K/L of themselves, each an auxiliary linearised per (option, gather choice)
(``_regather``).
Once per step: C_s = sum_GO zGO T_osrs(g, o) + sum_o xO_o T_ar(o);
C_u = sum_PO zPO T_upd(p, o) + T_metrics. Compute: T_f = sum_j y_j Tf_j,
T_b = sum_j (y_j Tb_j + k_j dTb_j); activations sum_j (y_j A_j + k_j dA_j).

Overlap (cost/step_time.py), linearised with auxiliaries (continuous, >= 0):
  e_f >= C_f - eta T_f;  e_b >= C_b - eta T_b;  e_l >= C_b + C_s - eta T_b
  (eta = the cluster's overlap_efficiency)
  with w = (U-1)/U (the units whose communication can hide behind another's compute):
  E_F >= n_j (w e_f + C_f/U) - M_Fj (1 - Y_b)        [products n x e, per micro-batch b,
  E_B >= (n_j - 1)(w e_b + C_b/U) - M_Bj (1 - Y_b)     Y_b = the sum of its options' y_j]
  step = sum_j y_j n_j (Tf_j + Tb_j) + sum_o xO_o T_opt(o) + E_F + E_B + w e_l
         + (C_b + C_s)/U + C_u                       (T_opt: the AdamW step on Phi/o elements)
With `objective="comm"`: comm >= n_j (C_f + C_b + D) - M (1 - Y_b), + C_s + C_u (D: the
gathers fetched on demand, T_dm, which the step time counts as compute-stream kernels).
With several micro-batch sizes, valid inequalities without big-M bound E_F and E_B from below
(``_add_micro_batch_cuts``): the options' compute times their own n_j plus n_min times the rest.
"""

from __future__ import annotations

import functools

from amsp_planner.cost.schedule import CLASSES
from amsp_planner.cost.step_time import stage_time, stages


def _key(j) -> str:
    """An activation option as a row-name fragment."""
    return "_".join(str(x) for x in j)


def dot(pulp, terms, constant: float = 0.0):
    """sum(c * v for v, c in terms) + constant as one PuLP expression, built in place (PuLP's
    ``lpSum(v * c ...)`` makes two expressions per term; these models have thousands)."""
    e = pulp.LpAffineExpression(constant=constant)
    for v, c in terms:
        e[v] = e.get(v, 0.0) + c
    return e


def _top(i: int, *tables: dict) -> float:
    """The largest class-`i` value in the tables (0 when empty)."""
    return max([0.0] + [v[i] for d in tables for v in d.values()])


class StepRows:
    """The step-time part of ``Formulation``: sets ``step_expr`` (``_add_time``)."""

    def _add_time(self, xP, xG, J) -> None:
        """The step model (cost/step_time.py) as linear constraints: every stage's
        max(m + (1 - eta) c, c + sigma m) an auxiliary variable, the per-micro-batch sums times
        n_j linearised per activation option j (big-M on y_j). Sets ``step_expr``."""
        pulp, T, job, prob = self.pulp, self.T, self.job, self.prob
        B, lin, F = prob.add_variable, pulp.lpSum, self.space.factors
        idx = {c: i for i, c in enumerate(CLASSES)}
        vn, vq = self.vPn, self.vPq

        def col(d, vars_, i):
            return dot(pulp, ((v, d[k][i]) for k, v in vars_.items()))

        def zero2(d2, d, i):  # ZeRO-2 (pair P = 1, G = g): the table d2's in place of d's
            return dot(pulp, ((self.zPG[1, g], x[i] - d[g][i]) for g, x in (d2 or {}).items()
                              if (1, g) in self.zPG))

        q: dict = {}
        qx: dict = {}  # the compute-stream parts that are not the options' compute
        for c, i in idx.items():
            fwd_gather = col(T.ag, self.xPn, i) + col(T.agq, self.xPq, i)
            # linear in v and h: the P choice's gathers when H = 0, hpZ's when H = 1
            bwd_gather = col(T.ag, vn, i) + col(T.agq, vq, i) + col(T.hpz, self.h, i)
            fwd_kernel = col(T.ka, self.xPn, i) + col(T.kq, self.xPq, i)
            k_bwd = col(T.ka, vn, i) + col(T.kq, vq, i) + col(T.khz, self.h, i)
            q["gather_fwd", c] = fwd_gather
            q["gather_bwd", c] = bwd_gather
            q["reduce", c] = (col(T.rs, self.xGn, i) + col(T.qgz, self.xGq, i)
                              + zero2(T.rs2, T.rs, i))
            q["sync", c] = col(T.osrs, self.zGO, i) + col(T.ar, self.xO, i)
            qx["fwd", c] = fwd_kernel
            qx["bwd", c] = (k_bwd + col(T.krs, self.xGn, i) + col(T.kg, self.xGq, i)
                            + zero2(T.krs2, T.krs, i))
            q["fwd", c] = col(T.fwd, self.y, i) + fwd_kernel
            q["bwd", c] = col(T.bwd, self.y, i) + col(T.dbwd, self.k, i) + qx["bwd", c]
        again = self._regather(J)
        if again:  # a checkpointed block's modules gathered once more for its backward
            q["gather_bwd", "block"] = q["gather_bwd", "block"] + again["time"]
            qx["bwd", "block"] = qx["bwd", "block"] + again["kernel"]
            q["bwd", "block"] = q["bwd", "block"] + again["kernel"]
        self._expert_time(q, qx, CLASSES)  # a mixture of experts' class (solver/expert_rows.py)
        e_upd, e_opt = self._expert_step_terms()
        Cu = dot(pulp, ((v, T.upd[k]) for k, v in self.zPO.items()), T.metrics) + e_upd
        t_opt = dot(pulp, ((self.xO[o], T.opt[o]) for o in F)) + e_opt
        counts = {"embedding": 1, "block": job.model.num_layers, "head": 1}
        if self.objective == "comm":  # the gathers fetched on demand count too (T.dm)
            demand = {c: col(T.dm, self.xPn, i) + col(T.dmq, self.xPq, i) + col(T.dm, vn, i)
                      + col(T.dmq, vq, i) + col(T.dmh, self.h, i) for c, i in idx.items()}
            if again:
                demand["block"] = demand["block"] + again["demand"]
            per_mb = lin(counts[c] * (q["gather_fwd", c] + q["gather_bwd", c] + q["reduce", c]
                                      + demand[c]) for c in CLASSES)
            bound = self._bound_comm()
            CC = B("C_micro", lowBound=0)
            for mb, (nj, ymb) in self._per_micro_batch(J).items():
                prob += CC >= nj * per_mb - nj * bound * (1 - ymb), f"comm_x_n_mb{mb}"
            tp_comm = (lin(self.y[j] * T.tpc[j] for j in J)
                       + lin(kj * T.dtpc[j] for j, kj in self.k.items()))
            self.step_expr = CC + lin(counts[c] * q["sync", c] for c in CLASSES) + Cu + tp_comm
            return
        gpu, eta = job.cluster.gpu, job.cluster.overlap_efficiency
        sig = gpu.comm_compute_slowdown
        n_aux = iter(range(10**6))

        def vmax(a, b):
            v = B(f"stage_{next(n_aux)}", lowBound=0)
            prob.addConstraint(v >= a, f"{v.name}_comm")
            prob.addConstraint(v >= b, f"{v.name}_compute")
            return v

        sts, ends = stages(job.model.num_layers, lambda r, c: q[r, c], 0)
        phase = {p: ends[p] + lin(st.count * stage_time(st.compute, st.comm, sig, eta, vmax)
                                  for st in sts if st.phase == p)
                 for p in ("forward", "backward", "last")}
        EF, EB = B("E_F", lowBound=0), B("E_B", lowBound=0)
        for mb, (nj, ymb) in self._per_micro_batch(J).items():
            prob += EF >= nj * phase["forward"] - nj * self._bound_phase("forward") * (
                1 - ymb), f"fwd_x_n_mb{mb}"
            if nj > 1:
                prob += EB >= (nj - 1) * phase["backward"] - (nj - 1) * self._bound_phase(
                    "backward") * (1 - ymb), f"bwd_x_n_mb{mb}"
        self._add_micro_batch_cuts(J, q, qx, EF, EB, sig, eta)
        self.step_expr = EF + EB + phase["last"] + t_opt + Cu

    def _regather(self, J) -> dict:
        """The re-gathers of checkpointed blocks (cost/schedule.py ``regather``): per block
        call, r K/L times the block's backward gathers (their time, kernels, and the part
        fetched on demand), K the blocks option j checkpoints (lo + k_j for a range). Each an
        auxiliary rho >= 0 with, per option j and backward gather choice c (vPn_f, vPq_f,
        h_z, each 0 or 1 at an integer point),
            rho >= (r T_c / L)(K_lo,j y_j + k_j) - M (2 - y_j - c),   M = r max_c T_c,
        exact at integer points (y_j = c = 1: the product; otherwise <= 0); the step time
        grows with rho, so the optimum takes the bound. {} when the engine re-gathers
        nothing."""
        T, r = self.T, self.T.regather
        if not r or not T.kblocks:
            return {}
        pulp, prob, B = self.pulp, self.prob, self.prob.add_variable
        i, L = CLASSES.index("block"), self.job.model.num_layers
        out = {}
        for name, tabs in (("time", (T.ag, T.agq, T.hpz)), ("kernel", (T.ka, T.kq, T.khz)),
                           ("demand", (T.dm, T.dmq, T.dmh))):
            if name == "demand" and self.objective != "comm":
                continue
            rho = out[name] = B(f"regather_{name}", lowBound=0)
            choices = [(v, d[key][i]) for d, vs in zip(tabs, (self.vPn, self.vPq, self.h),
                                                       strict=True)
                       for key, v in vs.items() if key in d and d[key][i] > 0]
            if not choices:
                continue
            big = r * max(x for _, x in choices)
            for j in J:
                lo, kj = T.kblocks[j], self.k.get(j)
                if not lo and kj is None:
                    continue
                for n, (v, x) in enumerate(choices):
                    terms = [(self.y[j], r * x * lo / L + big), (v, big)]
                    if kj is not None:
                        terms.append((kj, r * x / L))
                    prob += rho >= dot(pulp, terms, -2 * big), f"regather_{name}_{_key(j)}_{n}"
        return out

    def _add_micro_batch_cuts(self, J, q, qx, EF, EB, sig, eta) -> None:
        """Valid inequalities for E_F and E_B without the big-M of the micro-batch products.

        With several micro-batch sizes the LP relaxation splits y between them and the big-M
        rows ``E >= n (phase) - M (1 - Y_b)`` go slack: its root bound fell 45-88 % below the
        optimum (llama-7b/1024, degrees 2-8) and HiGHS branched on the micro-batch. A stage
        costs at least each argument of its max() (``stage_time``), so a phase is at least
        ``Yp(j) + Xp(x)`` with Yp the
        compute part of option j (a number per option, and per block checkpointed for k_j)
        and Xp the rest (gathers, reductions, kernels: linear in x, never negative). Times n_j,
        the compute part is exact in y and k (one option is chosen, n_j is its own), and
        n_j Xp >= n_min Xp. So, per phase p (forward: n; backward: n - 1),
            E_p >= sum_j (n_j - o) (y_j Yp1(j) + k_j dYp1(j)) + (n_min - o) Xp1(x)
        and the same with the other argument of the max(), (1 - eta) on the compute and
        comm + (1 - eta) kernels. Every integer solution satisfies them; the optimum is
        unchanged and the root bound is within about 1 %. With one micro-batch size the big-M
        rows are already exact (Y_b = 1) and no cut is added."""
        if len({j[0] for j in J}) < 2:
            return
        T, prob, lin = self.T, self.prob, self.pulp.lpSum
        L = self.job.model.num_layers
        idx = {c: i for i, c in enumerate(CLASSES)}
        phases = ("forward", "backward")

        def rest(r, c):  # everything but the options' compute
            return qx[r, c] if r in ("fwd", "bwd") else q[r, c]

        sts, ends = stages(L, rest, 0)
        x1 = {p: ends[p] + lin(st.count * (st.compute + sig * st.comm)
                               for st in sts if st.phase == p) for p in phases}
        x2 = {p: ends[p] + lin(st.count * (st.comm + (1 - eta) * st.compute)
                               for st in sts if st.phase == p) for p in phases}

        def compute_part(fwd, bwd):  # {phase: sum over stages of count x the option's compute}
            def qc(r, c):
                d = fwd if r == "fwd" else bwd if r == "bwd" else None
                return d[idx[c]] if d is not None else 0.0
            got, _ = stages(L, qc, 0.0)
            return {p: sum(st.count * st.compute for st in got if st.phase == p) for p in phases}

        Y = {j: compute_part(T.fwd[j], T.bwd[j]) for j in J}
        dY = {j: compute_part(None, T.dbwd[j]) for j in self.k}
        n_min = min(T.n[j] for j in J)
        for p, E, o in (("forward", EF, 0), ("backward", EB, 1)):
            yc = dot(self.pulp, [*((self.y[j], (T.n[j] - o) * Y[j][p]) for j in J),
                                  *((kj, (T.n[j] - o) * dY[j][p]) for j, kj in self.k.items())])
            prob += E >= yc + (n_min - o) * x1[p], f"{p}_micro_batch_cut_1"
            prob += E >= (1 - eta) * yc + (n_min - o) * x2[p], f"{p}_micro_batch_cut_2"

    def _per_micro_batch(self, J) -> dict:
        """micro-batch -> (n, the sum of its options' y): the products with n need one big-M
        per micro-batch, not per option (the checkpointing options of a micro-batch share n)."""
        out: dict = {}
        for j in J:
            n, ys = out.get(j[0], (self.T.n[j], []))
            out[j[0]] = (n, ys + [self.y[j]])
        return {mb: (n, self.pulp.lpSum(ys)) for mb, (n, ys) in out.items()}

    def _qmax(self) -> dict:
        """Each (role, class) quantity's largest value over the space (for big-M bounds)."""
        T = self.T
        out = {}
        for i, c in enumerate(CLASSES):
            top = functools.partial(_top, i)
            out["gather_fwd", c] = top(T.ag, T.agq)
            again = 1 + (self.T.regather if c == "block" else 0.0)  # re-gathers: _regather
            out["gather_bwd", c] = top(T.ag, T.agq, T.hpz) * again
            out["reduce", c] = top(T.rs, T.qgz, T.rs2 or {})
            out["sync", c] = top(T.osrs) + top(T.ar)
            out["fwd", c] = top(T.fwd) + top(T.ka, T.kq)
            out["bwd", c] = (top(T.bwd, T.bwd_hi) + top(T.ka, T.kq, T.khz) * again
                             + top(T.krs, T.kg, T.krs2 or {}))
            out["demand", c] = top(T.dm, T.dmq) + top(T.dm, T.dmq, T.dmh) * again
        self._expert_qmax(out, CLASSES)
        return out

    def _bound_phase(self, phase: str) -> float:
        """An upper bound of one micro-batch's phase time: every stage at c + m, all maximal."""
        qm = self._qmax()
        sts, ends = stages(self.job.model.num_layers, lambda r, c: qm[r, c], 0.0)
        return ends[phase] + sum(st.count * (st.compute + st.comm) for st in sts
                                 if st.phase == phase)

    def _bound_comm(self) -> float:
        """An upper bound of one micro-batch's collective time."""
        qm = self._qmax()
        L = self.job.model.num_layers
        return sum((L if c == "block" else 1) * (qm["gather_fwd", c] + qm["gather_bwd", c]
                                                 + qm["reduce", c] + qm["demand", c])
                   for c in CLASSES)
