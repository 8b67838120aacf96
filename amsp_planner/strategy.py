"""The Strategy value, its one string form, the AMSP space and the named baselines.

String form (docs/design.md), parsed only here::

    p=8,g=8,os=64,qwz,hpz=8,qgz,mb=1,ckpt        tp=8,p=32,g=32,os=32,mb=1
    ep=8,p=64,g=64,os=64,ep.p=8,ep.g=8,ep.os=8,mb=1,ckpt

- ``tp=T``: tensor (+ sequence) parallel degree inside the node (default 1, then not written).
  T divides R; a TP group is T consecutive ranks of one node, and the data-parallel ranks are
  the N/T TP groups, R/T per node (docs/cost-model.md, "Tensor parallelism"). Every rule below
  is then over the data-parallel ranks: the shard factors divide N/T and divide R/T or are
  multiples of it, the mesh is over R/T data-parallel ranks per node, and hpZ divides R/T.
- ``cp=C``: context parallelism (cost/context_parallel.py): batch over N/(T C) ranks, factors N/T.
- ``pp=P``, ``vpp=V``, ``pp.sched=NAME`` (dense models): P pipeline stages, V model chunks per
  rank (interleaved when V > 1), ``pp.sched`` one of ``PP_SCHEDULES`` (strategy_pipeline.py). A
  stage is N/P consecutive GPUs (Megatron's tp-dp-pp order): every rule below is then over one
  stage's N/P GPUs (docs/cost-model.md, "Pipeline parallelism"; ``cost/pipeline.py``).
- ``p``, ``g``, ``os``: shard factors s_P, s_G, s_OS (default 1). AMSP's rules: each divides the
  GPU count; each divides R (GPUs per node) or is a multiple of R ("intra-node first"), so the
  mesh is (s0, s1) = (min(s, R), max(1, s/R)); s_P | s_G | s_OS, hence s_P <= s_G <= s_OS per
  mesh dimension.
- ``qwz`` / ``qwz=BLOCK``: INT8 block-quantized all-gather (an fp32 scale per BLOCK | 256 elements).
- ``fp8ag``: FP8 parameter all-gather (``--precision fp8`` only; docs/fp8.md); not with qwz.
- ``hpz=H``: hpZ secondary bf16 copy sharded over H GPUs inside the node (H | R, H < s_P, H | s_P);
  the backward all-gather runs over those H GPUs.
- ``qgz``: gradient reduction by a two-hop INT4 all-to-all (intra-node, then inter-node).
- ``mb=B``: sequences per GPU per micro-batch; ``ga=K`` optionally pins the accumulation steps
  (checked against the global batch).
- ``ep=E``, ``ep.span``, ``ep.p=``, ``ep.g=``, ``ep.os=`` (mixture-of-experts models only;
  docs/moe.md, ``strategy_experts.py``): expert-parallel degree e (each rank holds E/e routed
  experts of every MoE layer; E % e == 0), the EP group's placement (default: e consecutive
  ranks, inside a node when e <= R; ``ep.span``: strided across nodes) and the expert class's
  shard factors over the N/e ranks holding the same experts, with the dense triple's rules
  over those ranks. Written whole (``ep=1,...,ep.p=1,ep.g=1,ep.os=1``) for an expert strategy;
  any of them given makes one, the missing factors 1. Without them the expert class follows
  the dense triple at e = 1 (as an engine without expert parallelism shards it).
- ``ckpt`` / ``nockpt``: full activation checkpointing of every block / none; ``ckpt=K``
  checkpoints the first K of the L blocks (``ckpt=0`` is none, ``ckpt=L`` is full, as
  Megatron's ``--recompute-num-layers K`` with the block method); ``ckpt=op`` is op-level
  selective checkpointing of every block (matmul and attention outputs kept, the elementwise
  ops recomputed: docs/memory.md); ``ckpt=moe`` (mixtures of experts) recomputes only each
  MoE layer's MLP part (docs/moe.md). ``ckpt=full`` and ``ckpt=none`` are accepted too.

Named baselines (``baseline(name, N, R)``): ddp, zero1, zero2, zero3 (= fsdp), hsdp, mics (p = 2R
by default, ``mics-16`` for p = 16), zeropp (ZeRO-3 + qwZ + hpZ=R + qgZ).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from amsp_planner.ckpt_setting import CKPT_HELP as CKPT_HELP
from amsp_planner.ckpt_setting import checkpointed_blocks as checkpointed_blocks
from amsp_planner.ckpt_setting import ckpt_fields, parse_ckpt_value
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy_experts import ExpertLayout, check_ep, expert_layout
from amsp_planner.strategy_pipeline import PP_SCHEDULES, check_pp

PAD_QUANTUM = 256
"""Every unit is padded to a multiple of N * PAD_QUANTUM elements, so each shard at any factor
is a whole number of quantization blocks (docs/design.md, the reference schedule)."""

COMPONENTS = ("p", "g", "os")


@dataclass(frozen=True)
class Strategy:
    """One point of the sharding space; complete and immutable."""

    s_p: int = 1
    """Parameter shard factor s_P (over the data-parallel ranks)."""
    s_g: int = 1
    """Gradient shard factor s_G."""
    s_os: int = 1
    """Optimizer-state shard factor s_OS (fp32 master + Adam m, v)."""
    qwz: bool = False
    """INT8 quantized parameter all-gathers (ZeRO++ qwZ)."""
    fp8ag: bool = False
    """FP8 parameter all-gathers (tensorwise; cost/fp8_bytes.py), an alternative to qwZ."""
    quant_block: int = PAD_QUANTUM
    """Elements per quantization block (qwZ and qgZ), one fp32 scale each."""
    hpz: int = 1
    """hpZ partition size h_z; 1 = off."""
    qgz: bool = False
    """INT4 two-hop all-to-all gradient reduction (ZeRO++ qgZ)."""
    micro_batch: int = 1
    """Sequences per GPU per micro-batch."""
    grad_accum: int | None = None
    """Micro-batches per step when pinned; None derives it from the global batch."""
    ckpt: bool = False
    """Full activation checkpointing (recompute each block in backward)."""
    ckpt_blocks: int = 0
    """With ``ckpt`` off: checkpoint the first K blocks only (0 = none)."""
    ckpt_op: bool = False
    """Op-level selective checkpointing of every block (matmul outputs kept)."""
    ckpt_moe: bool = False  # each MoE layer's MLP part recomputed in backward (ckpt=moe)
    tp: int = 1
    """Tensor (+ sequence) parallel degree t inside the node; 1 = none."""
    cp: int = 1  # context-parallel degree (cost/context_parallel.py); 1 = none
    pp: int = 1
    """Pipeline stages; 1 = none. The DP ranks are then N/(tp pp), over one stage's GPUs."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per rank: the interleaved schedule when > 1."""
    pp_sched: str | None = None
    """The pipeline schedule (``PP_SCHEDULES``); None: 1f1b, or interleaved-1f1b with vpp > 1."""
    ep: int = 1
    """Expert-parallel degree e: each rank holds E/e routed experts of every MoE layer."""
    ep_span: bool = False
    """False: an EP group is e consecutive ranks (inside a node when e <= R); True: strided
    across the nodes (strategy_experts.py)."""
    ep_p: int | None = None
    """Expert parameter shard factor over the N/e ranks holding the same experts; None (with
    ep_g, ep_os): no expert tokens, the expert class follows the dense triple at e = 1."""
    ep_g: int | None = None  # expert gradient shard factor
    ep_os: int | None = None  # expert optimizer-state shard factor

    @property
    def quantized(self) -> bool:
        """qwZ or qgZ: collectives that change the training numerics (INT8 / INT4)."""
        return self.qwz or self.qgz

    @property
    def ckpt_value(self) -> bool | int | str:
        """The checkpointing setting as the cost model takes it: True (every block), False
        (none), K (the first K blocks), 'op' or 'moe'."""
        if self.ckpt_op or self.ckpt_moe:
            return "op" if self.ckpt_op else "moe"
        if self.ckpt:
            return True
        return self.ckpt_blocks or False

    @property
    def ckpt_words(self) -> str:
        """The setting in words: 'on', 'off', 'the first K blocks', 'op-level' or 'of the MoE MLPs'."""
        v = self.ckpt_value
        if v is True or v is False:
            return "on" if v else "off"
        return {"op": "op-level", "moe": "of the MoE MLPs"}.get(v, f"the first {v} blocks")

    @property
    def ckpt_token(self) -> str | None:
        """The setting's token in the string form (None: no checkpointing)."""
        v = self.ckpt_value
        if v is False:
            return None
        return "ckpt" if v is True else f"ckpt={v}"

    @property
    def has_experts(self) -> bool:
        """The strategy spells the expert class (ep tokens given)."""
        return self.ep_p is not None

    def expert_factor(self, component: str) -> int:
        """The expert class's shard factor of a component (the dense one without ep tokens)."""
        f = {"p": self.ep_p, "g": self.ep_g, "os": self.ep_os}[component]
        return self.factor(component) if f is None else f

    def expert_layout(self, num_gpus: int, gpus_per_node: int) -> ExpertLayout:
        """The EP and EDP groups of this strategy on N GPUs, R per node."""
        return expert_layout(self.ep, self.ep_span, num_gpus // self.tp,
                             max(1, gpus_per_node // self.tp))

    # ----- string form --------------------------------------------------------------------
    def __str__(self) -> str:
        parts = [f"tp={self.tp}"] if self.tp > 1 else []
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += [f"pp={self.pp}"] * (self.pp > 1) + [f"vpp={self.vpp}"] * (self.vpp > 1)
        parts += [f"pp.sched={self.pp_sched}"] * (self.pp_sched is not None)
        if self.has_experts:
            parts += [f"ep={self.ep}"] + (["ep.span"] if self.ep_span else [])
        parts += [f"p={self.s_p}", f"g={self.s_g}", f"os={self.s_os}"]
        if self.has_experts:
            parts += [f"ep.p={self.ep_p}", f"ep.g={self.ep_g}", f"ep.os={self.ep_os}"]
        if self.qwz:
            parts.append("qwz" if self.quant_block == PAD_QUANTUM else f"qwz={self.quant_block}")
        parts += ["fp8ag"] * bool(self.fp8ag) + ([f"hpz={self.hpz}"] if self.hpz > 1 else [])
        if self.qgz:
            parts.append("qgz")
        parts.append(f"mb={self.micro_batch}")
        if self.grad_accum is not None:
            parts.append(f"ga={self.grad_accum}")
        if self.ckpt_token:
            parts.append(self.ckpt_token)
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """Parse the string form; raises AmspUserError naming the bad token."""
        if not isinstance(text, str) or not text.strip():
            raise AmspUserError("--strategy: empty: write e.g. 'p=8,g=8,os=64,mb=1'")
        kw: dict = {}
        seen: set[str] = set()
        for raw in text.split(","):
            token = raw.strip()
            key, _, value = token.partition("=")
            key = key.strip().lower()
            value = value.strip()
            if key in seen:
                raise AmspUserError(f"--strategy: '{key}' given twice in '{text}': keep one")
            seen.add(key)
            if key in _INT_FIELDS:
                if not value:
                    raise AmspUserError(f"--strategy: '{key}' needs a value, e.g. {key}=8")
                kw[_INT_FIELDS[key]] = _positive_int(value, key, text)
            elif key == "qwz":
                kw["qwz"] = True
                if value:
                    kw["quant_block"] = _positive_int(value, key, text)
            elif key == "pp.sched":
                if value not in PP_SCHEDULES:
                    raise AmspUserError(f"--strategy: pp.sched={value or '?'}: use one of "
                                        f"{', '.join(PP_SCHEDULES)}")
                kw["pp_sched"] = value
            elif key == "ckpt" and value:
                kw.update(ckpt_fields(parse_ckpt_value(value, "--strategy: ckpt=")))
            elif key in ("qgz", "ckpt", "nockpt", "ep.span", "fp8ag"):
                if value:
                    raise AmspUserError(f"--strategy: '{key}' takes no value (got '{token}')")
                if key in ("qgz", "ep.span", "fp8ag"):
                    kw[key.replace(".", "_")] = True
                else:
                    kw["ckpt"] = key == "ckpt"
            else:
                raise AmspUserError(
                    f"--strategy: unknown token '{token}' in '{text}': use tp=, pp=, vpp=, pp.sched=, p=, g=, os=, qwz[=block], fp8ag, "
                    "hpz=, qgz, cp=, ep=, ep.span, ep.p=, ep.g=, ep.os=, mb=, ga=, ckpt[=K|op|moe] or a named baseline (ddp, zero1, zero2, zero3, fsdp, "
                    "hsdp, mics, zeropp)"
                )
        if seen & {"ep", "ep.span", "ep.p", "ep.g", "ep.os"}:
            for f in ("ep_p", "ep_g", "ep_os"):
                kw.setdefault(f, 1)
        s = cls(**kw)
        if PAD_QUANTUM % s.quant_block or s.quant_block < 8:
            raise AmspUserError(
                f"--strategy: qwz block {s.quant_block} must divide {PAD_QUANTUM} and be at least 8: "
                "use 32, 64, 128 or 256"
            )
        return s

    # ----- structure ----------------------------------------------------------------------
    def factor(self, component: str) -> int:
        return {"p": self.s_p, "g": self.s_g, "os": self.s_os}[component]

    def mesh(self, component: str, gpus_per_node: int) -> tuple[int, int]:
        """(s0, s1): data-parallel ranks per node x nodes of a component's shard group (R GPUs
        per node hold R/tp data-parallel ranks)."""
        s, r = self.factor(component), max(1, gpus_per_node // self.tp)
        return (min(s, r), max(1, s // r))

    def n_micro(self, batch_seqs: int, num_gpus: int) -> int:
        """Micro-batches per step for a global batch; ValueError when it does not divide."""
        num_gpus //= self.pp  # the data-parallel ranks of one pipeline stage
        ranks = num_gpus // (self.tp * self.cp)
        unit = ranks * self.micro_batch
        degrees = ", ".join(f"{k}={v}" for k, v in (("tp", self.tp), ("cp", self.cp)) if v > 1)
        who = f"{num_gpus} GPUs" if not degrees else f"{ranks} data-parallel ranks ({degrees})"
        if batch_seqs < unit or batch_seqs % unit:
            raise ValueError(
                f"global batch of {batch_seqs} sequences is not a multiple of "
                f"{'GPUs' if self.tp == self.cp == 1 else 'data-parallel ranks'} x micro-batch = "
                f"{ranks} x {self.micro_batch} = {unit}: use a global batch that is a multiple "
                f"of {unit} sequences, a smaller micro-batch or fewer GPUs"
            )
        n = batch_seqs // unit
        if self.grad_accum is not None and self.grad_accum != n:
            raise ValueError(
                f"ga={self.grad_accum} does not match the global batch: {batch_seqs} sequences / "
                f"({who} x mb={self.micro_batch}) = {n} micro-batches; drop ga= or "
                "change mb"
            )
        return n

    def check(self, num_gpus: int, gpus_per_node: int) -> None:
        """Raise ValueError unless this strategy is valid for N GPUs with R per node."""
        if self.pp > 1 or self.vpp > 1 or self.pp_sched is not None:
            check_pp(self.pp, self.vpp, self.pp_sched, num_gpus, gpus_per_node)
            stage = num_gpus // self.pp  # one stage: the rules below over its GPUs
            return self.with_(pp=1, vpp=1, pp_sched=None).check(stage, min(gpus_per_node, stage))
        if gpus_per_node % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide the {gpus_per_node} GPUs per node: tensor "
                f"parallelism stays inside the node: use tp= a divisor of {gpus_per_node}"
            )
        n, r = num_gpus // self.tp, gpus_per_node // self.tp
        if n % self.cp:
            raise ValueError(f"cp={self.cp} does not divide the {n} ranks of "
                             f"{'the job' if self.tp == 1 else f'tp={self.tp}'}: use a divisor of {n}")
        dp = "" if self.tp == 1 else f" data-parallel ranks (tp={self.tp})"
        for c in COMPONENTS:
            s = self.factor(c)
            if n % s:
                what = f"the GPU count {n}" if self.tp == 1 else f"the {n}{dp}"
                raise ValueError(f"{c}={s} does not divide {what}: use a divisor of {n}")
            if not (r % s == 0 or s % r == 0):
                raise ValueError(
                    f"{c}={s} neither divides nor is a multiple of {r} "
                    f"{'GPUs' if self.tp == 1 else dp.strip()} per node "
                    "(intra-node first): use a divisor of the node size or whole nodes"
                )
        if self.s_g % self.s_p or self.s_os % self.s_g:
            raise ValueError(
                f"factors must nest, p | g | os: got p={self.s_p}, g={self.s_g}, os={self.s_os}; "
                "make each divide the next"
            )
        if self.hpz > 1:
            if r % self.hpz:
                raise ValueError(f"hpz={self.hpz} must divide the node size {r}{dp}")
            if self.s_p <= self.hpz or self.s_p % self.hpz:
                raise ValueError(
                    f"hpz={self.hpz} needs p > hpz with hpz | p (p={self.s_p}): raise p or drop hpz"
                )
        for name in ("qwz", "fp8ag") if self.s_p == 1 else ():
            if getattr(self, name):
                raise ValueError(f"{name} quantizes the parameter all-gather, but p=1 has none: drop {name}")
        if self.qwz and self.fp8ag:
            raise ValueError("qwz and fp8ag both quantize the parameter all-gather: keep one")
        if self.qgz and self.s_g == 1:
            raise ValueError("qgz replaces the gradient reduce-scatter, but g=1 has none: drop qgz")
        if self.has_experts:
            if self.tp > 1:
                raise ValueError(f"tp={self.tp} with expert tokens: tensor parallelism of a "
                                 "mixture-of-experts model is not modelled: use tp=1")
            check_ep(self.ep, self.ep_span, {c: self.expert_factor(c) for c in COMPONENTS}, n, r)

    def check_experts(self, num_experts: int) -> None:
        """Raise ValueError unless the strategy fits a model of E routed experts (0: dense)."""
        if not num_experts and self.has_experts:
            raise ValueError("ep tokens on a dense model (no routed experts): drop ep=, "
                             "ep.span and ep.p/ep.g/ep.os")
        if num_experts and num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the model's {num_experts} routed "
                             f"experts: use a divisor of {num_experts} that divides the GPUs")

    def with_(self, **changes) -> Strategy:
        return replace(self, **changes)


_INT_FIELDS = {"p": "s_p", "g": "s_g", "os": "s_os", "hpz": "hpz", "mb": "micro_batch",
               "ga": "grad_accum", "tp": "tp", "cp": "cp", "ep": "ep", "ep.p": "ep_p", "ep.g": "ep_g",
               "ep.os": "ep_os", "pp": "pp", "vpp": "vpp"}
"""Tokens that take a positive integer, and the Strategy field each sets."""

def _positive_int(value: str, key: str, text: str) -> int:
    try:  # plain ASCII digits: int() alone takes "٦٤" and "6_4" as 64
        n = int(value if value.strip().isascii() and "_" not in value else "")
    except ValueError:
        raise AmspUserError(
            f"--strategy: '{key}={value}' is not an integer in '{text}': write e.g. {key}=8"
        ) from None
    if n < 1:
        raise AmspUserError(f"--strategy: '{key}={value}' must be at least 1")
    return n


def factor_options(num_gpus: int, gpus_per_node: int) -> list[int]:
    """Shard factors allowed by AMSP's rules: divisors of N that divide R or are multiples of R."""
    n, r = num_gpus, gpus_per_node
    return [s for s in range(1, n + 1) if n % s == 0 and (r % s == 0 or s % r == 0)]


BASELINE_NAMES = ("ddp", "zero1", "zero2", "zero3", "hsdp", "mics", "zeropp")
_ALIASES = {"fsdp": "zero3", "zero++": "zeropp", "zero-1": "zero1", "zero-2": "zero2",
            "zero-3": "zero3"}


def baseline(name: str, num_gpus: int, gpus_per_node: int, micro_batch: int = 1,
             ckpt: bool | int | str = False, tp: int = 1) -> Strategy:
    """A named baseline as a Strategy for N GPUs with R per node (`ckpt`: True, False, a
    block count K or 'op'); with `tp` > 1 the baseline's sharding over the N/tp data-parallel
    ranks, R/tp per node, under that tensor-parallel degree."""
    n, r = num_gpus // tp, max(1, gpus_per_node // tp)
    key = _ALIASES.get(name.lower(), name.lower())
    base = Strategy(micro_batch=micro_batch, tp=tp, **ckpt_fields(ckpt))
    if key == "ddp":
        return base
    if key in ("zero1", "zero2", "zero3"):
        return base.with_(s_os=n, s_g=n if key != "zero1" else 1, s_p=n if key == "zero3" else 1)
    if key == "hsdp":
        s = min(n, r)
        return base.with_(s_p=s, s_g=s, s_os=s)
    if key.startswith("mics"):
        _, _, size = key.partition("-")
        if key != "mics" and not (key.startswith("mics-") and size.isdigit() and int(size) > 0):
            raise AmspUserError(
                f"--strategy: unknown baseline '{name}': write mics (groups of 2 nodes) or mics-P with a "
                "group size P >= 1, e.g. mics-16"
            )
        # default: groups of two nodes, or the largest valid group below that when two nodes
        # do not divide the job (24 GPUs of 8 per node: one node)
        p = int(size) if size else max(f for f in factor_options(n, r) if f <= 2 * r)
        return base.with_(s_p=p, s_g=p, s_os=p)
    if key == "zeropp":
        hz = min(n, r)
        return base.with_(s_p=n, s_g=n, s_os=n, qwz=n > 1, hpz=hz if n > hz else 1, qgz=n > 1)
    raise AmspUserError(
        f"--strategy: unknown baseline '{name}': use one of {', '.join(BASELINE_NAMES)} (or fsdp, mics-P)"
    )


def parse_strategy_or_baseline(text: str, num_gpus: int, gpus_per_node: int) -> Strategy:
    """`--strategy` accepts the string form or a baseline name (optionally ',mb=..,ckpt')."""
    head, _, rest = text.partition(",")
    key = head.strip().lower()
    key = _ALIASES.get(key, key)
    if key in BASELINE_NAMES or key.startswith("mics"):
        given = {t.partition("=")[0].strip().lower() for t in rest.split(",")} if rest else set()
        if given - {"mb", "ga", "ckpt", "nockpt", "tp", "cp"}:
            raise AmspUserError(
                f"--strategy: '{text}': after a baseline name only tp=, cp=, mb=, ga= and ckpt[=K|op|moe]/nockpt "
                "may follow: write the whole strategy instead, e.g. 'p=8,g=8,os=64,qwz,mb=1'"
            )
        extra = Strategy.parse(rest) if rest.strip() else Strategy()
        if extra.tp > 1 and gpus_per_node % extra.tp:
            raise AmspUserError(
                f"--strategy: '{text}': tp={extra.tp} does not divide the {gpus_per_node} GPUs per "
                f"node: tensor parallelism stays inside the node: use tp= a divisor of {gpus_per_node}")
        s = baseline(key, num_gpus, gpus_per_node, extra.micro_batch, extra.ckpt_value, extra.tp)
        return s.with_(grad_accum=extra.grad_accum, cp=extra.cp)
    return Strategy.parse(text)
