"""The search space: the options of each decision, and the restrictions users pin.

Decisions (each its own set of binaries in the ILP):
  s_P, s_G, s_OS in ``factors`` (AMSP's rules: divisors of N that divide R or are multiples of
  R), nested p | g | os; qwZ on/off; hpZ size in ``hpz`` (1 = off); qgZ on/off; and the
  activation decision (micro-batch, checkpointing) in ``micro_batches`` x ``ckpt``, where a
  checkpointing option is the number K of blocks checkpointed (0 = none, L = every block; the
  first K) or 'op' (op-level selective checkpointing of every block). The full search offers
  K = 0..L, and 'op' where the GPU has an HBM rate (without one the cost model prices the
  elementwise recomputation at zero, so 'op' is only taken when pinned).

The job's engine (amsp_planner/engines.py) restricts the space: ``triples`` lists the
(s_P, s_G, s_OS) it runs (None: every nested triple), its ZeRO++ switches drop out of
``qwz``/``hpz``/``qgz``, and ``qgz_needs_p`` keeps qgZ to strategies that shard parameters. The
ILP adds the same restrictions as constraints, and ``candidates`` enumerates the same space.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import Strategy, checkpointed_blocks, ckpt_fields, factor_options

TIME_RTOL = 1e-7
"""Objective values closer than this (relative) are ties, broken toward less memory: by the
ILP's second solve and by the brute force alike. Wider than the solver's feasibility
tolerance, so a tie is never lost to solver round-off."""


RECOMPUTE = "recompute"
GROUPS = "groups"
MEMORY = "memory"


@dataclass(frozen=True)
class Preference:
    """How the planner chooses among candidates (docs/planner.md, "How a plan is chosen").

    1. Only candidates that keep ``headroom`` (a fraction of the memory limit) free are
       admissible: a constraint, not a preference.
    2. Lossless before quantized (``quantization="auto"``): qwZ/qgZ are admissible only when the
       fastest quantized candidate beats the fastest lossless one by more than ``band``;
       ``"on"`` admits them like any other option, ``"off"`` excludes them.
    3. The admissible candidates whose objective is within ``band`` (relative) of the best are
       equivalent: the step-time model cannot tell them apart. Among them ``tie_breaks`` apply
       in turn: ``"recompute"`` the least recomputation from activation checkpointing (the
       headroom already keeps the plan fitting, so memory is not bought with recompute),
       ``"groups"`` fewest process groups (communicators), ``"memory"`` least memory per GPU.
    """

    band: float = 0.0
    headroom: float = 0.0
    quantization: str = "on"
    tie_breaks: tuple[str, ...] = (MEMORY,)

    def __post_init__(self):
        from amsp_planner.errors import AmspUserError

        if self.quantization not in ("auto", "on", "off"):
            raise AmspUserError(f"--quantization '{self.quantization}': use auto, on or off")
        if not 0 <= self.headroom < 1:
            raise AmspUserError(f"--headroom {self.headroom}: give a fraction of the memory "
                                "limit in [0, 1), e.g. 0.1")
        if not 0 <= self.band < 1:
            raise AmspUserError(f"--tie-band {self.band}: give a fraction in [0, 1), e.g. 0.05")
        for t in self.tie_breaks:
            if t not in (RECOMPUTE, GROUPS, MEMORY):
                raise ValueError(f"unknown tie-break {t!r}")

    @classmethod
    def default(cls, band: float | None = None, headroom: float = 0.10,
                quantization: str = "auto") -> Preference:
        """The planner's rule: the validated step-time band (presets/error_bands.json), 10 %
        headroom, lossless unless quantization wins beyond the band, then the least recompute,
        fewer process groups, less memory."""
        if band is None:
            from amsp_planner.validation import step_time_band

            band = step_time_band()
        return cls(band=band, headroom=headroom, quantization=quantization,
                   tie_breaks=(RECOMPUTE, GROUPS, MEMORY))

    def to_dict(self) -> dict:
        return {"band": self.band, "headroom": self.headroom, "quantization": self.quantization,
                "tie_breaks": list(self.tie_breaks)}

    @classmethod
    def from_dict(cls, d: dict | None) -> Preference:
        """The rule a plan was made with (plans without one: the fastest candidate)."""
        if not d:
            return FASTEST
        return cls(band=d["band"], headroom=d["headroom"], quantization=d["quantization"],
                   tie_breaks=tuple(d["tie_breaks"]))

    def usable(self, memory_limit: float) -> float:
        """Bytes per GPU a candidate may use under this rule."""
        return memory_limit * (1 - self.headroom)


FASTEST = Preference()
"""The fastest candidate, equal objectives (within TIME_RTOL) broken toward less memory."""


def objective_value(e, objective: str) -> float:
    """The objective of an Evaluation: step time ('time') or all collective time ('comm')."""
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

    @classmethod
    def for_job(cls, job: Job, zeropp: bool = True, micro_batch: int | None = None,
                ckpt: bool | int | str | None = None, max_micro_batch: int = 64,
                quantization: bool = True) -> SearchSpace:
        """The space of `job` on its engine, restricted by the pinned settings.

        micro_batch/ckpt default to the job's TrainingSpec pins (None = search); a pinned
        checkpointing setting is True (every block), False, a block count K or 'op'; without
        `quantization` qwZ and qgZ are left out (hpZ stays: it is lossless).
        """
        n, r = job.num_gpus, job.gpus_per_node
        t = job.training
        eng = job.profile
        mb = micro_batch if micro_batch is not None else t.micro_batch
        ck = ckpt if ckpt is not None else t.activation_checkpointing
        mbs = [mb] if mb is not None else job.micro_batch_options(max_micro_batch)
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
        )

    def candidates(self, job: Job):
        """Every valid complete Strategy (the brute-force enumeration)."""
        fs = self.factors
        for p, g, o in itertools.product(fs, fs, fs):
            if g % p or o % g or self.triples is not None and (p, g, o) not in self.triples:
                continue
            for q, h, qg in itertools.product(self.qwz, self.hpz, self.qgz):
                if q and p == 1 or qg and g == 1 or qg and self.qgz_needs_p and p == 1:
                    continue
                if h > 1 and (p <= h or p % h):
                    continue
                for mb, ck in itertools.product(self.micro_batches, self.ckpt):
                    yield Strategy(s_p=p, s_g=g, s_os=o, qwz=q, hpz=h, qgz=qg, micro_batch=mb,
                                   **ckpt_fields(ck, job.model.num_layers))

    def allows_checkpointing(self) -> bool:
        """Whether any option checkpoints something."""
        return any(c != 0 for c in self.ckpt)

    def size(self, job: Job) -> int:
        return sum(1 for _ in self.candidates(job))


def ckpt_options(job: Job, pinned: bool | int | str | None) -> tuple[int | str, ...]:
    """The checkpointing options of the search: every K in 0..L and 'op' (module docstring),
    or the one pinned (True = L, False = 0)."""
    L = job.model.num_layers
    if pinned is None:
        op = ("op",) if job.cluster.gpu.hbm_gbyte_per_s else ()
        return tuple(range(L + 1)) + op
    k, op = checkpointed_blocks(pinned, L)
    if op:
        return ("op",)
    if k > L:
        raise AmspUserError(f"--activation-checkpointing {k}: the model has {L} blocks: use a "
                            f"block count from 0 to {L}, op, on or off")
    return (k,)
