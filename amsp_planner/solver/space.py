"""The search space: the options of each decision, and the restrictions users pin.

Decisions (each its own set of binaries in the ILP):
  s_P, s_G, s_OS in ``factors`` (AMSP's rules: divisors of N that divide R or are multiples of
  R), nested p | g | os; qwZ on/off; hpZ size in ``hpz`` (1 = off); qgZ on/off; and the
  activation decision (micro-batch, checkpointing) in ``micro_batches`` x ``ckpt``, where a
  checkpointing option is the number K of blocks checkpointed (0 = none, L = every block; the
  first K) or 'op' (op-level selective checkpointing of every block). The full search offers
  K = 0..L, and 'op' where the GPU has an HBM rate (without one the cost model prices the
  elementwise recomputation at zero, so 'op' is only taken when pinned).

Tensor parallelism: the degree t (``tp``) is searched over ``Job.tp_options`` (divisors of the
GPUs per node that divide the heads, that the engine runs and whose N/t data-parallel ranks
divide the batch), or pinned. Every option above depends on t (the factors are over the N/t
data-parallel ranks, R/t per node; the micro-batches divide the sequences per data-parallel
rank), so a space holds one t, and ``also`` the spaces of the other degrees searched with it:
``by_tp`` lists them, ``candidates`` enumerates them all, and the ILP builds one model per t
(solver/ilp.py; across the degrees, solver/choice.py).

Mixture of experts (docs/moe.md): one space per expert-parallel degree e and placement
(``expert_spaces``; with the TP degree, e is a part of the space as t is), each with the expert
class's factors (``expert_factors``: over the N/e ranks holding the same experts) searched
together with the dense triple; ZeRO++ and op-level checkpointing are left out.

The job's engine (amsp_planner/engines.py) restricts the space: ``triples`` lists the
(s_P, s_G, s_OS) it runs (None: every nested triple), its ZeRO++ switches drop out of
``qwz``/``hpz``/``qgz``, and ``qgz_needs_p`` keeps qgZ to strategies that shard parameters. The
ILP adds the same restrictions as constraints, and ``candidates`` enumerates the same space.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import Strategy, checkpointed_blocks, ckpt_fields, factor_options
from amsp_planner.strategy_experts import nested_triples

TIME_RTOL = 1e-7
"""Objective values closer than this (relative) are ties, in the ILP's re-solves and the brute
force alike: wider than the solver's feasibility tolerance, never lost to round-off."""


RECOMPUTE = "recompute"
GROUPS = "groups"
STEP = "step"
MEMORY = "memory"
TIE_BREAKS = (RECOMPUTE, GROUPS, STEP, MEMORY)
"""The tie-breaks a ``Preference`` may name (``step``: the objective itself)."""
PREFER = {"speed": (RECOMPUTE, GROUPS, STEP, MEMORY), "memory": (RECOMPUTE, GROUPS, MEMORY, STEP)}
"""``--prefer``: the order of the last two tie-breaks inside the band (docs/planner.md)."""

MEMORY_RTOL = 1e-6
"""Memory per GPU and recompute closer than this (relative) tie, in every solver alike."""


def tie_rtol(name: str) -> float:
    """Relative tolerance of a tie on tie-break `name` (process groups are counts: exact)."""
    return {GROUPS: 0.0, STEP: TIME_RTOL}.get(name, MEMORY_RTOL)


@dataclass(frozen=True)
class Preference:
    """How the planner chooses among candidates (docs/planner.md, "How a plan is chosen").

    1. Only candidates that keep ``headroom`` (a fraction of the memory limit) free are
       admissible: a constraint, not a preference.
    2. Lossless before quantized (``quantization="auto"``): qwZ/qgZ are admissible only when the
       fastest quantized candidate beats the fastest lossless one by more than ``band``;
       ``"on"`` admits them like any other option, ``"off"`` excludes them.
    3. The admissible candidates whose objective is within ``band`` (relative) of the fastest
       admissible one, quantized or not, are equivalent: the model's error on the ratio of two
       strategies' predictions (the relative band) cannot tell them apart; so no choice is
       slower than any admissible candidate, a named baseline included, by more than the
       band. Among them ``tie_breaks`` apply in turn: ``"recompute"`` the least recomputation
       from activation checkpointing (the headroom already keeps the plan fitting, so memory
       is not bought with recompute), ``"groups"`` fewest process groups (communicators),
       ``"step"`` the lowest objective (inside the band the model cannot prove one plan the
       faster, but the predicted-faster one is the likelier; the headroom, a constraint,
       already covers memory), ``"memory"`` least memory per GPU.

    ``ceiling``, when set, is an objective value (seconds) no admissible candidate may exceed:
    a plan known to run on the job, as the what-if sweep's choice at a point with less of a
    resource (docs/whatif.md, "Monotone sweeps"); a constraint like the headroom.
    """

    band: float = 0.0
    headroom: float = 0.0
    quantization: str = "on"
    tie_breaks: tuple[str, ...] = (MEMORY,)
    ceiling: float | None = None

    def __post_init__(self):
        if self.quantization not in ("auto", "on", "off"):
            raise AmspUserError(f"--quantization '{self.quantization}': use auto, on or off")
        if not 0 <= self.headroom < 1:
            raise AmspUserError(f"--headroom {self.headroom}: give a fraction of the memory "
                                "limit in [0, 1), e.g. 0.1")
        if not 0 <= self.band < 1:
            raise AmspUserError(f"--tie-band {self.band}: give a fraction in [0, 1), e.g. 0.05")
        for t in self.tie_breaks:
            if t not in TIE_BREAKS:
                raise ValueError(f"unknown tie-break {t!r}")

    @classmethod
    def default(cls, band: float | None = None, headroom: float = 0.10,
                quantization: str = "auto", job: Job | None = None,
                prefer: str = "speed") -> Preference:
        """The planner's rule: the validated relative band of `job` (``validated_band``), 10 %
        headroom, lossless unless quantization wins beyond the band, then the least recompute,
        fewer process groups, the lower predicted objective, less memory (`prefer` "memory":
        less memory before the objective, ``PREFER``)."""
        if band is None:
            band = validated_band(job)
        if prefer not in PREFER:
            raise AmspUserError(f"--prefer '{prefer}': use {' or '.join(PREFER)}")
        return cls(band=band, headroom=headroom, quantization=quantization,
                   tie_breaks=PREFER[prefer])

    def to_dict(self) -> dict:
        d = {"band": self.band, "headroom": self.headroom, "quantization": self.quantization,
             "tie_breaks": list(self.tie_breaks)}
        if self.ceiling is not None:
            d["ceiling"] = self.ceiling
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> Preference:
        """The rule a plan was made with (plans without one: the fastest candidate)."""
        if not d:
            return FASTEST
        return cls(band=d["band"], headroom=d["headroom"], quantization=d["quantization"],
                   tie_breaks=tuple(d["tie_breaks"]), ceiling=d.get("ceiling"))

    def under_ceiling(self, value: float) -> bool:
        """Whether an objective value is admissible under ``ceiling`` (to the agreement of the
        cost model and the solver's tables, ``CEILING_RTOL``)."""
        return self.ceiling is None or value <= self.ceiling * (1 + CEILING_RTOL) + 1e-15

    def usable(self, memory_limit: float) -> float:
        """Bytes per GPU a candidate may use under this rule."""
        return memory_limit * (1 - self.headroom)


CEILING_RTOL = 1e-6
"""A ceiling admits the plan it was read from: the solver's tables and the cost model agree on
an objective to 1e-6 (solver/solve.py checks it)."""


def validated_band(job: Job | None = None) -> float:
    """The planner's tie band: the validated 90th-percentile error of the predicted ratio of two
    strategies' throughput on one job (``relative_band`` of presets/error_bands.json: `job`'s
    engine's pairs, else its scale's, else all pairs; docs/validation.md, "Relative band"),
    and the absolute step-time band where no pair has been measured."""
    from amsp_planner.validation import relative_band, step_time_band

    rel = relative_band(job.engine, job.num_gpus) if job is not None else relative_band()
    return step_time_band() if rel is None else rel


FASTEST = Preference()
"""The fastest candidate, equal objectives (within TIME_RTOL) broken toward less memory."""

def objective_value(e, objective: str) -> float:
    """Searched: the step ('time': with cost/straggler.py's terms), or all comm."""
    return e.time.step_s if objective == "time" else e.time.comm_total_s


@dataclass(frozen=True)
class SearchSpace:
    factors: tuple[int, ...]
    qwz: tuple[bool, ...]
    hpz: tuple[int, ...]
    qgz: tuple[bool, ...]
    micro_batches: tuple[int, ...]
    ckpt: tuple[int | str, ...]
    """Checkpointing options: blocks checkpointed K (0..L) or 'op'."""
    triples: tuple[tuple[int, int, int], ...] | None = None
    """The (s_P, s_G, s_OS) the engine runs; None: every nested triple over ``factors``."""
    qgz_needs_p: bool = False
    """qgZ only with s_P > 1 (DeepSpeed: stage 3 only)."""
    tp: int = 1
    """The tensor-parallel degree of this space (its factors are over the N/tp ranks)."""
    also: tuple[SearchSpace, ...] = ()
    """The spaces of the other tensor-parallel degrees searched with this one (and, for a
    mixture of experts, of the other expert-parallel degrees and placements)."""
    ep: int = 1
    """Mixture of experts: the expert-parallel degree e of this space."""
    ep_span: bool = False
    """Its placement: the EP group strided across nodes (``strategy_experts.py``)."""
    expert_factors: tuple[int, ...] = ()
    """The expert class's shard factors at this degree and placement (empty: a dense model)."""
    expert_pairs: tuple | None = None
    """The (dense triple, expert triple) pairs the engine runs at this degree and placement
    (``engine_experts.expert_pairs``, its profile's ``expert_rule``); None: every pair."""
    fp8ag: bool = False
    """Its parameter all-gathers in FP8 (``--precision fp8``; ``fp8_spaces``): no qwZ."""
    fp8_alone: bool = False
    """With ``fp8ag``: no bf16 space beside it (``--fp8-all-gather on``), so its s_P = 1
    strategies are its own."""

    def by_tp(self) -> tuple[SearchSpace, ...]:
        """One space per tensor-parallel degree searched, this one's first."""
        return (replace(self, also=()),) + self.also

    @property
    def tps(self) -> tuple[int, ...]:
        return tuple(sp.tp for sp in self.by_tp())

    @classmethod
    def for_job(cls, job: Job, zeropp: bool = True, micro_batch: int | None = None,
                ckpt: bool | int | str | None = None, max_micro_batch: int = 64,
                quantization: bool = True, tp: int | None = None,
                ep: int | None = None) -> SearchSpace:
        """The space of `job` on its engine, restricted by the pinned settings.

        micro_batch/ckpt default to the job's TrainingSpec pins (None = search); a pinned
        checkpointing setting is True (every block), False, a block count K or 'op'; without
        `quantization` qwZ and qgZ are left out (hpZ stays: it is lossless); `tp` pins the
        tensor-parallel degree (None: every degree of ``Job.tp_options``); `ep` the
        expert-parallel degree of a mixture of experts (None: every degree, both placements).
        """
        tps = tp_choices(job, tp)
        spaces = [cls._for_tp(job, t, zeropp, micro_batch, ckpt, max_micro_batch, quantization)
                  for t in tps]
        spaces = [sp for sp in spaces if sp.micro_batches] or spaces[:1]
        if job.model.is_moe:
            spaces = expert_spaces(job, spaces, ep)
        spaces = fp8_spaces(job, spaces)
        return replace(spaces[0], also=tuple(spaces[1:]))

    @classmethod
    def _for_tp(cls, job: Job, tp: int, zeropp: bool, micro_batch: int | None,
                ckpt: bool | int | str | None, max_micro_batch: int,
                quantization: bool) -> SearchSpace:
        n, r = job.num_gpus // tp, max(1, job.gpus_per_node // tp)
        t = job.training
        eng = job.profile
        mb = micro_batch if micro_batch is not None else t.micro_batch
        ck = ckpt if ckpt is not None else t.activation_checkpointing
        mbs = [mb] if mb is not None else job.micro_batch_options(max_micro_batch, tp)
        hpz = [1] + ([h for h in factor_options(r, r) if 1 < h < min(r, n) or (h == r and n > r)]
                     if zeropp and eng.hpz else [])
        triples = eng.triples(n, r, t)
        factors = (factor_options(n, r) if triples is None
                   else sorted({f for tr in triples for f in tr}))
        return cls(
            factors=tuple(factors),
            qwz=(False, True) if zeropp and quantization and eng.qwz and n > 1 else (False,),
            hpz=tuple(hpz),
            qgz=(False, True) if zeropp and quantization and eng.qgz and n > 1 else (False,),
            micro_batches=tuple(mbs),
            ckpt=tuple(c for c in ckpt_options(job, ck)
                       if ck is not None or eng.runs_ckpt(c, job.model.num_layers)),
            triples=triples,
            qgz_needs_p=eng.qgz_needs_p,
            tp=tp,
        )

    def candidates(self, job: Job):
        """Every valid complete Strategy (the brute-force enumeration), every degree of
        ``by_tp``."""
        for sp in self.by_tp():
            yield from sp._candidates(job)

    def _candidates(self, job: Job):
        if self.expert_factors:
            yield from self._expert_candidates(job)
            return
        fs = self.factors
        for p, g, o in itertools.product(fs, fs, fs):
            if g % p or o % g or self.triples is not None and (p, g, o) not in self.triples:
                continue
            if p == 1 and self.fp8ag and not self.fp8_alone:  # the bf16 space's
                continue
            for q, h, qg in itertools.product(self.qwz, self.hpz, self.qgz):
                if q and p == 1 or qg and g == 1 or qg and self.qgz_needs_p and p == 1:
                    continue
                if h > 1 and (p <= h or p % h):
                    continue
                for mb, ck in itertools.product(self.micro_batches, self.ckpt):
                    yield Strategy(s_p=p, s_g=g, s_os=o, qwz=q, hpz=h, qgz=qg, micro_batch=mb,
                                   tp=self.tp, fp8ag=self.fp8ag and p > 1, **ckpt_fields(ck, job.model.num_layers))

    def _expert_candidates(self, job: Job):
        """The dense candidates (no ZeRO++ in a mixture-of-experts space) x the nested expert
        triples at this space's degree and placement."""
        triples = nested_triples(self.expert_factors)
        pairs = None if self.expert_pairs is None else set(self.expert_pairs)
        for s in replace(self, expert_factors=(), expert_pairs=None)._candidates(job):
            for t in triples:
                if pairs is None or ((s.s_p, s.s_g, s.s_os), t) in pairs:
                    yield s.with_(ep=self.ep, ep_span=self.ep_span, ep_p=t[0], ep_g=t[1],
                                  ep_os=t[2])

    def allows_checkpointing(self) -> bool:
        """Whether any option checkpoints something."""
        return any(c != 0 for c in self.ckpt)

    def size(self, job: Job) -> int:
        return sum(1 for _ in self.candidates(job))


def expert_spaces(job: Job, spaces: list[SearchSpace], pinned: int | None
                  ) -> list[SearchSpace]:
    """A mixture of experts' spaces: each of `spaces` at every expert-parallel degree and
    placement the job admits (``strategy_experts.ep_options``) and its engine runs
    (``engine_experts``: the pairs of dense and expert triples of its profile's
    ``expert_rule``), or the pinned degree's, with its expert factors; ZeRO++ and op-level
    checkpointing left out (docs/moe.md)."""
    from amsp_planner.strategy_experts import ep_options

    n, r, E = job.num_gpus, job.gpus_per_node, job.model.num_experts
    admitted = ep_options(E, n, r)
    opts = [o for o in admitted if any(_engine_part(job, sp, *o) is not None for sp in spaces)]
    if pinned is not None:
        if pinned in {e for e, _ in admitted} and pinned not in {e for e, _ in opts}:
            raise AmspUserError(
                f"--ep {pinned}: {job.profile.title} does not run expert parallelism of degree "
                f"{pinned} on this job (its expert rule '{job.profile.expert_rule}', "
                f"docs/moe.md): use one of {', '.join(str(e) for e in sorted({e for e, _ in opts}))}"
                " or another --engine")
        if pinned not in {e for e, _ in opts}:
            raise AmspUserError(
                f"--ep {pinned}: the expert-parallel degree must divide the {E} experts and the "
                f"{n} GPUs (and the node size, or be whole nodes): use one of "
                f"{', '.join(str(e) for e in sorted({e for e, _ in opts}))}")
        opts = [(e, span) for e, span in opts if e == pinned]
    parts = [(sp, e, span, _engine_part(job, sp, e, span)) for sp in spaces for e, span in opts]
    return [replace(sp, ep=e, ep_span=span, qwz=(False,), hpz=(1,), qgz=(False,),
                    ckpt=tuple(c for c in sp.ckpt if c != "op"), expert_factors=part[0],
                    expert_pairs=part[1])
            for sp, e, span, part in parts if part is not None]


def _engine_part(job: Job, sp: SearchSpace, e: int, span: bool):
    """(expert factors, allowed pairs) of space `sp` at (e, span) on the job's engine, or None
    when the engine runs no expert setting there (engine_experts.py)."""
    from amsp_planner.engine_experts import expert_pairs
    from amsp_planner.strategy_experts import expert_factor_options

    n, r = job.num_gpus, job.gpus_per_node
    fe = tuple(expert_factor_options(e, span, n, r))
    dense = sp.triples
    if dense is None:
        fs = sp.factors
        dense = nested_triples(fs)
    pairs = expert_pairs(job.profile.expert_rule, list(dense), e, span, n, r)
    if pairs is None:
        return fe, None
    pairs = tuple(pr for pr in pairs if set(pr[1]) <= set(fe) and set(pr[0]) <= set(sp.factors))
    return (fe, pairs) if pairs else None


def fp8_spaces(job: Job, spaces: list[SearchSpace]) -> list[SearchSpace]:
    """With ``--precision fp8`` and an FP8 all-gather the engine and recipe run
    (``cost/fp8.py: fp8_all_gather_supported``): each space again with FP8 parameter
    all-gathers in place of qwZ (``fp8ag``); ``--fp8-all-gather auto`` searches both,
    ``on`` the FP8 ones alone, ``off`` (and every bf16 or fp32 job) the bf16 ones."""
    t = job.training
    if t.precision != "fp8" or t.fp8_all_gather == "off" or job.model.is_moe:
        return spaces
    from amsp_planner.cost.fp8 import check_training, fp8_all_gather_supported

    if not fp8_all_gather_supported(check_training(t, job.engine, job.cluster.gpu.arch),
                                    job.engine):
        return spaces
    alone = t.fp8_all_gather == "on"
    fp8 = [replace(sp, fp8ag=True, fp8_alone=alone, qwz=(False,)) for sp in spaces
           if any(tr[0] > 1 for tr in (sp.triples or [(f,) for f in sp.factors]))]
    return (fp8 or spaces) if alone else spaces + fp8


def tp_choices(job: Job, pinned: int | None, auto: bool = True) -> tuple[int, ...]:
    """The TP degrees to search: ``Job.tp_options``, or the one pinned (checked, its fix)."""
    opts = job.tp_options()
    if pinned is None:
        return opts or (1,)
    if pinned in opts:
        return (pinned,)
    r, m = job.gpus_per_node, job.model
    if r % pinned:
        why = (f"tensor parallelism stays inside the node and {pinned} does not divide its "
               f"{r} GPUs")
    elif m.num_heads % pinned or m.kv_heads % pinned:
        why = (f"{pinned} does not divide the {m.num_heads} query and {m.kv_heads} key/value "
               f"heads of {m.name}")
    elif not job.profile.tp:
        why = f"{job.profile.title} does not run it ({job.profile.tp_note})"
    elif m.is_moe:
        why = f"tensor parallelism of a mixture of experts ({m.name}) is not modelled (docs/moe.md)"
    else:
        why = (f"the global batch of {job.training.batch_seqs} sequences is not a multiple of "
               f"{job.num_gpus // pinned} (its data-parallel ranks), so a rank would hold part "
               "of a sequence")
    raise AmspUserError(f"--tp {pinned}: {why}: use {'--tp auto or ' if auto else ''}one of "
                        f"{', '.join(map(str, opts)) or '1'}")


def ckpt_options(job: Job, pinned: bool | int | str | None) -> tuple[int | str, ...]:
    """The checkpointing options of the search: every K in 0..L and 'op' (module docstring),
    or the one pinned (True = L, False = 0)."""
    L = job.model.num_layers
    if pinned is None:
        op = ("op",) if job.cluster.gpu.hbm_gbyte_per_s else ()
        return tuple(range(L + 1)) + op + (("moe",) if job.model.num_moe_layers else ())
    if pinned == "moe":
        if not job.model.num_moe_layers:
            raise AmspUserError("--activation-checkpointing moe: the model has no MoE layers: "
                                "use a block count, op, on or off")
        return ("moe",)
    k, op = checkpointed_blocks(pinned, L)
    if op:
        return ("op",)
    if k > L:
        raise AmspUserError(f"--activation-checkpointing {k}: the model has {L} blocks: use a "
                            f"block count from 0 to {L}, op, on or off")
    return (k,)
