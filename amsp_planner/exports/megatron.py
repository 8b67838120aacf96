"""Megatron-Core (Megatron-LM's pretrain_gpt.py): a plan as its command-line arguments.

    amsp export plan.json --to megatron -o megatron_args.sh

What Megatron-Core expresses, as points of the AMSP space (N' = N / t data-parallel ranks):

==================  ===================================================================
(s_P, s_G, s_OS)    arguments
==================  ===================================================================
(1, 1, 1)           DDP (no ``--use-distributed-optimizer``)
(1, 1, s), s > 1    ``--use-distributed-optimizer --num-distributed-optimizer-instances N'/s``
                    (optimizer states sharded over s ranks, replicated N'/s times)
==================  ===================================================================

Tensor parallelism ``tp=T``: ``--tensor-model-parallel-size T --sequence-parallel`` (T divides
the node: Megatron places TP ranks first, inside the node, as the plan does). Activation
checkpointing: ``--recompute-granularity full --recompute-method block
--recompute-num-layers K`` checkpoints the first K blocks (K = L: all); Megatron's selective
granularity recomputes attention's core only, which is not the planner's op-level, so an
op-level plan exports as the best of none, full and K blocks, priced; ``ckpt=moe`` is
``--recompute-granularity selective --recompute-modules moe`` (MoELayer.forward checkpoints the
whole MoE layer from its input: megatron/core/transformer/moe/moe_layer.py at d98e8a6). bf16 makes Megatron
accumulate and reduce gradients in fp32 (``megatron/training/arguments.py``): a plan made for
another engine with bf16 gradients is priced so, and the export says it. Not expressed: sharded
parameters or gradients (Megatron's FSDP is another code path), hpZ, qwZ, qgZ.

Mixture of experts (a plan with ``ep=E``): ``--expert-model-parallel-size E`` (expert tensor
parallelism 1). Megatron's default rank order tp-cp-ep-dp-pp puts an EP group on E consecutive
ranks (the plan's placement in the node); the distributed optimizer shards the expert optimizer
states over the expert-data-parallel group of N/E ranks (``megatron/core/optimizer``:
``intra_expt_dp_group``) as the dense ones over all N: dense (1, 1, N) goes with experts
(1, 1, N/E), DDP with (1, 1, 1) (exports/moe.py). Another expert triple or ``ep.span`` exports
as the closest of these, priced.

Checked here by parsing the arguments back (``check``); Megatron-LM is not installed.
"""

from __future__ import annotations

import shlex

from amsp_planner.cost.job import Job
from amsp_planner.exports.common import ExportResult, expressible, finish
from amsp_planner.strategy import Strategy

TARGET = "megatron"

WHY = {
    "s_P": "Megatron's distributed optimizer keeps parameters whole on every data-parallel rank",
    "s_G": "Megatron's distributed optimizer reduce-scatters gradients once per step: they are "
           "whole during backward",
    "hpZ": "Megatron has no hpZ",
    "qwz": "Megatron has no quantized all-gather",
    "qgz": "Megatron has no quantized gradient reduction",
    "checkpointing": "Megatron's selective recomputation is attention's core, not op-level",
    "ep.span": "Megatron's rank order tp-cp-ep-dp-pp puts an EP group on consecutive ranks",
    "ep.p": "Megatron's distributed optimizer shards only the expert optimizer states, over "
            "the N/E expert-data-parallel ranks",
    "ep.g": "Megatron's distributed optimizer shards only the expert optimizer states, over "
            "the N/E expert-data-parallel ranks",
    "ep.os": "Megatron's distributed optimizer shards only the expert optimizer states, over "
             "the N/E expert-data-parallel ranks",
}


def candidates(job: Job, plan: Strategy) -> list[Strategy]:
    """Every strategy Megatron runs exactly for this job (its engine profile), with the plan's
    micro-batch, accumulation and checkpointing."""
    return expressible(job.for_engine(TARGET), plan)


def arguments(job: Job, s: Strategy) -> list[str]:
    """The pretrain_gpt.py arguments of strategy `s` (parallelism, batch, recomputation)."""
    assert s.s_p == 1 and s.s_g == 1 and s.hpz == 1 and not (s.qwz or s.qgz), s
    t, tp = job.training, s.tp
    dp = job.num_gpus // (tp * s.pp)
    out = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(s.pp)]
    chunk = -(-job.model.num_layers // (s.pp * s.vpp))  # blocks of the largest model chunk
    if s.vpp > 1 and job.model.num_layers % (s.pp * s.vpp):
        # the embedding and the loss in a block's place (strategy_pipeline.CHUNK_SPLITS):
        # megatron/training/arguments.py adds one layer for each before dividing
        chunk = (job.model.num_layers + 2) // (s.pp * s.vpp)
        out += ["--num-virtual-stages-per-pipeline-rank", str(s.vpp),
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split"]
    elif s.vpp > 1:  # megatron/training/arguments.py: --num-layers-per-virtual-pipeline-stage
        out += ["--num-layers-per-virtual-pipeline-stage", str(chunk)]
    if tp > 1 and t.sequence_parallel:
        out.append("--sequence-parallel")
        if t.tp_overlap:  # Transformer Engine's userbuffers (cost/tp_overlap.py)
            out.append("--tp-comm-overlap")
    if s.has_experts and s.ep > 1:
        assert not s.ep_span and (s.ep_p, s.ep_g) == (1, 1), s
        # the distributed optimizer shards the experts over a stage's N/(P e) expert-DP ranks
        assert s.ep_os == (1 if s.s_os == 1 else job.num_gpus // (s.pp * s.ep)), s
        out += ["--expert-model-parallel-size", str(s.ep), "--expert-tensor-parallel-size", "1"]
    out += ["--micro-batch-size", str(s.micro_batch), "--global-batch-size", str(t.batch_seqs),
            "--seq-length", str(t.seq_len)]
    if t.precision in ("bf16", "fp8"):
        out.append("--bf16")
    if t.precision == "fp8":  # Transformer Engine's FP8 (exports/fp8.py)
        from amsp_planner.exports.fp8 import megatron_arguments

        out += megatron_arguments(job, s)
    if s.s_os > 1:
        out.append("--use-distributed-optimizer")
        if dp // s.s_os > 1:
            out += ["--num-distributed-optimizer-instances", str(dp // s.s_os)]
    if t.dp_overlap:  # the profile's overlap_flags (engines.py); the gather needs the
        flags = job.profile.execution.overlap_flags.split()  # distributed optimizer
        out += flags if s.s_os > 1 else flags[:1]
    if s.ckpt_moe:  # megatron/core/transformer/moe/moe_layer.py at d98e8a6: moe_layer_recompute
        return out + ["--recompute-granularity", "selective", "--recompute-modules", "moe"]
    # --recompute-num-layers counts the blocks of one (virtual) pipeline stage
    k = chunk if s.ckpt_value is True else int(s.ckpt_value or 0)
    if k:
        out += ["--recompute-granularity", "full", "--recompute-method", "block",
                "--recompute-num-layers", str(k)]
    return out


def render(job: Job, s: Strategy) -> str:
    args = arguments(job, s)
    pairs, i = [], 0
    while i < len(args):  # one flag (and its value) per line
        take = 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
        pairs.append(" ".join(args[i:i + take]))
        i += take
    body = " \\\n".join(f"    {p}" for p in pairs)
    return (f"# Megatron-Core arguments for {job.model.name} on {job.num_gpus} GPUs of "
            f"{job.cluster.name}: strategy {s}\n"
            "# Generated by `amsp export --to megatron`; add them to your pretrain_gpt.py command "
            "(model shape, data, optimizer stay yours).\n"
            f"MEGATRON_PARALLEL_ARGS=\"\n{body}\n\"\n")


def export(job: Job, strategy: Strategy, memory_limit: float | None = None) -> ExportResult:
    if strategy.pp > 1:
        return export_pipeline(job, strategy)

    def notes(s: Strategy) -> list[str]:
        if job.training.dp_overlap:
            return ["--overlap-grad-reduce and --overlap-param-gather given (dp_overlap): the "
                    "plan prices them"]
        return ["Megatron reduce-scatters gradients and all-gathers parameters after backward "
                "and before the next forward unless --overlap-grad-reduce and "
                "--overlap-param-gather are given; the plan prices the defaults"]

    return finish(TARGET, job, strategy, memory_limit, render, WHY, notes)


def check(text: str, num_gpus: int, batch_seqs: int) -> dict:
    """Parse the arguments back and check their arithmetic; returns the parsed values
    (tp, micro_batch, dp, os, recompute_layers; ep and edp with expert parallelism); raises ValueError naming the flag."""
    try:
        body = text.split('MEGATRON_PARALLEL_ARGS="', 1)[1].split('"', 1)[0]
    except IndexError:
        raise ValueError("MEGATRON_PARALLEL_ARGS: missing") from None
    toks = shlex.split(body.replace("\\\n", " "))
    flags: dict[str, str | bool] = {}
    for i, tok in enumerate(toks):
        if tok.startswith("--"):
            nxt = toks[i + 1] if i + 1 < len(toks) else None
            flags[tok] = nxt if nxt is not None and not nxt.startswith("--") else True

    def num(flag: str, default: int | None = None) -> int:
        v = flags.get(flag, default)
        if not isinstance(v, str | int) or not str(v).isdigit() or int(v) < 1:
            raise ValueError(f"{flag}: expected a positive int")
        return int(v)

    tp, mb, gb = (num("--tensor-model-parallel-size"), num("--micro-batch-size"),
                  num("--global-batch-size"))
    if num_gpus % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {num_gpus} GPUs")
    if flags.get("--sequence-parallel", True) is not True:
        raise ValueError("--sequence-parallel: takes no value")
    # megatron/training/arguments.py at f2e5db4 asserts these two
    if "--tp-comm-overlap" in flags and flags.get("--sequence-parallel") is not True:
        raise ValueError("--tp-comm-overlap: needs --sequence-parallel")
    if "--overlap-param-gather" in flags and not {"--use-distributed-optimizer",
                                                   "--overlap-grad-reduce"} <= set(flags):
        raise ValueError("--overlap-param-gather: needs --use-distributed-optimizer and "
                         "--overlap-grad-reduce")
    pp = num("--pipeline-model-parallel-size", 1)
    if num_gpus % (tp * pp):
        raise ValueError(f"--pipeline-model-parallel-size {pp} x --tensor-model-parallel-size "
                         f"{tp} does not divide {num_gpus} GPUs")
    dp = num_gpus // (tp * pp)
    if gb != batch_seqs or gb % (mb * dp):
        raise ValueError("--global-batch-size: not the plan's batch, or not a multiple of "
                         "--micro-batch-size x data-parallel ranks")
    inst = num("--num-distributed-optimizer-instances", 1)
    if inst > 1 and "--use-distributed-optimizer" not in flags:
        raise ValueError("--num-distributed-optimizer-instances: needs --use-distributed-optimizer")
    if dp % inst:
        raise ValueError(f"--num-distributed-optimizer-instances {inst} does not divide {dp}")
    layers = num("--recompute-num-layers", 1) if "--recompute-method" in flags else 0
    ep = num("--expert-model-parallel-size", 1)
    if dp % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {dp} "
                         "data-parallel ranks")
    experts = {"ep": ep, "edp": dp // ep} if "--expert-model-parallel-size" in flags else {}
    out = {**experts, "tp": tp, **({"pp": pp} if pp > 1 else {}), "micro_batch": mb, "dp": dp,
           "os": dp // inst if "--use-distributed-optimizer" in flags else 1,
           "recompute_layers": layers,
           **({"tp_overlap": True} if "--tp-comm-overlap" in flags else {}),
           **({"dp_overlap": True} if "--overlap-grad-reduce" in flags else {}),
           **({"recompute_modules": flags["--recompute-modules"]}
              if "--recompute-modules" in flags else {})}
    if "--fp8-format" in flags:
        out["fp8"] = _check_fp8(flags)
    return out


def _check_fp8(flags: dict) -> dict:
    """The FP8 arguments against Megatron's choices at d98e8a6 (exports/fp8.py)."""
    from amsp_planner.exports.fp8 import MEGATRON_FORMATS, MEGATRON_RECIPES

    fmt, recipe = flags.get("--fp8-format"), flags.get("--fp8-recipe", "delayed")
    if fmt not in MEGATRON_FORMATS:
        raise ValueError(f"--fp8-format: {fmt!r} not in {MEGATRON_FORMATS}")
    if recipe not in MEGATRON_RECIPES:
        raise ValueError(f"--fp8-recipe: {recipe!r} not in {MEGATRON_RECIPES}")
    if "--bf16" not in flags:
        raise ValueError("--fp8-format: needs --bf16 (FP8 runs inside bf16 mixed precision)")
    if "--fp8-param-gather" in flags and "--use-distributed-optimizer" not in flags:
        raise ValueError("--fp8-param-gather: needs --use-distributed-optimizer")
    return {"format": fmt, "recipe": recipe, "param_gather": "--fp8-param-gather" in flags}


def export_pipeline(job: Job, s: Strategy) -> ExportResult:
    """A plan with pipeline stages: Megatron runs it as planned when its data-parallel part is
    one Megatron runs (parameters and gradients whole: DDP or the distributed optimizer, no
    ZeRO++, the 1F1B or interleaved schedule); refused in one line otherwise."""
    from amsp_planner.errors import AmspUserError
    from amsp_planner.strategy_pipeline import schedule_of

    bad = [k for k, v in (("p", s.s_p > 1), ("g", s.s_g > 1), ("hpz", s.hpz > 1),
                          ("qwz", s.qwz), ("qgz", s.qgz), ("fp8ag", s.fp8ag),
                          ("pp.sched=gpipe", schedule_of(s.pp, s.vpp, s.pp_sched) == "gpipe"))
           if v]
    if bad:
        raise AmspUserError(
            f"--to megatron: the plan {s} has {', '.join(bad)}, which Megatron does not run with "
            "pipeline stages: re-plan with --engine megatron")
    return ExportResult(target=TARGET, text=render(job, s), exact=True, closest=s, notes=(
        "the plan prices the busiest (last) stage; Megatron balances stages only by "
        "--decoder-first/last-pipeline-num-layers",))
