"""DeepSpeed: a plan as ``ds_config.json``, and a ``ds_config.json`` read back as a Strategy.

    amsp export plan.json --to deepspeed -o ds_config.json
    amsp compare --model llama-7b --gpus 64 --strategy-from ds_config.json

What DeepSpeed (0.19) can express, as points of the AMSP space (N GPUs):

=====  ==================  ==============================================================
stage  (s_P, s_G, s_OS)    extras
=====  ==================  ==============================================================
0      (1, 1, 1)           not with bf16 parameters and fp32 gradient accumulation
1      (1, 1, N)
2      (1, N, N)
3      (N, N, N)           zero_hpz_partition_size (hpZ, a divisor of the node size),
                           zero_quantized_weights (qwZ), zero_quantized_gradients (qgZ)
=====  ==================  ==============================================================

No partial factors (s < N) other than hpZ's secondary group: ``mics_shard_size`` is gone from
current DeepSpeed (it rejects the key), so a MiCS/HSDP plan exports as the best of the stages
above, with the difference priced; FSDP2 expresses it exactly (``--to fsdp2``).

Buffers: the config writes DeepSpeed's own defaults for its buffers (``buffers``), which the
memory model prices as DeepSpeed holds them (``cost/module_fetch.py``: stage 3 gathers per
module, prefetching up to ``stage3_prefetch_bucket_size`` elements within
``stage3_max_live_parameters``, keeping parameters reused within ``stage3_max_reuse_distance``
and those under ``stage3_param_persistence_threshold`` whole; one gradient bucket of
``reduce_bucket_size``) and the step model prices as it executes (``engines.py``).

Activation checkpointing: which blocks run under ``deepspeed.checkpointing.checkpoint`` is the
model code's choice, not a ds_config switch; the config's ``activation_checkpointing`` section
sets how that API works. The export writes it with ``number_checkpoints`` = the blocks the plan
checkpoints (the first K, or all L; DeepSpeed uses it to size contiguous checkpoint buffers)
and no partitioning or CPU offload of the checkpoints, and says in a note which blocks to wrap.
Op-level selective checkpointing has no DeepSpeed form: such a plan exports as the best of
none, full and K blocks, priced.

qwZ/qgZ: DeepSpeed picks its own quantization group size (thousands of elements); the planner
prices them with its default block of 256 elements, i.e. slightly more scale bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from amsp_planner.cost.job import Job
from amsp_planner.engines import PROFILES
from amsp_planner.errors import AmspUserError
from amsp_planner.exports import deepspeed_moe
from amsp_planner.exports.common import ExportResult, expressible, finish
from amsp_planner.strategy import Strategy, checkpointed_blocks, ckpt_fields

TARGET = "deepspeed"

WHY = {
    "s_P": "DeepSpeed shards parameters over all GPUs (stage 3) or not at all",
    "s_G": "DeepSpeed shards gradients over all GPUs (stage 2, 3) or not at all",
    "s_OS": "DeepSpeed shards optimizer states over all GPUs (stage 1-3) or not at all",
    "hpZ": "zero_hpz_partition_size exists only with stage 3",
    "qwz": "zero_quantized_weights exists only with stage 3",
    "qgz": "zero_quantized_gradients exists only with stage 3",
    "quantization": "DeepSpeed chooses its own quantization groups (priced at block 256)",
    "checkpointing": "DeepSpeed checkpoints whole blocks: it has no op-level selective policy",
    "tp": PROFILES["deepspeed"].tp_note,
    **deepspeed_moe.WHY,
}


# ----- plan -> ds_config ----------------------------------------------------------------------
def candidates(job: Job, plan: Strategy) -> list[Strategy]:
    """Every strategy the target runs exactly for this job (its engine profile,
    amsp_planner/engines.py), with the plan's micro-batch, accumulation and checkpointing."""
    return expressible(job.for_engine(TARGET), plan)


def stage_of(s: Strategy, num_gpus: int) -> int:
    """The ZeRO stage expressing `s` (which must be one of ``candidates``)."""
    n = num_gpus
    table = {(1, 1, 1): 0, (1, 1, n): 1, (1, n, n): 2, (n, n, n): 3}
    key = (s.s_p, s.s_g, s.s_os)
    if n == 1:
        return 0
    assert key in table, f"{s} is not a DeepSpeed stage for {n} GPUs"
    return table[key]


def buffers(job: Job, stage: int) -> dict[str, int]:
    """The zero_optimization buffer fields, in elements, the memory and step models price
    (module text): DeepSpeed's own defaults, as the deepspeed engine profile records them."""
    ex = PROFILES[TARGET].execution
    out = {"reduce_bucket_size": ex.reduce_bucket}
    if stage in (1, 2):
        out["allgather_bucket_size"] = ex.update_bucket
    if stage == 3:
        out.update(stage3_prefetch_bucket_size=ex.prefetch_bucket,
                   stage3_max_live_parameters=ex.max_live_params,
                   stage3_max_reuse_distance=ex.max_reuse_distance,
                   stage3_param_persistence_threshold=ex.persistence_threshold)
    return out


def config_dict(job: Job, s: Strategy) -> dict[str, Any]:
    """The ds_config for strategy `s` (one of ``candidates``) on `job`."""
    t = job.training
    n_micro = job.n_micro(s)
    stage = stage_of(s, job.num_gpus)
    if stage == 0 and not job.for_engine(TARGET).profile.stage0_allowed(job.training):
        stage = 1  # only at N = 1, where stage 1 shards over one GPU: the same strategy
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    zero.update(buffers(job, stage) if stage > 0 else {})
    if stage == 3:
        zero.update(zero_hpz_partition_size=s.hpz, zero_quantized_weights=s.qwz,
                    zero_quantized_gradients=s.qgz)
    if t.optimizer_offload == "cpu":  # DeepSpeedZeroOffloadOptimizerConfig (cost/offload.py)
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    out = {
        "train_batch_size": t.batch_seqs,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": n_micro,
        "bf16": {"enabled": t.precision == "bf16"},
        "communication_data_type": t.grad_dtype_name,
        "data_types": {"grad_accum_dtype": t.grad_dtype_name},
        "zero_optimization": zero,
        **deepspeed_moe.fields(s, job.num_gpus),
    }
    k, _ = checkpointed_blocks(s.ckpt_value, job.model.num_layers)
    if k:
        out["activation_checkpointing"] = {
            "partition_activations": False, "cpu_checkpointing": False,
            "contiguous_memory_optimization": False, "number_checkpoints": k,
            "synchronize_checkpoint_boundary": False, "profile": False}
    return out


def render(job: Job, s: Strategy) -> str:
    return json.dumps(config_dict(job, s), indent=2) + "\n"


def export(job: Job, strategy: Strategy, memory_limit: float | None = None) -> ExportResult:
    """The plan as a ds_config (or the closest one DeepSpeed can express)."""
    def notes(s: Strategy) -> list[str]:
        out = ["train_batch_size assumes every GPU is a data-parallel rank (no tensor or "
               "pipeline parallelism)"]
        k, _ = checkpointed_blocks(s.ckpt_value, job.model.num_layers)
        if k:
            which = "each block" if s.ckpt else f"the first {k} of the {job.model.num_layers} blocks"
            out.append("activation checkpointing is not a ds_config switch: wrap "
                       f"{which} with deepspeed.checkpointing.checkpoint (or "
                       "torch.utils.checkpoint)")
        if s.qwz or s.qgz:
            out.append(WHY["quantization"])
        out += deepspeed_moe.notes(s)
        p = strategy
        if 1 < p.s_p == p.s_g == p.s_os < job.num_gpus and not s == p:
            out.append(f"this MiCS/HSDP plan (shard groups of {p.s_p}) is exact with --to fsdp2 "
                       f"(mesh {job.num_gpus // p.s_p} x {p.s_p}); DeepSpeed no longer has "
                       "mics_shard_size")
        return out

    return finish(TARGET, job, strategy, memory_limit, render, WHY, notes)


def parse_with_deepspeed(config: dict[str, Any], num_gpus: int) -> dict[str, Any]:
    """Parse `config` with DeepSpeed's own classes; return what DeepSpeed understood (the
    expert-parallel keys too: exports/deepspeed_moe.py).

    ``DeepSpeedZeroConfig`` (pydantic, extra fields forbidden) parses the zero section;
    ``DeepSpeedConfig`` parses the whole file in this one process, where its data-parallel world
    size is 1, so it gets the file without ``train_batch_size`` (DeepSpeed then derives it as
    micro-batch x accumulation x 1); the N-GPU batch identity DeepSpeed asserts,
    train_batch_size = micro-batch x accumulation x world size, is checked here with N.
    Raises whatever DeepSpeed raises; needs the ``interop`` extra.
    """
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
    per_rank = {k: v for k, v in config.items() if k != "train_batch_size"}
    ds = DeepSpeedConfig(per_rank)
    mb, ga = ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps
    if "train_batch_size" in config and config["train_batch_size"] != mb * ga * num_gpus:
        raise ValueError(f"train_batch_size {config['train_batch_size']} != {mb} x {ga} x "
                         f"{num_gpus}")
    experts = (deepspeed_moe.parse_with_deepspeed(config, num_gpus, ds.zero_optimization_stage)
               if "expert_parallel" in config else {})
    return {
        **experts,
        "stage": int(ds.zero_optimization_stage),
        "hpz": zero.zero_hpz_partition_size,
        "qwz": zero.zero_quantized_weights,
        "qgz": zero.zero_quantized_gradients,
        "micro_batch": mb,
        "grad_accum": ga,
        "bf16": ds.bfloat16_config.enabled,
        "grad_accum_dtype": ds.grad_accum_dtype,
        "buffers": {k: getattr(zero, attr) for k, attr in _BUFFER_ATTRS.items()
                    if k in config.get("zero_optimization", {})},
    }


_BUFFER_ATTRS = {"reduce_bucket_size": "reduce_bucket_size",
                 "allgather_bucket_size": "allgather_bucket_size",
                 "stage3_prefetch_bucket_size": "prefetch_bucket_size",
                 "stage3_max_live_parameters": "max_live_parameters",
                 "stage3_max_reuse_distance": "max_reuse_distance",
                 "stage3_param_persistence_threshold": "param_persistence_threshold"}
"""ds_config buffer field -> the DeepSpeedZeroConfig attribute it sets."""


# ----- ds_config -> strategy ------------------------------------------------------------------
_REMOVED = {
    "mics_shard_size": "DeepSpeed removed MiCS; price it with --strategy mics-P (p=P,g=P,os=P)",
    "mics_hierarchical_params_gather": "DeepSpeed removed MiCS; drop this key",
}


def _load(source: str | Path | dict) -> tuple[dict, str]:
    if isinstance(source, dict):
        return source, "ds_config"
    path = Path(source)
    name = str(path)
    from amsp_planner.textfile import load

    data = load(path, "json", f"--strategy-from {name}", "give a DeepSpeed JSON config")
    if not isinstance(data, dict):
        raise AmspUserError(f"{name}: expected a JSON object at the top level, got "
                            f"{type(data).__name__}: write a ds_config object")
    return data, name


def _int_field(cfg: dict, key: str, where: str, lo: int = 1, prefix: str = "") -> int | None:
    """An integer field, None when absent or "auto" (the Hugging Face Trainer's placeholder)."""
    value = cfg.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise AmspUserError(f"{where}: field '{prefix}{key}' must be an integer >= {lo}, got "
                            f"{value!r}: fix it")
    return value


def _bool_field(cfg: dict, key: str, where: str) -> bool:
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise AmspUserError(f"{where}: field 'zero_optimization.{key}' must be true or false, "
                            f"got {value!r}: fix it")
    return value


def _batch(cfg: dict, n: int, where: str, default_mb: int) -> tuple[int, int | None]:
    """(micro-batch, accumulation or None) by DeepSpeed's rules for N data-parallel ranks."""
    tb = _int_field(cfg, "train_batch_size", where)
    mb = _int_field(cfg, "train_micro_batch_size_per_gpu", where)
    ga = _int_field(cfg, "gradient_accumulation_steps", where)

    def need(total: int, per: int, field: str) -> int:
        if total % per:
            raise AmspUserError(
                f"{where}: field 'train_batch_size' {tb} is not a multiple of {per} "
                f"({field} on {n} GPUs): fix the batch fields or check --gpus"
            )
        return total // per

    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * n:
            raise AmspUserError(
                f"{where}: field 'train_batch_size' {tb} != micro-batch {mb} x accumulation {ga} "
                f"x {n} GPUs = {mb * ga * n}: fix one of them or check --gpus"
            )
        return mb, ga
    if tb is not None and mb is not None:
        return mb, need(tb, mb * n, f"micro-batch {mb}")
    if tb is not None and ga is not None:
        return need(tb, ga * n, f"accumulation {ga}"), ga
    if tb is not None:
        return need(tb, n, "one sequence"), 1
    if mb is not None:
        return mb, ga if ga is not None else 1
    return default_mb, ga


def strategy_from_ds_config(source: str | Path | dict, num_gpus: int, gpus_per_node: int, *,
                            micro_batch: int = 1, ckpt: bool | int | str = False) -> Strategy:
    """Read a DeepSpeed config (path or dict) as the Strategy it runs on N GPUs.

    Stage 0/1/2/3 map to (1,1,1), (1,1,N), (1,N,N), (N,N,N); with stage 3,
    ``zero_hpz_partition_size``, ``zero_quantized_weights`` and ``zero_quantized_gradients`` map
    to hpz, qwz and qgz (DeepSpeed ignores them below stage 3, and so does this reader).
    Micro-batch and accumulation follow DeepSpeed's batch rules; absent or "auto" batch fields
    fall back to `micro_batch` and an accumulation derived from the job's global batch.
    Precision and gradient dtype come from the job's options, not from the file. Activation
    checkpointing is not a ds_config switch: `ckpt` says whether the model does it.
    Raises AmspUserError naming the field for anything it cannot price.
    """
    cfg, where = _load(source)
    n, r = num_gpus, gpus_per_node
    zero = cfg.get("zero_optimization", {})
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        raise AmspUserError(f"{where}: field 'zero_optimization' must be an object like "
                            "{\"stage\": 3}, got " f"{zero!r}: fix it")
    for key, fix in _REMOVED.items():
        if key in zero:
            v = zero[key]
            if key == "mics_shard_size" and type(v) is int and 1 < v <= n and n % v == 0:
                fix = (f"DeepSpeed removed MiCS; price it with --strategy mics-{v} "
                       f"(p={v},g={v},os={v}), which FSDP2 runs as HSDP")
            elif key == "mics_shard_size" and type(v) is int and v > 1:
                fix = (f"DeepSpeed removed MiCS, and a shard group of {v} does not divide "
                       f"the {n} GPUs; price MiCS with --strategy mics-P, P a divisor of {n}")
            raise AmspUserError(f"{where}: field 'zero_optimization.{key}': {fix}")
    for key in ("offload_optimizer", "offload_param"):
        dev = zero.get(key)
        device = dev.get("device", "none") if isinstance(dev, dict) else dev
        if device not in (None, "none"):
            fix = ("remove it and pass --offload-optimizer to price the optimizer on the CPU"
                   if key == "offload_optimizer" and device == "cpu" else
                   "this offload is not in the cost model: remove it to price the on-GPU "
                   "strategy")
            raise AmspUserError(f"{where}: field 'zero_optimization.{key}': {fix}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise AmspUserError(f"{where}: field 'zero_optimization.stage' is {stage!r}, not a ZeRO "
                            "stage: use 0, 1, 2 or 3")
    mb, ga = _batch(cfg, n, where, micro_batch)
    s = Strategy(micro_batch=mb, grad_accum=ga, **ckpt_fields(ckpt))
    if n == 1 or stage == 0:
        return s
    if stage == 1:
        return s.with_(s_os=n)
    if stage == 2:
        return s.with_(s_g=n, s_os=n)
    hpz = _int_field(zero, "zero_hpz_partition_size", where, lo=0,
                     prefix="zero_optimization.") or 1
    if hpz > 1:
        field = f"{where}: field 'zero_optimization.zero_hpz_partition_size'"
        if n % hpz:
            raise AmspUserError(f"{field} {hpz} does not divide the {n} GPUs: use a divisor of "
                                f"the node size {r}")
        if hpz >= n:
            hpz = 1  # the secondary group is the primary one: no hpZ
        elif r % hpz:
            raise AmspUserError(f"{field} {hpz} does not divide the node size {r} (hpZ keeps "
                                f"its copy inside a node): use a divisor of {r}")
    s = s.with_(s_p=n, s_g=n, s_os=n, hpz=hpz,
                qwz=_bool_field(zero, "zero_quantized_weights", where),
                qgz=_bool_field(zero, "zero_quantized_gradients", where))
    try:
        s.check(n, r)
    except ValueError as e:
        raise AmspUserError(f"{where}: {e}") from None
    return s


def strategy_for_job(source: str | Path | dict, job: Job) -> Strategy:
    """`--strategy-from`: the ds_config's strategy, checked against the job's global batch.

    Uses the job's micro-batch (else 1) when the file leaves it open, and the job's activation
    checkpointing (a ds_config cannot say). A batch mismatch names the ds_config fields.
    """
    t = job.training
    s = strategy_from_ds_config(source, job.num_gpus, job.gpus_per_node,
                                micro_batch=t.micro_batch or 1,
                                ckpt=t.activation_checkpointing or False)
    where = "ds_config" if isinstance(source, dict) else str(source)
    per_step = s.micro_batch * (s.grad_accum or 1) * job.num_gpus
    if s.grad_accum is not None and per_step != t.batch_seqs:
        raise AmspUserError(
            f"{where}: train_micro_batch_size_per_gpu {s.micro_batch} x "
            f"gradient_accumulation_steps {s.grad_accum} x {job.num_gpus} GPUs = {per_step} "
            f"sequences per step, but the job's global batch is {t.batch_seqs}: pass "
            f"--global-batch-seqs {per_step} or fix the config"
        )
    job.check(s)
    return s
