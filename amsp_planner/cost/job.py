"""Job: model + cluster + training + GPU count, validated together, with padded units."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from amsp_planner.engines import DEFAULT_ENGINE, EngineProfile, profile
from amsp_planner.errors import AmspUserError
from amsp_planner.specs.cluster import ClusterSpec
from amsp_planner.specs.model import ModelSpec
from amsp_planner.specs.training import TrainingSpec
from amsp_planner.strategy import PAD_QUANTUM, Strategy
from amsp_planner.topology import Topology


def batch_source(training: TrainingSpec) -> str:
    """The option that set the global batch, with its value, as the user wrote it."""
    if training.global_batch_tokens is not None:
        return f"--global-batch {training.global_batch_tokens}"
    if training.global_batch_seqs is not None:
        return f"--global-batch-seqs {training.global_batch_seqs}"
    return "the default --global-batch 4M"


def batch_choices(seqs: float, num_gpus: int, micro_batch: int | None = None) -> list[int]:
    """The global batches in sequences nearest `seqs`, below and above, that split evenly over
    every data-parallel degree of the job: multiples of the GPUs x the pinned micro-batch.
    A batch that only N/t ranks divide would force tensor parallelism t on the plan (896
    sequences on 1024 GPUs: tp=8 and 16 % fewer tokens/s than 1024 sequences at tp=1)."""
    step = num_gpus * (micro_batch or 1)
    below = int(seqs // step) * step
    above = -(-math.ceil(seqs) // step) * step
    return sorted({v for v in (below, above) if v >= step})


def batch_fix(training: TrainingSpec, seqs: float, num_gpus: int) -> str:
    """'use OPTION VALUE ... or OPTION VALUE': the nearest batches that split evenly
    (``batch_choices``), in the unit of the option the user gave (tokens for --global-batch,
    the default's option too; sequences for --global-batch-seqs)."""
    return _fix(training.seq_len, training.micro_batch, training.global_batch_seqs is not None,
                seqs, num_gpus)


def _fix(seq_len: int, micro_batch: int | None, in_seqs: bool, seqs: float, num_gpus: int):
    out = [f"--global-batch-seqs {v}" if in_seqs else f"--global-batch {v * seq_len} "
           f"({v:,} sequences)" for v in batch_choices(seqs, num_gpus, micro_batch)]
    return "use " + " or ".join(out)


def check_batch_tokens(tokens: int | None, seq_len: int, micro_batch: int | None,
                       num_gpus: int) -> None:
    """A global batch in tokens (None: the default 4M) must be whole sequences: refused in one
    line naming --global-batch and the nearest batches that also split evenly over the GPUs."""
    from amsp_planner.specs.training import DEFAULT_BATCH_TOKENS

    t = DEFAULT_BATCH_TOKENS if tokens is None else tokens
    if t % seq_len == 0:
        return
    what = (f"--global-batch {tokens}" if tokens is not None else
            "the default global batch (--global-batch 4M)")
    raise AmspUserError(f"{what}: {t:,} tokens are not whole sequences of --seq-len {seq_len}; "
                        f"{_fix(seq_len, micro_batch, False, t / seq_len, num_gpus)}")


def _check_offload(model: ModelSpec, cluster: ClusterSpec, engine: str) -> None:
    """Optimizer offload (cost/offload.py) is priced for DeepSpeed on dense models, on a
    cluster that gives its host link and host memory bandwidth; refused in one line."""
    from amsp_planner.cost.offload import check_cluster

    eng = profile(engine)
    if not eng.optimizer_offload:
        raise AmspUserError(f"--offload-optimizer: {eng.title} does not offload the optimizer: "
                            "use --engine deepspeed, or drop --offload-optimizer")
    if model.is_moe:
        raise AmspUserError(f"--offload-optimizer: model {model.name} is a mixture of experts, "
                            "whose offload is not priced: drop --offload-optimizer")
    check_cluster(cluster)


@dataclass(frozen=True)
class Job:
    """One training job on one cluster. Construct with ``Job.create`` to get checked errors."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    num_gpus: int
    topology: Topology = field(compare=False, repr=False, hash=False)
    engine: str = DEFAULT_ENGINE
    """The engine that runs the plan (amsp_planner/engines.py): it restricts the search space,
    and ``training`` is already as that engine runs it (its gradient-reduction dtype)."""
    cp: int = 1
    """1 for every job as stated; C in the per-rank view of context parallelism C
    (``cost/context_parallel.py: cp_view``): sequences of s/C tokens whose attention runs over
    a context of C times that."""
    settings: tuple[tuple[str, object], ...] = ()
    """Execution values this job's run sets against its engine profile's (``Execution`` field,
    value): a published run's own configuration (presets/validation.yaml ``execution:``, e.g.
    DeepSpeed's stage3_max_live_parameters); empty for a planned job."""
    split: tuple[int, int] = field(default=(1, 1), compare=False, hash=False)
    """(pp, cp) of the strategy it was created for (``create``): the global batch splits over
    the data-parallel ranks of those; a job made again from this one keeps them."""

    @staticmethod
    def fit_nodes(cluster: ClusterSpec, num_gpus: int) -> tuple[ClusterSpec, str | None]:
        """`cluster` as `num_gpus` GPUs use it: when they are not a whole number of its nodes,
        as few nodes as hold them in equal parts (12 GPUs on 8-GPU nodes: 2 nodes of 6), with
        a note saying so; otherwise `cluster` itself and None."""
        r = cluster.gpus_per_node
        if num_gpus <= r or num_gpus % r == 0:
            return cluster, None
        per = max(d for d in range(1, r + 1) if num_gpus % d == 0)
        if per == 1:
            return cluster, None  # a prime count: refused by create() with its fix
        note = (f"--gpus {num_gpus} is not a whole number of {r}-GPU nodes on {cluster.name}: "
                f"planned as {num_gpus // per} nodes of {per} GPUs (--set gpus_per_node={per}); "
                f"give --set gpus_per_node=N to choose another split")
        return cluster.model_copy(update={"gpus_per_node": per}), note

    @classmethod
    def create(cls, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
               num_gpus: int, engine: str = DEFAULT_ENGINE, pp: int = 1, cp: int = 1) -> Job:
        """The job; `training` becomes what `engine` runs (``EngineProfile.training_for``).
        `pp`, `cp`: the pipeline stages and the context-parallel degree it is planned with (a
        given strategy's): the global batch must split over the data-parallel ranks of one
        stage, N / (pp x cp x tp), not over all GPUs."""
        training = profile(engine).training_for(training)
        if model.is_moe and training.precision == "fp8" and training.fp8_all_gather == "on":
            raise AmspUserError(f"--fp8-all-gather on: {model.name} is a mixture of experts, "
                                "whose FP8 gathers are not modelled: use --fp8-all-gather auto "
                                "or off")
        if training.optimizer_offload == "cpu":
            _check_offload(model, cluster, engine)
        if training.dp_overlap:
            _overlapped(engine)
        if num_gpus < 1:
            raise AmspUserError(f"--gpus: must be at least 1, got {num_gpus}")
        r = cluster.gpus_per_node
        if num_gpus > r and num_gpus % r:
            raise AmspUserError(
                f"--gpus {num_gpus} is not a whole number of {r}-GPU nodes on {cluster.name}: "
                f"use a multiple of {r}, or give --set gpus_per_node=N for nodes of N GPUs (N "
                f"dividing {num_gpus})"
            )
        if num_gpus < r and r % num_gpus:
            raise AmspUserError(
                f"--gpus {num_gpus}: a partial node of {cluster.name} must hold a divisor of "
                f"{r} GPUs ({', '.join(str(d) for d in range(1, r) if r % d == 0)}): use one, "
                f"or give --set gpus_per_node={num_gpus} for nodes of {num_gpus} GPUs"
            )
        b = training.batch_seqs
        eng = profile(engine)
        tps = model.tp_degrees(min(r, num_gpus)) if eng.tp else [1]
        n = num_gpus // pp if pp > 1 and num_gpus % pp == 0 else num_gpus  # one stage's GPUs
        n = n // cp if cp > 1 and n % cp == 0 else n  # ... over whole sequences: one per cp
        tp_ok = [t for t in tps if t <= n and b >= n // t and b % (n // t) == 0]  # a stage
        # of n < r GPUs (pp) holds no TP degree above n
        if (b < n or b % n) and not tp_ok:
            tmax = max(tps)
            why = ("with data parallelism only each GPU needs whole sequences" if tmax == 1 else
                   f"nor of the {num_gpus // tmax} data-parallel ranks of tensor parallelism "
                   f"{tmax} (the most the nodes hold): each data-parallel rank needs whole "
                   "sequences")
            raise AmspUserError(
                f"global batch of {b:,} sequences ({batch_source(training)}) is not a "
                f"multiple of {num_gpus} GPUs x micro-batch {training.micro_batch or 1}, {why}; "
                f"{batch_fix(training, b, num_gpus)} or fewer GPUs"
            )
        if model.position_embedding == "learned" and training.seq_len > model.max_seq_len:
            raise AmspUserError(
                f"--seq-len {training.seq_len} exceeds the learned positions of {model.name} "
                f"(max_seq_len {model.max_seq_len}): use --seq-len {model.max_seq_len} or less"
            )
        per = b // (n // tp_ok[0]) if tp_ok else b // n
        if training.micro_batch is not None and per % training.micro_batch:
            divs = [d for d in range(1, per + 1) if per % d == 0]
            mbs = ", ".join(map(str, divs[:-1])) + (" or " if len(divs) > 1 else "") + str(per)
            raise AmspUserError(
                f"--micro-batch {training.micro_batch} does not divide the {per} sequences per "
                f"data-parallel rank; use --micro-batch {mbs}, or keep it with "
                f"{batch_fix(training, b, num_gpus)[4:]}"
            )
        return cls(model, cluster, training, num_gpus, Topology(cluster, num_gpus), engine,
                   split=(pp, cp))

    def for_engine(self, engine: str) -> Job:
        """The same job run by another engine (its behaviour applied to the training spec)."""
        if engine == self.engine:
            return self
        return Job.create(self.model, self.cluster, self.training, self.num_gpus, engine,
                          *self.split)

    @property
    def profile(self) -> EngineProfile:
        """The engine's profile; with ``training.dp_overlap`` its opt-in overlaps on."""
        p = _overlapped(self.engine) if self.training.dp_overlap else profile(self.engine)
        if self.settings:
            p = replace(p, execution=replace(p.execution, **dict(self.settings)))
        return p

    # ----- derived --------------------------------------------------------------------------
    @property
    def gpus_per_node(self) -> int:
        return self.topology.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    @cached_property
    def pad_multiple(self) -> int:
        return self.num_gpus * PAD_QUANTUM

    @cached_property
    def units(self) -> tuple[int, ...]:
        """Padded elements of each unit: embedding, blocks, final norm + head. For a
        mixture-of-experts model, of its dense class (the routed experts are ``expert_units``)."""
        q = self.pad_multiple
        m = self.model
        return tuple(-(-(u - x) // q) * q
                     for u, x in zip(m.unit_params(), m.unit_expert_params(), strict=True))

    def expert_units(self, ep: int) -> tuple[int, ...]:
        """Padded elements of the routed experts one rank holds in each unit at degree `ep`:
        E/ep experts of each MoE layer, padded to a multiple of the N/ep ranks holding the same
        experts x the padding quantum (0 for the embedding, the head and dense layers)."""
        key = ("experts", ep)
        if key not in self._tp_cache:
            q = self.num_gpus // ep * PAD_QUANTUM
            self._tp_cache[key] = tuple(-(-(x // ep) // q) * q
                                        for x in self.model.unit_expert_params())
        return self._tp_cache[key]

    # ----- tensor parallelism (docs/cost-model.md, "Tensor parallelism") --------------------
    @cached_property
    def _tp_cache(self) -> dict:
        return {}

    def tp_units(self, tp: int) -> tuple[int, ...]:
        """Padded elements of each unit one TP rank holds at degree `tp`: its TP shard
        (``ModelSpec.tp_unit_params``) padded to a multiple of the N/tp data-parallel ranks x
        the padding quantum; ``units`` at tp = 1."""
        if tp == 1:
            return self.units
        key = ("units", tp)
        if key not in self._tp_cache:
            q = self.num_gpus // tp * PAD_QUANTUM
            self._tp_cache[key] = tuple(-(-u // q) * q for u in self.model.tp_unit_params(tp))
        return self._tp_cache[key]

    def tp_phi(self, tp: int) -> int:
        """Padded parameters one TP rank holds (Phi at tp = 1)."""
        return sum(self.tp_units(tp)) if tp > 1 else self.phi

    def tp_max_unit(self, tp: int) -> int:
        return max(self.tp_units(tp))

    def dp_ranks(self, tp: int) -> int:
        """Data-parallel ranks at tensor-parallel degree `tp`: the N/tp TP groups."""
        return self.num_gpus // tp

    def seqs_per_rank(self, tp: int) -> int:
        """Sequences per data-parallel rank per step (``seqs_per_gpu`` at tp = 1)."""
        return self.training.batch_seqs // (self.num_gpus // tp)

    def tp_options(self) -> tuple[int, ...]:
        """The tensor-parallel degrees this job admits: divisors of the GPUs per node that
        divide the heads and the MLP width (``ModelSpec.tp_degrees``) and the sequence
        (sequence parallelism splits it evenly), that the engine runs, and whose N/tp
        data-parallel ranks divide the global batch."""
        tps = self.model.tp_degrees(self.gpus_per_node) if self.profile.tp else [1]
        b, s = self.training.batch_seqs, self.training.seq_len
        return tuple(t for t in tps if b >= self.dp_ranks(t) and b % self.dp_ranks(t) == 0
                     and s % t == 0)

    @cached_property
    def phi(self) -> int:
        """Padded parameter count (sum of padded units)."""
        return sum(self.units)

    @cached_property
    def max_unit(self) -> int:
        return max(self.units)

    @property
    def num_units(self) -> int:
        return len(self.units)

    @cached_property
    def seqs_per_gpu(self) -> int:
        return self.training.batch_seqs // self.num_gpus

    def micro_batch_options(self, cap: int = 64, tp: int = 1) -> list[int]:
        """Micro-batch sizes that divide the sequences per data-parallel rank (pinned one if
        given)."""
        if self.training.micro_batch is not None:
            return [self.training.micro_batch]
        n = self.seqs_per_rank(tp)
        return [b for b in range(1, min(n, cap) + 1) if n % b == 0]

    def n_micro(self, strategy: Strategy) -> int:
        try:
            return strategy.n_micro(self.training.batch_seqs, self.num_gpus)
        except ValueError as e:
            raise AmspUserError(f"--strategy {strategy}: {e}") from None

    def checked(self, s: Strategy) -> Strategy:
        """`s` after ``check``, block checkpointing of all L blocks written as full
        checkpointing (K = L is full), as the cost model prices it."""
        self.check(s)
        return s.with_(ckpt=True, ckpt_blocks=0) if s.ckpt_blocks == self.model.num_layers else s

    @property
    def fp8_gathers_all(self) -> bool:
        """``--precision fp8 --fp8-all-gather on`` on a dense model: every sharded parameter
        is gathered in FP8 (``cost/schedule.py: gathers_fp8``), so no strategy runs qwZ."""
        t = self.training
        return t.precision == "fp8" and t.fp8_all_gather == "on" and not self.model.is_moe

    def check(self, strategy: Strategy) -> None:
        """Raise AmspUserError unless the strategy is valid for this job."""
        try:
            strategy.check(self.num_gpus, self.gpus_per_node)
            strategy.check_experts(self.model.num_experts)
            strategy.n_micro(self.training.batch_seqs, self.num_gpus)
        except ValueError as e:
            raise AmspUserError(f"--strategy {strategy}: {e}") from None
        if self.model.is_moe:
            what = ("ZeRO++ (qwz, hpz, qgz)" if strategy.qwz or strategy.qgz or strategy.hpz > 1
                    else "tensor parallelism" if strategy.tp > 1
                    else "op-level checkpointing (ckpt=op)" if strategy.ckpt_op else None)
            if what:
                raise AmspUserError(f"--strategy {strategy}: {what} of a mixture-of-experts "
                                    "model is not modelled (docs/moe.md): drop it")
        elif strategy.ckpt_moe:
            raise AmspUserError(f"--strategy {strategy}: ckpt=moe recomputes MoE layers and the "
                                "model has none: use ckpt, ckpt=K or ckpt=op")
        if strategy.qwz and self.fp8_gathers_all:
            raise AmspUserError(f"--strategy {strategy}: qwz with --fp8-all-gather on, which "
                                "gathers every sharded parameter in FP8, not INT8: drop qwz, or "
                                "give --fp8-all-gather auto to let the search choose")
        if strategy.cp > 1:
            from amsp_planner.cost.context_parallel import check_cp

            check_cp(self, strategy)
        t = strategy.tp
        if t > 1 and (self.model.num_heads % t or self.model.kv_heads % t):
            raise AmspUserError(
                f"--strategy {strategy}: tp={t} must divide the {self.model.num_heads} query and "
                f"{self.model.kv_heads} key/value heads of {self.model.name} (each TP rank holds "
                f"whole heads): use tp= one of {', '.join(map(str, self.model.tp_degrees(self.gpus_per_node)))}"
            )
        if t > 1 and not self.profile.tp:
            raise AmspUserError(
                f"--strategy {strategy}: {self.profile.title} does not run tensor parallelism "
                f"here: use tp=1, or --engine torchtitan / fsdp2 / amsp")
        L = self.model.num_layers
        if strategy.ckpt_blocks > L:
            raise AmspUserError(
                f"--strategy {strategy}: ckpt={strategy.ckpt_blocks} exceeds the model's {L} "
                f"blocks: use ckpt=K with K from 0 to {L}, or ckpt=op"
            )


@functools.cache
def _overlapped(engine: str) -> EngineProfile:
    """`engine`'s profile with its opt-in data-parallel overlaps on (``dp_overlap``); a user
    error naming the field where the engine has no such switch."""
    p = profile(engine)
    if not p.execution.overlap_flags:
        raise AmspUserError(f"dp_overlap: {p.title} has no opt-in overlap of its gradient "
                            "reduction and parameter all-gather: drop dp_overlap")
    return replace(p, execution=p.execution.overlapped())
