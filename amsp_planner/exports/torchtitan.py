"""torchtitan 0.3: a plan as the command-line overrides of a torchtitan training run.

    amsp export plan.json --to torchtitan -o amsp_torchtitan.args
    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \
        $(grep -v '^#' amsp_torchtitan.args)

torchtitan 0.3 builds its configuration from a Python config function (``--module``,
``--config``) and ``--section.field=value`` overrides parsed by its ``ConfigManager`` (tyro);
the overrides here set the data-parallel mesh, batch and precision, and the activation
checkpointing policy (a tyro subcommand, ``activation-checkpoint:full|selective|none``).
torchtitan 0.3 checkpoints every block or none: ``full``, or ``selective`` (per-op SAC; the
per-layer ``selective_ac_option: N`` of torchtitan 0.1, every N-th block, is gone), so a plan
that checkpoints K of L blocks exports as the best of none, full and op-level, priced.
Op-level maps to ``selective``, whose policy keeps the matmul and attention outputs but
recomputes every second matmul: less memory and more recompute than the plan's op-level. torchtitan
builds FSDP2/HSDP from ``data_parallel_replicate_degree`` x ``data_parallel_shard_degree``;
``fsdp_reshard_after_forward`` takes only "default", "always" or "never" (no int), so it
expresses (s, s, s) with s = shard degree and nothing else: no hpZ, qwZ or qgZ. Gradient
accumulation is global_batch_size / (local_batch_size x DP degree). torchtitan 0.3 reduces
gradients in float32 only (``mixed_precision_reduce``).

Tensor parallelism (a plan with tp = T > 1): ``parallelism.tensor_parallel_degree=T`` (torchtitan
puts TP innermost on the mesh, so a TP group is T consecutive ranks of one node, as the plan's
layout), with sequence parallelism on (``--parallelism.enable-sequence-parallel``, its default)
and asynchronous TP off (``--compile.no-enable-async-tensor-parallel``: the plan prices TP
collectives exposed), or on with torch.compile where the plan has ``tp_overlap``
(``--compile.enable-async-tensor-parallel --compile.enable``: the pipelined overlap of
cost/tp_overlap.py); replicate x shard = N/T data-parallel ranks.

Mixture of experts (a plan with ``ep=E``): ``parallelism.expert_parallel_degree=E``. torchtitan
takes the EP group from the FSDP ranks, innermost on the mesh (E consecutive ranks), and shards
the routed experts over the derived expert-FSDP mesh efsdp = data_parallel_shard_degree / E,
replicated over the replicate degree (``ParallelDims.build_mesh``; ``apply_fsdp_to_decoder``'s
``edp_mesh``): the plan's expert triple is (s/E, s/E, s/E) for shard degree s
(exports/moe.py); a plan with another expert triple or ``ep.span`` exports as the closest such.

``check`` verifies the names, choices and arithmetic without torchtitan; ``check_with_torchtitan``
parses the overrides with torchtitan's own ConfigManager (the interop extra).
"""

from __future__ import annotations

from amsp_planner.cost.job import Job
from amsp_planner.exports.common import ExportResult, expressible, finish
from amsp_planner.strategy import Strategy

TARGET = "torchtitan"

WHY = {
    "s_P": "torchtitan shards parameters, gradients and optimizer states over one group",
    "s_G": "torchtitan shards parameters, gradients and optimizer states over one group",
    "s_OS": "torchtitan shards parameters, gradients and optimizer states over one group",
    "hpZ": "fsdp_reshard_after_forward has no partial (int) setting",
    "qwz": "torchtitan has no quantized all-gather",
    "qgz": "torchtitan has no quantized gradient reduction",
    "checkpointing": "torchtitan 0.3 checkpoints every block or none (no per-layer option)",
    "ep.span": "torchtitan puts the EP group innermost on the mesh: consecutive ranks",
    "ep.p": "torchtitan shards the experts over efsdp = shard degree / EP, for P, G and OS",
    "ep.g": "torchtitan shards the experts over efsdp = shard degree / EP, for P, G and OS",
    "ep.os": "torchtitan shards the experts over efsdp = shard degree / EP, for P, G and OS",
}
AC_MODES = {True: "full", False: "none", "op": "selective"}
"""The plan's checkpointing -> torchtitan's activation-checkpoint subcommand."""


def _expressible(value) -> bool:
    return value is True or value is False or value == "op"

# The Trainer.Config fields this export writes, by section, with their types (torchtitan 0.3:
# torchtitan/config/configs.py TrainingConfig, ParallelismConfig).
SCHEMA = {
    "training": {"local_batch_size": int, "global_batch_size": int, "seq_len": int,
                 "mixed_precision_param": str, "mixed_precision_reduce": str},
    "parallelism": {"data_parallel_replicate_degree": int, "data_parallel_shard_degree": int,
                    "fsdp_reshard_after_forward": str, "tensor_parallel_degree": int,
                    "pipeline_parallel_degree": int, "context_parallel_degree": int},
}
OPTIONAL = {("parallelism", "expert_parallel_degree"): int}
"""Fields written only for a plan with an expert strategy (default 1 when absent)."""
CHOICES = {
    ("training", "mixed_precision_param"): ("bfloat16", "float32"),
    ("training", "mixed_precision_reduce"): ("float32",),
    ("parallelism", "fsdp_reshard_after_forward"): ("default", "always", "never"),
}
AC = "activation-checkpoint"
"""The tyro subcommand that picks the activation checkpointing policy."""
CHECK_BASE = ("--module", "llama3", "--config", "llama3_debugmodel")
TP_FLAGS = {"--parallelism.enable-sequence-parallel": ("enable_sequence_parallel", True),
            "--compile.no-enable-async-tensor-parallel": ("enable_async_tensor_parallel", False)}
"""The flags a tensor-parallel export writes: (the torchtitan field, the value it sets)."""
ASYNC_TP_FLAGS = {"--parallelism.enable-sequence-parallel": ("enable_sequence_parallel", True),
                  "--compile.enable-async-tensor-parallel": ("enable_async_tensor_parallel",
                                                             True),
                  "--compile.enable": ("enable", True)}
"""The flags of a plan with ``tp_overlap`` (cost/tp_overlap.py): asynchronous TP, which runs
as torch._inductor's micro_pipeline_tp pass, so with torch.compile on."""
FP8_FLAGS = {"--compile.enable": ("enable", True)}
"""The flag an FP8 export, or one of a plan priced with ``--compile`` (``training.compile``),
writes: torch.compile on (torchao's casts fused; the published FP8 speed-ups the plan prices are
measured compiled; model_compile_enabled in the converter)."""
"""A config function the overrides are parsed onto (theirs is the user's own)."""


def candidates(job: Job, plan: Strategy) -> list[Strategy]:
    """Every strategy the target runs exactly for this job (its engine profile,
    amsp_planner/engines.py), with the plan's micro-batch, accumulation and checkpointing."""
    return expressible(job.for_engine(TARGET), plan)


def sections(job: Job, s: Strategy) -> dict[str, dict]:
    assert s.s_p == s.s_g == s.s_os and s.hpz == 1 and not (s.qwz or s.qgz), s
    t = job.training
    experts = {}
    if s.has_experts:
        f = s.s_p // s.ep
        assert not s.ep_span and (s.ep_p, s.ep_g, s.ep_os) == (f, f, f), s
        experts = {"expert_parallel_degree": s.ep}
    return {
        "training": {
            "local_batch_size": s.micro_batch,
            "global_batch_size": t.batch_seqs,
            "seq_len": t.seq_len,
            "mixed_precision_param": "float32" if t.precision == "fp32" else "bfloat16",
            "mixed_precision_reduce": "float32",
        },
        "parallelism": {
            "data_parallel_replicate_degree": job.num_gpus // s.tp // s.s_p,
            "data_parallel_shard_degree": s.s_p,
            "fsdp_reshard_after_forward": "always",
            "tensor_parallel_degree": s.tp,
            "pipeline_parallel_degree": 1,
            "context_parallel_degree": 1,
            **experts,
        },
    }


def render(job: Job, s: Strategy) -> str:
    lines = [f"# torchtitan overrides for {job.model.name} on {job.num_gpus} GPUs of "
             f"{job.cluster.name}: strategy {s}",
             "# Generated by `amsp export --to torchtitan`. One override per line; pass them after "
             "your --module and --config:",
             "#   torchrun ... -m torchtitan.train --module M --config C $(grep -v '^#' FILE)",
             f"# Gradient accumulation: {job.n_micro(s)} micro-batches per step."]
    if s.has_experts:
        lines.append(f"# Experts: EP groups of {s.ep} consecutive ranks; expert FSDP mesh efsdp = "
                     f"shard degree / EP = {s.s_p // s.ep}, x {job.num_gpus // s.s_p} replicas "
                     "(torchtitan ParallelDims.build_mesh)")
    for name, fields in sections(job, s).items():
        lines += [f"--{name}.{k}={v}" for k, v in fields.items()]
    if s.tp > 1:
        lines += list(ASYNC_TP_FLAGS if job.training.tp_overlap else TP_FLAGS)
    if job.training.precision == "fp8" or job.training.compile:
        # torch.compile on: the plan priced it compiled (--compile), or FP8 (torchao's casts)
        lines += [f for f in FP8_FLAGS if f not in lines]
    if job.training.precision == "fp8":
        from amsp_planner.exports.fp8 import torchtitan_lines

        lines[4:4] = torchtitan_lines(job)  # after the header
    lines.append(f"{AC}:{AC_MODES[s.ckpt_value]}")
    return "\n".join(lines) + "\n"


def overrides(text: str) -> list[str]:
    """The arguments of an export: its lines that are not comments."""
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def export(job: Job, strategy: Strategy, memory_limit: float | None = None) -> ExportResult:
    def notes(s: Strategy) -> list[str]:
        out = []
        if s.ckpt_op:
            out.append("torchtitan's selective policy recomputes every second matmul, which "
                       "the plan's op-level checkpointing keeps: less activation memory and "
                       "more recompute than priced")
        if s.s_p < job.num_gpus // s.tp and job.n_micro(s) > 1:
            out.append("torchtitan all-reduces HSDP replicas on every micro-batch; the plan "
                       "prices one all-reduce per step")
        if job.training.precision == "fp8" and not job.training.compile:
            out.append("FP8 runs compiled here (--compile.enable: torchao's casts fused, as the "
                       "published FP8 speed-ups were measured); the plan was priced without "
                       "--compile (its elementwise kernels eager): re-plan with --compile for "
                       "the step this runs")
        return out

    return finish(TARGET, job, strategy, memory_limit, render, WHY, notes)


def check(text: str, num_gpus: int) -> dict:
    """Parse the overrides and check names, types, choices and the DP/batch arithmetic.

    Returns {section: {field: value}} plus {"activation_checkpoint": mode}; raises ValueError
    naming the field. Needs no torchtitan (``check_with_torchtitan`` uses it).
    """
    doc: dict = {name: {} for name in SCHEMA}
    for arg in overrides(text):
        if arg.startswith(f"{AC}:"):
            doc["activation_checkpoint"] = arg.split(":", 1)[1]
            continue
        if arg in TP_FLAGS or arg in ASYNC_TP_FLAGS and arg not in FP8_FLAGS:
            field, value = {**TP_FLAGS, **ASYNC_TP_FLAGS}[arg]
            doc.setdefault("tp_flags", {})[field] = value
            continue
        if arg in FP8_FLAGS:
            doc["compile_enable"] = FP8_FLAGS[arg][1]
            continue
        key, eq, value = arg.removeprefix("--").partition("=")
        section, _, name = key.partition(".")
        kind = SCHEMA.get(section, {}).get(name) or OPTIONAL.get((section, name))
        if not arg.startswith("--") or not eq or kind is None:
            raise ValueError(f"{arg}: not a torchtitan field this export writes")
        try:
            doc[section][name] = kind(value)
        except ValueError:
            raise ValueError(f"--{key}: expected {kind.__name__}, got {value!r}") from None
        choices = CHOICES.get((section, name))
        if choices and value not in choices:
            raise ValueError(f"--{key}: {value!r} not in {choices}")
    for section, fields in SCHEMA.items():
        missing = sorted(set(fields) - set(doc[section]))
        if missing:
            raise ValueError(f"--{section}.{missing[0]} missing")
    if doc.get("activation_checkpoint") not in AC_MODES.values():
        raise ValueError(f"{AC}:full, {AC}:selective or {AC}:none missing")
    par, tr = doc["parallelism"], doc["training"]
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    tp = par["tensor_parallel_degree"]
    if dp * tp != num_gpus:
        what = "replicate x shard degree" + (" x tensor_parallel_degree" if tp > 1 else "")
        raise ValueError(f"{what} {dp * tp} != {num_gpus} GPUs")
    if tp > 1 and doc.get("tp_flags") not in (dict(TP_FLAGS.values()),
                                              dict(list(ASYNC_TP_FLAGS.values())[:2])):
        raise ValueError(f"tensor_parallel_degree={tp} needs {' and '.join(TP_FLAGS)}")
    if tp > 1 and doc["tp_flags"]["enable_async_tensor_parallel"] \
            and not doc.get("compile_enable"):
        raise ValueError("--compile.enable-async-tensor-parallel needs --compile.enable")
    if tr["global_batch_size"] % (tr["local_batch_size"] * dp):
        raise ValueError("global_batch_size is not a multiple of local_batch_size x DP degree")
    ep = par.setdefault("expert_parallel_degree", 1)
    fsdp = par["data_parallel_shard_degree"] * par["context_parallel_degree"] * tp
    if ep < 1 or fsdp % ep:
        raise ValueError(f"--parallelism.expert_parallel_degree {ep} does not divide "
                         f"data_parallel_shard_degree x cp x tp = {fsdp}")
    doc["efsdp"] = fsdp // ep  # torchtitan ParallelDims.build_mesh: efsdp = fsdp * tp // ep
    from amsp_planner.exports.fp8 import check_torchtitan_code

    fp8 = check_torchtitan_code(text)
    if fp8 is not None:
        if not doc.get("compile_enable"):
            raise ValueError(f"an FP8 export needs {' '.join(FP8_FLAGS)}")
        doc["fp8"] = fp8
    return doc


def _tyro_message(out: str) -> str:
    """tyro's error box as one line: the text between its first and last rule."""
    lines = [ln.strip() for ln in out.splitlines()]
    rules = [i for i, ln in enumerate(lines) if ln and set(ln) <= set("-─")]
    body = lines[rules[0] + 1:rules[-1]] if len(rules) >= 2 else lines[-3:]
    return " ".join(ln for ln in body if ln) or "no message"


def check_with_torchtitan(text: str) -> dict:
    """Parse the overrides with torchtitan's own ConfigManager onto CHECK_BASE; return what it
    built, in ``check``'s shape. Raises ValueError with torchtitan's message when it refuses."""
    import contextlib
    import io
    import logging

    from torchtitan.config import ConfigManager

    quiet = io.StringIO()
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            cfg = ConfigManager().parse_args([*CHECK_BASE, *overrides(text)])
    except SystemExit:  # tyro prints its error and exits
        raise ValueError(f"torchtitan refused it: {_tyro_message(quiet.getvalue())}") from None
    finally:
        logging.disable(logging.NOTSET)
    doc = {name: {f: getattr(getattr(cfg, name), f) for f in fields}
           for name, fields in SCHEMA.items()}
    par = doc["parallelism"]
    par["expert_parallel_degree"] = cfg.parallelism.expert_parallel_degree
    doc["efsdp"] = (par["data_parallel_shard_degree"] * par["context_parallel_degree"]
                    * par["tensor_parallel_degree"] // par["expert_parallel_degree"])
    if cfg.parallelism.tensor_parallel_degree > 1:
        doc["tp_flags"] = {"enable_sequence_parallel": cfg.parallelism.enable_sequence_parallel,
                           "enable_async_tensor_parallel":
                               cfg.compile.enable_async_tensor_parallel}
    if cfg.compile.enable:
        doc["compile_enable"] = True
    from amsp_planner.exports.fp8 import check_torchtitan_code, check_torchtitan_converter

    fp8 = check_torchtitan_code(text)
    if fp8 is not None:  # its names and choices against torchtitan's own converter Config
        check_torchtitan_converter(fp8)
        doc["fp8"] = fp8
    ac = type(cfg.activation_checkpoint).__qualname__ if cfg.activation_checkpoint else "none"
    names = {"FullAC": "full", "SelectiveAC": "selective"}
    doc["activation_checkpoint"] = names.get(ac.split(".")[0], ac)
    return doc
