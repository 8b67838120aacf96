"""The search space: the options of each decision, and the restrictions users pin.

Decisions (each its own set of binaries in the ILP):
  s_P, s_G, s_OS in ``factors`` (AMSP's rules: divisors of N that divide R or are multiples of
  R), nested p | g | os; qwZ on/off; hpZ size in ``hpz`` (1 = off); qgZ on/off; and the
  activation decision (micro-batch, checkpointing) in ``micro_batches`` x ``ckpt``, where a
  checkpointing option is the number K of blocks checkpointed (0 = none, L = every block; the
  first K) or 'op' (op-level selective checkpointing of every block). The full search offers
  K = 0..L, and 'op' where the GPU has an HBM rate (without one the cost model prices the
  elementwise recomputation at zero, so 'op' is only taken when pinned).
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

    @classmethod
    def for_job(cls, job: Job, zeropp: bool = True, micro_batch: int | None = None,
                ckpt: bool | int | str | None = None, max_micro_batch: int = 64) -> SearchSpace:
        """The full space of `job`, restricted by the pinned settings.

        micro_batch/ckpt default to the job's TrainingSpec pins (None = search); a pinned
        checkpointing setting is True (every block), False, a block count K or 'op'.
        """
        n, r = job.num_gpus, job.gpus_per_node
        t = job.training
        mb = micro_batch if micro_batch is not None else t.micro_batch
        ck = ckpt if ckpt is not None else t.activation_checkpointing
        mbs = [mb] if mb is not None else job.micro_batch_options(max_micro_batch)
        hpz = [1] + ([h for h in factor_options(r, r) if 1 < h < min(r, n) or (h == r and n > r)]
                     if zeropp else [])
        return cls(
            factors=tuple(factor_options(n, r)),
            qwz=(False, True) if zeropp and n > 1 else (False,),
            hpz=tuple(hpz),
            qgz=(False, True) if zeropp and n > 1 else (False,),
            micro_batches=tuple(mbs),
            ckpt=ckpt_options(job, ck),
        )

    def candidates(self, job: Job):
        """Every valid complete Strategy (the brute-force enumeration)."""
        fs = self.factors
        for p, g, o in itertools.product(fs, fs, fs):
            if g % p or o % g:
                continue
            for q, h, qg in itertools.product(self.qwz, self.hpz, self.qgz):
                if q and p == 1 or qg and g == 1:
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
