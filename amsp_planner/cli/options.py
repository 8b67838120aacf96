"""Options shared by the commands that take a job, and their translation into specs."""

from __future__ import annotations

import contextlib
import gc
import math

import click

from amsp_planner.cli.notes import note
from amsp_planner.errors import AmspUserError, shown
from amsp_planner.specs.option_names import (  # noqa: F401 - also this module's API
    OPTION_OF,
    as_options,
    training_error,
)


@contextlib.contextmanager
def no_cyclic_gc():
    """Python's cyclic garbage collector off for a short, bounded command: what it allocates
    (the imports, the solver's models) is freed by reference counting, and the collector's
    passes over those objects took about 0.1 s of a cold `amsp plan` (peak memory the same:
    80 MB for llama3-405b on 16,384 GPUs either way). Back on afterwards, with what exists
    then frozen (``gc.freeze``): else the first collection after it would traverse every
    object the command made (about 35 ms)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.enable()


class Number(click.ParamType):
    """A finite number in a stated range (``amsp_planner/specs/fields.py``'s rule for the
    options): nan, inf, 1e308 GiB or a negative time limit are refused naming the option and
    the range (click's FloatRange lets nan through: no comparison with nan is false)."""

    name = "number"

    def __init__(self, lo: float, hi: float, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def _range(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def convert(self, value, param, ctx):
        try:
            if isinstance(value, str) and (not value.isascii() or "_" in value):
                raise ValueError(value)  # float() takes "٦٠" and "1_00"
            v = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            self.fail(f"{shown(value)!r} is not a number: give one in {self._range()}", param,
                      ctx)
        low = v <= self.lo if self.lo_open else v < self.lo
        if not math.isfinite(v) or low or v > self.hi:
            self.fail(f"{shown(value)} is not a finite number in {self._range()}: give one in "
                      "that range", param, ctx)
        return v


MEMORY_GIB = Number(0, 4096, lo_open=True)
"""--memory-limit: GiB per GPU, as a GPU spec's memory_gib."""
SECONDS = Number(0.1, 7 * 86400)
"""--time-limit: seconds, at most a week."""
IMBALANCE = Number(1.0, 1e6)
"""--expert-imbalance: max/mean tokens per expert, as TrainingSpec.expert_imbalance."""


def engine_option(f):
    """--engine: the engine that runs the plan (amsp_planner/engines.py)."""
    from amsp_planner.engines import DEFAULT_ENGINE, ENGINES

    return click.option(
        "--engine", type=click.Choice(ENGINES), default=DEFAULT_ENGINE, show_default=True,
        help="The engine that runs the plan: search only what it executes exactly and predict "
             "with its behaviour (amsp: the bundled runtime, amsp train).")(f)


def tp_option(f):
    """--tp: the tensor-parallel degree, searched (auto) or pinned."""
    return click.option(
        "--tp", "tp", metavar="auto|T", default="auto", show_default=True,
        help="Tensor (+ sequence) parallel degree inside the node: auto searches every divisor "
             "of the GPUs per node that divides the heads; T pins it (1: data parallel only)."
    )(f)


def pp_option(f):
    """--pp: the pipeline-parallel degree (stages), pinned; 1 = none."""
    return click.option(
        "--pp", "pp", metavar="P", default="1", show_default=True,
        help="Pipeline stages (docs/cost-model.md, 'Pipeline parallelism'): P pins it and each "
             "stage's sharding, micro-batch and checkpointing are searched; 1: none."
    )(f)


def parse_pp(text) -> int:
    """--pp: P -> P; one line naming the option otherwise."""
    v = str(text).strip()
    if not v.isdigit() or int(v) < 1:
        raise AmspUserError(f"--pp {text}: use a number of pipeline stages that divides the "
                            "GPUs into whole nodes, e.g. --pp 4 (1: none)")
    return int(v)


def ep_option(f):
    """--ep: a mixture of experts' expert-parallel degree, searched (auto) or pinned."""
    return click.option(
        "--ep", "ep", metavar="auto|E", default="auto", show_default=True,
        help="Expert-parallel degree of a mixture-of-experts model (docs/moe.md): auto searches "
             "every divisor of the experts and the GPUs, both placements; E pins it."
    )(f)


def _auto_or_degree(text, option: str, what: str) -> int | None:
    """auto -> None (searched), a positive integer -> itself; one line naming `option` and
    what a degree must be (`what`) otherwise."""
    v = str(text).strip().lower()
    if v == "auto":
        return None
    try:
        d = int(v)
    except ValueError:
        d = 0
    if d < 1:
        raise AmspUserError(f"{option} {text}: use auto or {what}, e.g. {option} 8")
    return d


def parse_ep(text) -> int | None:
    """--ep: auto -> None (searched), E -> E; one line naming the option otherwise."""
    return _auto_or_degree(text, "--ep", "an expert-parallel degree that divides the routed "
                                         "experts and the GPUs")


def parse_tp(text) -> int | None:
    """--tp: auto -> None (searched), T -> T; one line naming the option otherwise."""
    return _auto_or_degree(text, "--tp", "a tensor-parallel degree that divides the GPUs per "
                                         "node")


PRECISIONS = ("bf16", "fp32", "fp8")


class PrecisionList(click.ParamType):
    """--precision of amsp compare: one precision or several, comma-separated (bf16,fp8),
    each once; returns them as a tuple in the order given."""

    name = "precision[,precision]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        items = [x.strip().lower() for x in str(value).split(",")]
        bad = [x for x in items if x not in PRECISIONS]
        if bad or len(set(items)) != len(items):
            why = f"{shown(bad[0])!r} is not a precision" if bad else "a precision is repeated"
            self.fail(f"{why}: give {', '.join(PRECISIONS)} or several of them "
                      "comma-separated, e.g. bf16,fp8", param, ctx)
        return tuple(items)


def job_options(f=None, *, precisions: bool = False):
    """--model, --gpus, --cluster, --set and the training options; with `precisions`,
    --precision takes a comma-separated list (PrecisionList: amsp compare side by side)."""
    if f is None:
        return lambda g: job_options(g, precisions=precisions)
    prec_help = ("bf16 mixed precision, fp32 everywhere, or fp8: bf16 with the blocks' "
                 "linears in FP8 (docs/fp8.md; never chosen by the planner)")
    if precisions:
        prec = click.option("--precision", type=PrecisionList(), default="bf16",
                            show_default=True,
                            help=prec_help + "; several, comma-separated (bf16,fp8), put the "
                                 "same job side by side in each.")
    else:
        prec = click.option("--precision", type=click.Choice(list(PRECISIONS)), default="bf16",
                            show_default=True, help=prec_help + ".")
    opts = [
        click.option("--model", "-m", required=True,
                     help="Model preset name or spec file (YAML, or a Hugging Face config.json)."),
        click.option("--gpus", "-n", required=True, type=click.IntRange(1, 2**20),
                     help="Number of GPUs (data-parallel ranks)."),
        click.option("--cluster", "-c", default=None,
                     help="Cluster preset or spec file (default: dgx-a100-hdr)."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                     help="Override a cluster field, e.g. nic_gbit_per_s=400 or gpu.memory_gib=40."),
        click.option("--seq-len", type=click.IntRange(min=1), default=4096, show_default=True,
                     help="Tokens per sequence."),
        click.option("--global-batch", default=None,
                     help="Global batch in tokens, K/M/G suffixes are powers of 2 (default 4M)."),
        click.option("--global-batch-seqs", type=click.IntRange(min=1), default=None,
                     help="Global batch in sequences (instead of --global-batch)."),
        click.option("--micro-batch", type=click.IntRange(min=1), default=None,
                     help="Pin sequences per GPU per micro-batch (default: searched; compare "
                          "uses 1; with --strategy, the mb= of a string without one)."),
        click.option("--activation-checkpointing", metavar="auto|on|off|K|op|moe", default="auto",
                     show_default=True,
                     help="Activation checkpointing: on (every block), off, K (the first K "
                          "blocks), op (op-level selective), moe (each MoE layer's MLP part "
                          "only); auto lets the planner choose."),
        click.option("--no-flash-attention", is_flag=True, help="Count s^2 attention activations."),
        click.option("--activation-profile",
                     type=click.Choice(["auto", "eager", "torchtitan", "compiled", "fused"]),
                     default="auto", show_default=True,
                     help="What autograd saves (docs/memory.md): eager PyTorch, torchtitan's "
                          "Llama, torch.compile, fused kernels (Megatron/TE, Liger); auto: the "
                          "engine's default."),
        click.option("--compile", "compile_", is_flag=True,
                     help="The blocks run under torch.compile: elementwise kernels and torchao's "
                          "FP8 casts priced fused (docs/cost-model.md); torchtitan's FP8 export "
                          "turns compile on."),
        prec,
        click.option("--fp8-recipe", type=click.Choice(
                         ["auto", "tensorwise", "rowwise", "blockwise", "mxfp8", "delayed"]),
                     default="auto", show_default=True,
                     help="FP8 scaling recipe (--precision fp8); auto: the engine's default "
                          "(torchtitan/fsdp2 rowwise, megatron delayed)."),
        click.option("--fp8-all-gather", type=click.Choice(["auto", "on", "off"]),
                     default="auto", show_default=True,
                     help="Gather FSDP/ZeRO-3 weights in FP8 (--precision fp8): auto lets the "
                          "planner choose where the engine and recipe allow it."),
        click.option("--tp-overlap", type=click.Choice(["off", "on"]), default="off",
                     show_default=True,
                     help="Tensor parallelism: the blocks' TP all-gathers and reduce-scatters "
                          "pipelined against their matmuls, as torchtitan's asynchronous TP "
                          "and Megatron's --tp-comm-overlap run them (docs/cost-model.md); "
                          "off: exposed. Never switched on by the planner."),
        click.option("--grad-accum-dtype", type=click.Choice(["bf16", "fp32"]), default="bf16",
                     show_default=True, help="Gradient shard and reduction dtype."),
        click.option("--memory-limit", type=MEMORY_GIB, default=None,
                     help="Memory per GPU in GiB (default: the GPU's memory; above it, a "
                          "warning)."),
        click.option("--expert-imbalance", type=IMBALANCE, default=1.0, show_default=True,
                     help="Mixture of experts: the most tokens an expert gets over the mean "
                          "(1.0: balanced routing); scales the expert matmuls, the all-to-alls "
                          "and their buffers (docs/moe.md)."),
        click.option("--expert-dispatch", type=click.Choice(["copies", "ranks"]),
                     default="copies", show_default=True,
                     help="Mixture of experts: the all-to-all sends a token once per routed "
                          "expert (copies), or once per EP rank it reaches (ranks: DeepEP)."),
        click.option("--expert-routing", type=click.Choice(["uniform", "round_robin"]),
                     default="uniform", show_default=True,
                     help="For --expert-dispatch ranks: experts drawn uniformly, or NeMo "
                          "AutoModel's round-robin fake balanced gate (docs/moe.md)."),
        click.option("--no-master-weights", is_flag=True,
                     help="No fp32 master copy: parameters, gradient shards and Adam's moments "
                          "in bf16 (NeMo AutoModel's MoE recipes; docs/moe.md)."),
        click.option("--offload-optimizer", is_flag=True,
                     help="Optimizer states and the fp32 master in host memory, AdamW on the "
                          "CPU (DeepSpeed offload_optimizer cpu; --engine deepspeed; never "
                          "chosen by the planner; docs/cost-model.md)."),
        click.option("--cross-entropy",
                     type=click.Choice(["logits", "compiled", "fused_linear"]),
                     default="logits", show_default=True,
                     help="The LM head and loss: the whole micro-batch's logits materialised "
                          "(logits), the same loss under torch.compile (compiled: logits and "
                          "their gradient at the training dtype), or Liger's fused linear "
                          "cross-entropy, chunked (fused_linear: no logits kept; "
                          "docs/memory.md)."),
        click.option("--z-loss", is_flag=True,
                     help="An eager z-loss beside the cross-entropy (OLMo-core's "
                          "z_loss_multiplier): its passes over the fp32 logits priced."),
        engine_option,
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def choice_options(f):
    """--headroom, --quantization and --tie-band: how the planner chooses among candidates."""
    opts = [
        click.option("--headroom", type=float, default=0.10, show_default=True,
                     help="Fraction of the memory limit a plan must leave free (0 allowed)."),
        click.option("--quantization", type=click.Choice(["auto", "on", "off"]), default="auto",
                     show_default=True,
                     help="qwZ/qgZ: auto = only when faster than the best lossless plan by more "
                          "than the band; on = like any option; off = never."),
        click.option("--tie-band", type=float, default=None,
                     help="Relative step-time difference below which candidates are "
                          "equivalent (default: the validated relative band, the error of the "
                          "predicted ratio of two strategies; docs/validation.md)."),
        click.option("--prefer", type=click.Choice(["speed", "memory"]), default="speed",
                     show_default=True,
                     help="Among equivalent candidates with the least recompute and fewest "
                          "process groups: the predicted-faster one, or the one with less "
                          "memory per GPU."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def build_preference(headroom: float = 0.10, quantization: str = "auto",
                     tie_band: float | None = None, job=None, prefer: str = "speed",
                     **_ignored):
    """The planner's Preference from the choice options (the band: --tie-band, else the
    validated relative band of `job`)."""
    from amsp_planner.solver.space import Preference

    return Preference.default(band=tie_band, headroom=headroom, quantization=quantization,
                              job=job, prefer=prefer)


MOE_OPTIONS = ("expert_imbalance", "expert_dispatch", "expert_routing")


def _given(param: str) -> bool:
    ctx = click.get_current_context(silent=True)
    src = ctx.get_parameter_source(param) if ctx else None
    return src is None or src.name not in ("DEFAULT", "DEFAULT_MAP")


def seq_len_for(model, seq_len: int, param: str = "seq_len") -> int:
    """--seq-len; when not given and the reference 4096 is longer than the learned positions
    of the model (GPT-3: 2048), the model's max_seq_len, with a note."""
    if _given(param) or model.position_embedding != "learned" or seq_len <= model.max_seq_len:
        return seq_len
    note(f"--seq-len not given: planning at {model.max_seq_len}, the longest "
         f"sequence {model.name}'s learned positions hold (the default {seq_len} is longer)")
    return model.max_seq_len


def warn_seq_len(model, seq_len: int, param: str = "seq_len") -> None:
    """A note on stderr when a --seq-len given is longer than the model supports (the default
    4096 is the planner's reference job, so it says nothing)."""
    if _given(param) and seq_len > model.max_seq_len and model.position_embedding != "learned":
        note(f"--seq-len {seq_len} is longer than {model.name}'s max_seq_len "
             f"{model.max_seq_len}: planning anyway; pass --seq-len {model.max_seq_len} "
             "to stay within it", "warning")


def build_job(model, gpus, cluster, sets, seq_len, global_batch, global_batch_seqs, micro_batch,
              activation_checkpointing, no_flash_attention, precision, grad_accum_dtype,
              memory_limit=None, activation_profile="auto", engine="amsp", fp8_recipe="auto",
              fp8_all_gather="auto", expert_imbalance=1.0, expert_dispatch="copies",
              expert_routing="uniform", no_master_weights=False, offload_optimizer=False,
              tp_overlap="off", compile_=False, pp=1, cross_entropy="logits", z_loss=False,
              given=None, **_ignored):
    """(Job, memory limit in bytes) from the shared options (`pp`: the pipeline stages it is
    planned with; `given`: a strategy string, whose pp and cp split the batch instead)."""
    from pydantic import ValidationError

    from amsp_planner.cost.job import Job, check_batch_tokens
    from amsp_planner.specs import TrainingSpec, load_cluster, load_model, parse_batch

    m = load_model(model)
    from amsp_planner.specs.loader import parse_sets

    c = load_cluster(cluster, parse_sets(sets) if sets else None)
    tokens = parse_batch(global_batch) if global_batch is not None else None
    if tokens is not None and global_batch_seqs is not None:
        raise AmspUserError("give --global-batch or --global-batch-seqs, not both")
    from amsp_planner.ckpt_setting import ckpt_option

    ckpt = ckpt_option(activation_checkpointing)
    ctx = click.get_current_context(silent=True)
    src = [ctx.get_parameter_source(n) if ctx else None for n in MOE_OPTIONS]
    moe_opts = [f"--{n.replace('_', '-')}" for n, s in zip(MOE_OPTIONS, src, strict=True)
                if s is not None and s.name not in ("DEFAULT", "DEFAULT_MAP")]
    if moe_opts and not m.is_moe:  # nothing of the job would read them
        raise AmspUserError(f"{moe_opts[0]}: {m.name} has no routed experts: drop it")
    if type(ckpt) is int and ckpt > m.num_layers:
        raise AmspUserError(f"--activation-checkpointing {ckpt}: the model has {m.num_layers} "
                            f"blocks: use a block count from 0 to {m.num_layers}, on, off or op")
    seq_len = seq_len_for(m, seq_len)
    if global_batch_seqs is None:  # the batch in tokens must be whole sequences
        check_batch_tokens(tokens, seq_len, micro_batch, gpus)
    try:
        t = TrainingSpec(seq_len=seq_len, global_batch_tokens=tokens,
                         global_batch_seqs=global_batch_seqs, micro_batch=micro_batch,
                         activation_checkpointing=ckpt, flash_attention=not no_flash_attention,
                         precision=precision, grad_accum_dtype=grad_accum_dtype,
                         activation_profile=None if activation_profile in (None, "auto")
                         else activation_profile,
                         fp8_recipe=None if fp8_recipe in (None, "auto") else fp8_recipe,
                         fp8_all_gather=fp8_all_gather, expert_imbalance=expert_imbalance,
                         expert_dispatch=expert_dispatch, expert_routing=expert_routing,
                         master_weights=not no_master_weights,
                         optimizer_offload="cpu" if offload_optimizer else "none",
                         tp_overlap=tp_overlap == "on", compile=compile_,
                         cross_entropy=cross_entropy, z_loss=z_loss)
    except ValidationError as e:
        raise AmspUserError(training_error(e)) from None
    if t.precision == "fp8":
        from amsp_planner.cost.fp8 import check_training
        from amsp_planner.cost.fp8_notes import export_warning

        t = t.model_copy(update={"fp8_recipe": check_training(t, engine, c.gpu.arch)})
        if said := export_warning(engine, t.fp8_recipe, t.fp8_all_gather):
            note(said, "warning")
    warn_seq_len(m, seq_len)
    c, split = Job.fit_nodes(c, gpus)
    if split:
        note(split)
    from amsp_planner.strategy_baselines import given_degrees

    pp, cp = given_degrees(given, gpus, c.gpus_per_node, pp) if given else (pp, 1)
    job = Job.create(m, c, t, gpus, engine, pp=pp, cp=cp)
    said = job.profile.training_note(t)
    if said:
        note(said)
    if t.activation_profile is None and job.training.activation_profile != "eager":
        note(f"activations priced as {job.profile.title} runs them "
             f"(--activation-profile {job.training.activation_profile}, docs/memory.md)")
    limit = memory_limit * 1024**3 if memory_limit is not None else c.memory_bytes
    if limit > c.memory_bytes * (1 + 1e-9):
        note(f"--memory-limit {memory_limit:g} GiB is above the {c.memory_bytes / 1024**3:g} GiB "
             f"of {c.name}'s GPU: planned as if it had that much (--set gpu.memory_gib=N plans "
             "a larger GPU)", "warning")
    return job, limit
