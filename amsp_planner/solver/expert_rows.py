"""The expert class's terms in the ILP (mixture of experts, docs/moe.md): what its factor
binaries (xPnE_f, xGnE_g, xOE_o over ``SearchSpace.expert_factors``) and pair variables
(zPGE, zGOE, zPOE) add to the step rows and the memory rows of solver/formulation.py, with the
tables of solver/expert_tables.py (``Tables.experts``). The family itself (binaries, one-factor
rows, link rows) is the formulation's loop over ``PARAM_CLASSES``.

  gathers    q(gather_fwd, c) += sum_f xPE_f T_eag(f)_c;  q(gather_bwd, c) likewise (no hpZ)
  reduction  q(reduce, c) += sum_g xGE_g T_ers(g)_c;  q(sync, c) += zGOE T_eosrs + xOE T_ear
  kernels    the copy-out / copy-in kernels on the compute stream, as the dense ones
  per step   C_u += sum zPOE T_eupd;  T_opt += sum_o xOE_o T_eopt(o)
  memory     sum xPE (P_e + B_ag,e) + xGE (G_e + B_gr,e) + xOE O_e
             + S_perm,e sum_{1<p<g} zPGE_pg + sum zGOE S_step,e  (each exact at binary x:
             the pair variables are the products there)
  groups     the expert kinds (size, stride) with the EDP stride d: xPE_f -> (f, d),
             xGE_g -> (g, d), zGOE -> (o/g, g d), xOE_o -> (N/e/o, o d), zPOE -> (o/p, p d),
             and the EP group (e, its stride), always used when e > 1.
The token all-to-alls are in the activation options' compute (``tables.tables_for``).
"""

from __future__ import annotations

from amsp_planner.solver.step_rows import dot


class ExpertRows:
    """Mixed into ``Formulation``: the expert class's terms (module docstring)."""

    def _has_experts(self) -> bool:
        return bool(self.space.expert_factors)

    def _add_expert_engine(self) -> None:
        """The engine's (dense, expert) triple pairs (``SearchSpace.expert_pairs``): one binary
        w per pair, sum w = 1, and each factor binary of both classes the sum of the w that use
        it, so the chosen triples are one allowed pair (as ``_add_engine`` for the dense
        triples alone)."""
        pairs = self.space.expert_pairs if self._has_experts() else None
        if pairs is None:
            return
        prob, lin = self.prob, self.pulp.lpSum
        w = {pr: prob.add_variable("we_{}_{}_{}_{}_{}_{}".format(*pr[0], *pr[1]), cat="Binary")
             for pr in pairs}
        prob += lin(w.values()) == 1, "one_engine_expert_pair"
        for side, tag, factors in ((0, "", self.space.factors),
                                   (1, "E", self.space.expert_factors)):
            for i, key in enumerate(("P", "G", "O")):
                x = self.x[key + tag]
                for f in factors:
                    prob += (x(f) == lin(v for pr, v in w.items() if pr[side][i] == f),
                             f"engine_pair_{key}{tag}_{f}")

    def _expert_time(self, q: dict, qx: dict, classes) -> None:
        """Add the expert class's per-unit seconds to the step quantities `q` (and the
        kernels to `qx`), per class."""
        if not self._has_experts():
            return
        E, pulp = self.T.experts, self.pulp
        xP, xG, xO = self.x["PE"].plain, self.x["GE"].plain, self.x["OE"].plain

        def col(d, vars_, i):
            return dot(pulp, ((v, d[k][i]) for k, v in vars_.items()))

        for i, c in enumerate(classes):
            gather = col(E["e_ag"], xP, i)
            q["gather_fwd", c] = q["gather_fwd", c] + gather
            q["gather_bwd", c] = q["gather_bwd", c] + gather
            q["reduce", c] = q["reduce", c] + col(E["e_rs"], xG, i)
            q["sync", c] = (q["sync", c] + col(E["e_osrs"], self.z["GOE"], i)
                            + col(E["e_ar"], xO, i))
            kf, kb = col(E["e_ka"], xP, i), col(E["e_ka"], xP, i) + col(E["e_krs"], xG, i)
            qx["fwd", c] = qx["fwd", c] + kf
            qx["bwd", c] = qx["bwd", c] + kb
            q["fwd", c] = q["fwd", c] + kf
            q["bwd", c] = q["bwd", c] + kb

    def _expert_step_terms(self):
        """(update seconds, optimizer seconds) of the expert class per step (0 without)."""
        if not self._has_experts():
            return 0.0, 0.0
        E, pulp = self.T.experts, self.pulp
        upd = dot(pulp, ((v, E["e_upd"][k]) for k, v in self.z["POE"].items()))
        opt = dot(pulp, ((v, E["e_opt"][o]) for o, v in self.x["OE"].plain.items()))
        return upd, opt

    def _expert_memory(self) -> list:
        """(variable, GiB) terms of the expert class's staging and step buffers."""
        if not self._has_experts():
            return []
        E = self.T.experts
        out = [(v, E["e_perm"]) for (p, g), v in self.z["PGE"].items() if 1 < p < g]
        out += [(v, E["e_step_buf"][k]) for k, v in self.z["GOE"].items()]
        return out

    def _expert_uses(self) -> list:
        """((size, stride), variable or 1) of the expert class's group kinds and the EP
        group."""
        if not self._has_experts():
            return []
        from amsp_planner.strategy_experts import expert_layout

        sp, job = self.space, self.job
        lay = expert_layout(sp.ep, sp.ep_span, job.num_gpus, job.gpus_per_node)
        d, n = lay.edp_stride, lay.edp_size
        uses = [((f, d), v) for f, v in self.x["PE"].plain.items() if f > 1]
        uses += [((g, d), v) for g, v in self.x["GE"].plain.items() if g > 1]
        uses += [((o // g, g * d), v) for (g, o), v in self.z["GOE"].items() if o > g]
        uses += [((n // o, o * d), v) for o, v in self.x["OE"].plain.items() if o < n]
        uses += [((o // p, p * d), v) for (p, o), v in self.z["POE"].items() if o > p]
        if sp.ep > 1:
            uses.append(((lay.ep_size, lay.ep_stride), 1))
        return uses

    def _expert_qmax(self, out: dict, classes) -> None:
        """Add the expert class's largest per-unit values to the big-M quantities."""
        if not self._has_experts():
            return
        E = self.T.experts
        for i, c in enumerate(classes):
            def top(*ds, i=i):
                return max([0.0] + [v[i] for d in ds for v in d.values()])
            out["gather_fwd", c] += top(E["e_ag"])
            out["gather_bwd", c] += top(E["e_ag"])
            out["reduce", c] += top(E["e_rs"])
            out["sync", c] += top(E["e_osrs"]) + top(E["e_ar"])
            out["fwd", c] += top(E["e_ka"])
            out["bwd", c] += top(E["e_ka"]) + top(E["e_krs"])
