"""Engine profiles: what each training engine executes exactly, and how it behaves there.

``amsp plan --engine E`` searches only the strategies engine E runs as written (its profile's
``shapes`` and ZeRO++ switches, through ``SearchSpace.for_job``) and prices them with E's
behaviour (``training_for``: the gradient-reduction dtype E uses), so the plan, its prediction
and ``amsp export --to E`` agree. The exports (``amsp_planner/exports``) list the strategies a
target expresses from the same profile, so a plan made for E always exports to E exactly.

Shapes of (s_P, s_G, s_OS) on N GPUs, s over the factors AMSP allows (``factor_options``):

========  =========================================  ==========================================
shapes    (s_P, s_G, s_OS)                            engine
========  =========================================  ==========================================
any       every nested p | g | os                    amsp (the bundled runtime)
stages    (1,1,1), (1,1,N), (1,N,N), (N,N,N)         DeepSpeed ZeRO stages 0-3
tied      (s, s, s)                                  FSDP2 / HSDP mesh (N/s, s); torchtitan
zero1     (1, 1, s) or (s, s, s)                     InternEvo zero1.size = s, zero1.fsdp
os        (1, 1, s)                                  Megatron-Core: DDP (s = 1) or the
                                                     distributed optimizer over N/s instances
zero3     (N, N, N)                                  a past DeepSpeed release, stage 3 only
                                                     (engine_versions.py)
========  =========================================  ==========================================

Tensor (+ sequence) parallelism inside the node (``tp``): amsp (``amsp train``, runtime/tp.py;
it refuses a vocabulary, MLP width or sequence length the degree does not divide), FSDP2 (``parallelize_module`` on a 2-D mesh, then
``fully_shard``) and torchtitan (``parallelism.tensor_parallel_degree``). DeepSpeed's AutoTP
training (``tensor_parallel.autotp_size``, deepspeed >= 0.16.4) shards the linear layers
without sequence parallelism and only with ZeRO stages 0-2, so it does not run the TP + SP
plans this model prices: its profile keeps tp = 1 (``tp_note`` says why). InternEvo runs
Megatron tensor parallelism with sequence parallelism as ``parallel.tensor = dict(size=T,
mode="msp")``, and Megatron-Core as ``--tensor-model-parallel-size T --sequence-parallel``.

Past releases (``engine_versions.py``, keys ``<engine>@<version>`` in ``PROFILES``, listed in
``VERSIONED``) price published runs made with them; ``--engine`` offers ``ENGINES`` only.

Nothing here imports torch, DeepSpeed or the cost model; ``cost/job.py`` reads the profiles.
"""

from __future__ import annotations

import dataclasses

from amsp_planner.engine_execution import (  # noqa: F401 - also this module's API
    Execution,
    execution_differences,
)
from amsp_planner.engine_profile import EngineProfile  # noqa: F401 - also this module's API
from amsp_planner.errors import AmspUserError

ENGINES = ("amsp", "deepspeed", "fsdp2", "torchtitan", "internevo", "megatron")
DEFAULT_ENGINE = "amsp"

REDUCE_HOST_US = 10.5
"""DeepSpeed's host time per (rank, tensor) of a stage-3 gradient reduce-scatter (fitted by
bench/fit_reduce_host.py to the published ZeRO-3 runs of GPT-3 175B at 128-1,024 GPUs of
DeepSpeed 0.6.2, a release that runs that function; docs/cost-model.md)."""

_FSDP2_SOURCES = (
    ("gather_grouping", "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: one "
     "FSDPParamGroup (one all-gather, one reduce-scatter) per fully_shard module"),
    ("prefetch_depth", "torch/distributed/fsdp/_fully_shard/_fsdp_state.py: implicit prefetch "
     "of the next module's all-gather (set_modules_to_forward_prefetch for more)"),
    ("sync_overlap", "_fsdp_param_group.py: reduce_scatter_stream / all_reduce_stream, "
     "overlapped with the next module's backward"),
)

PROFILES = {
    "amsp": EngineProfile(
        name="amsp", title="amsp train", shapes="any", hpz=True, qwz=True, qgz=True,
        qgz_needs_p=False, reduce_dtype=None,
        gathers="one all-gather per unit (embedding, block, head), prefetched one unit ahead; "
                "two gather and two gradient buffers of the largest unit",
        checkpointing="the first K of L blocks (ckpt=K, ckpt for all), op-level (ckpt=op) or "
                      "each MoE layer's MLP part (ckpt=moe)",
        sources=("amsp_planner/runtime/engine.py", "docs/runtime.md",
                 "amsp_planner/runtime/model.py (checkpoint(..., use_reentrant=False): "
                 "ckpt_early_stop)"),
        ckpt_kinds=frozenset({"none", "full", "blocks", "op", "moe"}), ckpt_early_stop=True,
        tp=True, tp_note="Megatron-style tensor + sequence parallelism in runtime/tp.py, with "
                         "every ZeRO factor combination and ZeRO++ (docs/runtime.md)",
    ),
    "deepspeed": EngineProfile(
        name="deepspeed", title="DeepSpeed 0.19", shapes="stages", hpz=True, qwz=True, qgz=True,
        qgz_needs_p=True, reduce_dtype=None, expert_rule="stages", optimizer_offload=True,
        gathers="stage 3 fetches parameters per module and prefetches up to "
                "stage3_prefetch_bucket_size elements within stage3_max_live_parameters, the "
                "compute waiting for each gather (measured at scale: docs/cost-model.md); the "
                "export writes DeepSpeed's defaults, which the memory model replays module by "
                "module (cost/module_fetch.py)",
        checkpointing="activation_checkpointing section (number_checkpoints: the first K "
                      "blocks, or all); the model wraps the blocks "
                      "(deepspeed.checkpointing.checkpoint); no op-level policy",
        ckpt_kinds=frozenset({"none", "full", "blocks"}),
        tp_note="AutoTP training (tensor_parallel.autotp_size, deepspeed >= 0.16.4; "
                "https://www.deepspeed.ai/tutorials/autotp-training) shards the linear layers "
                "without sequence parallelism and with ZeRO stages 0-2 only, so it does not run a "
                "TP + SP plan: plan with --engine torchtitan or fsdp2 for tp > 1",
        sources=("https://www.deepspeed.ai/docs/config-json/ (stages, buckets, "
                 "communication_data_type, data_types.grad_accum_dtype)",
                 "deepspeed/runtime/zero/config.py (zero_hpz_partition_size, "
                 "zero_quantized_weights, zero_quantized_gradients)",
                 "deepspeed/runtime/zero/stage3.py (qgZ: all_to_all_quant_reduce; "
                 "stage_1_and_2.py has none)",
                 "deepspeed/runtime/config.py (rejects mics_shard_size: MiCS removed)",
                 "deepspeed/runtime/engine.py _do_optimizer_sanity_check (no ZeRO: bf16 parameters need "
                 "bf16 grad_accum_dtype)"),
        execution=Execution(
            gather_grouping="module", persistence_threshold=100_000, prefetch_bucket=50_000_000,
            max_live_params=1_000_000_000, max_reuse_distance=1_000_000_000,
            reduce_bucket=500_000_000, update_bucket=500_000_000, replicated_reduce="all_reduce",
            zero2_reduce="all_reduce", sync_overlap=False, replicated_overlap=True,
            prefetch_overlap=False, reduce_host_us=REDUCE_HOST_US,
            sources=(
                ("reduce_host_us", "deepspeed/runtime/comm/coalesced_collectives.py "
                 "reduce_scatter_coalesced (stage 3's gradient reduction): a Python loop over "
                 "world_sz x tensors slices every tensor into per-rank chunks and interleaves "
                 "them (with padding) for one torch.cat; the time per (rank, tensor) is fitted "
                 "to the published ZeRO-3 runs of 175B at 128-1,024 GPUs of DeepSpeed "
                 "0.6.2 (the DeepSpeed Azure blog; the function is in v0.6.0 on: "
                 "bench/fit_reduce_host.py, docs/cost-model.md); the "
                 "function itself, run with 9 tensors and a stub for the collective, took "
                 "45 us more per (rank, tensor) from 256 to 1,024 ranks on a shared 2-core "
                 "development machine"),
                ("prefetch_overlap", "measured, not read: partitioned_param_coordinator.py "
                 "fetch_sub_module issues the next module's all-gather on its own stream "
                 "before the current module's compute, but a profile of stage 3 (DeepSpeed "
                 "issue #1069, 2021-06-29: 'the kernel operations in default stream are not "
                 "starting until the allgathers have completed') and the published ZeRO-3 runs "
                 "of DeepSpeed 0.6.2 at 128-1,024 GPUs (the Azure blog: fitted within a median "
                 "of 3.6 % with the gathers waited for, docs/cost-model.md) say the compute "
                 "waits for each"),
                ("gather_grouping", "deepspeed/runtime/zero/partitioned_param_coordinator.py "
                 "fetch_sub_module: the parameters of each submodule fetched on its pre-forward/"
                 "pre-backward hook, the next ones prefetched together (__all_gather_params)"),
                ("persistence_threshold", "deepspeed/runtime/zero/config.py "
                 "param_persistence_threshold (stage3_param_persistence_threshold) = 1e5"),
                ("prefetch_bucket", "deepspeed/runtime/zero/config.py prefetch_bucket_size "
                 "(stage3_prefetch_bucket_size) = 5e7"),
                ("max_live_params", "deepspeed/runtime/zero/config.py max_live_parameters "
                 "(stage3_max_live_parameters) = 1e9; partitioned_param_coordinator.py "
                 "fetch_sub_module prefetches min(max_live_parameters - n_available_params, "
                 "prefetch_bucket_size) elements after fetching a module: none while the "
                 "module just fetched holds 1e9 or more"),
                ("max_reuse_distance", "deepspeed/runtime/zero/config.py max_reuse_distance "
                 "(stage3_max_reuse_distance) = 1e9; partitioned_param_coordinator.py "
                 "__params_to_release: after a module's forward or backward its parameters are "
                 "freed unless the modules that run next, within max_reuse_distance elements "
                 "of the trace, use them again; with checkpointing a block's recomputed "
                 "modules whose backward lies further on are gathered again for it"),
                ("reduce_bucket", "deepspeed/runtime/zero/config.py reduce_bucket_size = 5e8"),
                ("update_bucket", "deepspeed/runtime/zero/config.py allgather_bucket_size = 5e8"),
                ("replicated_reduce", "deepspeed/runtime/zero/config.py "
                 "use_multi_rank_bucket_allreduce = True; stage_1_and_2.py average_tensor: the "
                 "bucket is all-reduced (allreduce_and_scatter), each rank keeps its partition"),
                ("zero2_reduce", "deepspeed/runtime/zero/stage_1_and_2.py (0.19.8) average_tensor: "
                 "with use_multi_rank_bucket_allreduce (config.py default True) every slice of "
                 "the IPG bucket goes to the ('allreduce', group) bucket: allreduce_and_scatter "
                 "-> allreduce_bucket flattens up to reduce_bucket_size elements and "
                 "dist.all_reduce's them; allreduce_and_copy_with_multiple_ranks copies back "
                 "only the slices of the rank's own partition (not stage3.py's "
                 "reduce_scatter_coalesced: no per-rank interleave); on the reduction stream "
                 "with overlap_comm, which the export writes (exports/deepspeed.py): overlapped "
                 "with backward"),
                ("sync_overlap", "deepspeed/runtime/engine.py (0.19.8) allreduce_gradients: "
                 "without ZeRO (stage 0) the gradients are all-reduced at the accumulation "
                 "boundary, after backward (buffered_allreduce_fallback): exposed"),
                ("replicated_overlap", "deepspeed/runtime/zero/stage_1_and_2.py (0.19.8): "
                 "with overlap_comm, which the export writes for stages 1-2 "
                 "(exports/deepspeed.py; config.py overlap_comm_valid would default it to "
                 "stage == 3), __init__ creates the gradient hooks (create_gradient_handling_"
                 "hooks), process_gradients calls reduce_ready_partitions_and_remove_grads, "
                 "which for stage 1 reduces on the accumulation-boundary micro-batch "
                 "(is_gradient_accumulation_boundary) through the same "
                 "reduce_independent_p_g_buckets_and_remove_grads -> average_tensor bucketed "
                 "all-reduce as stage 2, on the reduction stream: overlapped with the last "
                 "micro-batch's backward; reduce_gradients then only drains the last bucket "
                 "(overlapping_partition_gradients_reduce_epilogue)"),
                ("update_overlap", "deepspeed/runtime/zero/stage_1_and_2.py step: "
                 "all_gather_dp_groups of the updated partitions before step() returns")),
        ),
    ),
    "fsdp2": EngineProfile(
        name="fsdp2", title="FSDP2", shapes="tied", hpz=True, qwz=False, qgz=False,
        qgz_needs_p=False, reduce_dtype=None,
        gathers="one all-gather per fully_shard unit (each block, then the root), implicit "
                "prefetch one unit ahead: the memory model's two gather and two gradient buffers",
        checkpointing="checkpoint_wrapper on the chosen blocks, or a selective policy (op)",
        sources=("https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html "
                 "(mesh (replicate, shard), reshard_after_forward=int)",
                 "torch/distributed/fsdp/_fully_shard/_fsdp_api.py (MixedPrecisionPolicy."
                 "reduce_dtype: the export sets it to the plan's gradient dtype)",
                 "https://pytorch.org/docs/stable/distributed.tensor.parallel.html "
                 "(parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel)",
                 "torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py "
                 "(checkpoint_impl=CheckpointImpl.NO_REENTRANT by default, the export's "
                 "checkpoint_wrapper: ckpt_early_stop)"),
        ckpt_early_stop=True,
        tp=True, tp_note="parallelize_module on the 'tp' dimension of a 2-D mesh, then fully_shard "
                         "on the data-parallel dimension",
        master_params=True, expert_rule="tied",
        execution=Execution(sources=_FSDP2_SOURCES),
    ),
    "torchtitan": EngineProfile(
        name="torchtitan", title="torchtitan 0.3", shapes="tied", hpz=False, qwz=False,
        qgz=False, qgz_needs_p=False, reduce_dtype="fp32",
        gathers="FSDP2 under the hood: one all-gather per block, prefetch one ahead",
        checkpointing="activation_checkpoint.mode none, full or selective with "
                      "selective_ac_option op (its int option, every N-th block, is not "
                      "the first K of L)",
        ckpt_kinds=frozenset({"none", "full", "op"}),
        sources=("torchtitan/config/configs.py (mixed_precision_reduce: Literal['float32'], "
                 "fsdp_reshard_after_forward: default|always|never, "
                 "data_parallel_shard_degree / data_parallel_replicate_degree)",
                 "torchtitan/models/llama3/parallelize.py (reduce_dtype from "
                 "mixed_precision_reduce; apply_tp: ColwiseParallel/RowwiseParallel with "
                 "SequenceParallel norms)",
                 "torchtitan/distributed/activation_checkpoint.py at b5bcd76 (FullAC "
                 "passes early_stop=False to ptd_checkpoint_wrapper since 25413d224: "
                 "ckpt_early_stop off; torchtitan@0.1.0 before it)"),
        tp=True, tp_note="parallelism.tensor_parallel_degree, enable_async_tensor_parallel off",
        activation_profile="torchtitan", op_policy="alternate", master_params=True,
        expert_rule="titan",
        execution=Execution(sources=_FSDP2_SOURCES),
    ),
    "internevo": EngineProfile(
        name="internevo", title="InternEvo", shapes="zero1", hpz=False, qwz=False, qgz=False,
        qgz_needs_p=False, reduce_dtype="param", expert_rule="none",
        gathers="hybrid ZeRO optimizer: gradients reduced in reduce_bucket_size buckets, updated "
                "parameters broadcast/all-gathered after the step; priced per unit",
        checkpointing="model.checkpoint True/False or a fraction of the layers (K of L); no "
                      "op-level policy",
        ckpt_kinds=frozenset({"none", "full", "blocks"}),
        sources=("https://github.com/InternLM/InternEvo configs/7B_sft.py (parallel.zero1.size, "
                 "zero1.fsdp, model.checkpoint)",
                 "internlm/solver/optimizer/utils.py reduce_tensor (communicates in the "
                 "gradient's own dtype, the model dtype)"),
        tp=True, tp_note="parallel.tensor = dict(size=T, mode='msp'): Megatron tensor parallelism "
                         "with sequence parallelism over the T ranks (InternEvo configs/7B_sft.py: "
                         "mode in mtp, msp, fsp, isp; 'msp' = megatron tensor parallel with "
                         "sequence parallel, sequence parallel size = tensor parallel size)",
        activation_profile="fused",
        execution=Execution(
            reduce_bucket=512 * 1024 * 1024, update_collective="broadcast",
            replicated_reduce="all_reduce", sync_overlap=True,
            sources=(
                ("update_collective", "internlm/solver/optimizer/hybrid_zero_optim.py "
                 "broadcast_params: for each rank of the zero1 group, dist.broadcast of that "
                 "rank's flat fp16 shard (src = the rank)"),
                ("reduce_bucket", "https://github.com/InternLM/InternEvo configs/7B_sft.py "
                 "hybrid_zero_optimizer.reduce_bucket_size = 512 * 1024 * 1024"),
                ("replicated_reduce", "internlm/solver/optimizer/hybrid_zero_optim.py "
                 "_store_and_try_reduce_grads_by_bucket(reduce_rank=None) -> utils.py "
                 "reduce_tensor: 'if dst_rank is None, all-reduce is used'"),
                ("sync_overlap", "configs/7B_sft.py hybrid_zero_optimizer.overlap_sync_grad = "
                 "True (reduced in backward as buckets fill)"),
                ("update_overlap", "configs/7B_sft.py hybrid_zero_optimizer.overlap_sync_param "
                 "= False")),
        ),
    ),
    "megatron": EngineProfile(
        name="megatron", title="Megatron-Core", shapes="os", hpz=False, qwz=False, qgz=False,
        qgz_needs_p=False, reduce_dtype="fp32", expert_rule="os",
        gathers="parameters whole on every data-parallel rank (DDP, or the distributed optimizer: "
                "optimizer states sharded over the data-parallel ranks, gradients "
                "reduce-scattered and updated parameters all-gathered in buckets, once per step)",
        checkpointing="--recompute-granularity full --recompute-method block "
                      "--recompute-num-layers K (the first K of L blocks) or all; selective "
                      "recomputation recomputes attention's core only (not op-level); "
                      "--recompute-granularity selective --recompute-modules moe recomputes "
                      "each MoE layer (ckpt=moe)",
        ckpt_kinds=frozenset({"none", "full", "blocks", "moe"}),
        te_weight_cache=True, te_param_gather=True,
        sources=(
            "megatron/core/transformer/module.py set_is_first_microbatch (from "
            "pipeline_parallel/schedules.py forward_step) and extensions/transformer_engine.py "
            "TELinear.forward: te_weight_cache",
            "megatron/training/arguments.py --fp8-param-gather: te_param_gather",
            "megatron/core/distributed/distributed_data_parallel_config.py "
            "(use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather, bucket_size, "
            "grad_reduce_in_fp32)",
            "megatron/training/arguments.py (bf16: accumulate_allreduce_grads_in_fp32 = True; "
            "--num-distributed-optimizer-instances)",
            "https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/"
            "dist_optimizer.html"),
        tp=True, tp_note="--tensor-model-parallel-size T --sequence-parallel inside the node",
        execution=Execution(
            reduce_bucket=40_000_000, reduce_bucket_per_rank=1_000_000,
            update_bucket=40_000_000, sync_overlap=False,
            overlap_flags="--overlap-grad-reduce --overlap-param-gather",
            sources=(
                ("overlap_flags", "distributed_data_parallel_config.py overlap_grad_reduce "
                 "'overlap grad all-reduce / reduce-scatter with backward compute'; "
                 "megatron/core/optimizer/optimizer_config.py overlap_param_gather 'overlap "
                 "param all-gather with forward compute in distributed optimizer' (both False "
                 "by default, at f2e5db4 and now)"),
                ("reduce_bucket", "megatron/core/distributed/distributed_data_parallel_config.py "
                 "bucket_size: default max(40000000, 1000000 * dp_size) parameters"),
                ("reduce_bucket_per_rank", "the same: 1000000 * dp_size"),
                ("update_bucket", "megatron/core/distributed/param_and_grad_buffer.py: the "
                 "parameters are all-gathered per bucket of the same buffer"),
                ("sync_overlap", "distributed_data_parallel_config.py overlap_grad_reduce = "
                 "False (--overlap-grad-reduce is opt-in): the reduce-scatter runs after backward "
                 "(finish_grad_sync)"),
                ("update_overlap", "distributed_data_parallel_config.py overlap_param_gather = "
                 "False (--overlap-param-gather is opt-in)")),
        ),
    ),
}


_FSDP1 = "torch 2.13 torch/distributed/fsdp/"
PROFILES["fsdp"] = dataclasses.replace(
    PROFILES["fsdp2"], name="fsdp", title="FSDP1 (FullyShardedDataParallel)", tp=False,
    tp_note="the published FSDP1 rows run no tensor parallelism; plan with --engine fsdp2",
    gathers="one FlatParameter per FSDP unit (each block, then the root): one all-gather "
            "straight into its padded unsharded flat tensor, the parameters views of it; the "
            "next unit's all-gather in flight during the current unit's compute",
    sources=(f"{_FSDP1}fully_sharded_data_parallel.py (FullyShardedDataParallel: "
             "backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True, "
             "forward_prefetch=False by default)",
             f"{_FSDP1}_flat_param.py (FlatParamHandle.unshard, _all_gather_flat_param)",
             f"{_FSDP1}_runtime_utils.py (_pre_backward_hook, _post_backward_reshard, "
             "_prefetch_handle, _unshard's rate limiter)"),
    execution=Execution(
        gather_copy_out=False, backward_prefetch="pre",
        sources=(
            ("gather_grouping", f"{_FSDP1}_flat_param.py: one FlatParameter per wrapped "
             "module (FlatParamHandle), one all-gather per handle"),
            ("gather_copy_out", f"{_FSDP1}_flat_param.py FlatParamHandle.unshard -> "
             "_all_gather_flat_param: dist.all_gather_single(padded_unsharded_flat_param, "
             "sharded_flat_param) then _use_unsharded_views: the original parameters are "
             "views of the gathered tensor, nothing copied out (FSDP2: _fsdp_collectives.py "
             "foreach_all_gather_copy_out, split_with_sizes_copy into each parameter)"),
            ("backward_prefetch", f"{_FSDP1}fully_sharded_data_parallel.py: backward_prefetch "
             "defaults to BackwardPrefetch.BACKWARD_PRE (_runtime_utils.py _pre_backward_hook "
             "-> _prefetch_handle); BACKWARD_POST (Composer's default, composer/trainer/"
             "dist_strategy.py: fsdp_config.get('backward_prefetch', 'BACKWARD_POST')) issues "
             "it from _post_backward_reshard instead, before the unit's reduce-scatter: the "
             "same order on the process group's one NCCL stream (api.py BackwardPrefetch), "
             "priced alike"),
            ("prefetch_depth", f"{_FSDP1}_runtime_utils.py _unshard: with limit_all_gathers "
             "the CPU waits for the free event of the unit two back (_limiter_utils.py "
             "_FreeEventQueue, 2 all-gathers in flight); forward_prefetch off: the next "
             "forward all-gather is issued when the CPU, running ahead, reaches that unit"),
            ("sync_overlap", f"{_FSDP1}_runtime_utils.py _post_backward_hook: the "
             "reduce-scatter on _post_backward_stream, after the unit's gradient computation, "
             "overlapping the next unit's backward")),
    ),
)
PRICED_ONLY = ("fsdp",)
"""Profiles that price published rows of engines the planner does not offer (``--engine``
takes ``ENGINES``): FSDP1, which the published llm-foundry, IBM and FSDP-paper rows ran."""


def _versioned() -> dict[str, EngineProfile]:
    """The past releases' profiles (engine_versions.py): the current one with their fields."""
    from amsp_planner.engine_versions import VERSIONS

    out = {}
    for key, fields in VERSIONS.items():
        fields = dict(fields)
        out[key] = dataclasses.replace(PROFILES[fields.pop("base")], name=key, **fields)
    return out


PROFILES.update(_versioned())
VERSIONED = tuple(k for k in PROFILES if "@" in k)
"""Profiles of past releases, for pricing published runs (never a choice of --engine)."""


def runs_as(engine: str) -> str:
    """The engine whose code a profile key runs, for the rules keyed by engine (FP8 family,
    TP-overlap kind, context-parallel attention): a past release's ``base``
    (engine_versions.py: ``nemo@24.07`` runs Megatron-Core, ``megatron``), else the key."""
    from amsp_planner.engine_versions import VERSIONS

    return VERSIONS[engine]["base"] if engine in VERSIONS else engine


def profile(engine: str) -> EngineProfile:
    """The profile of an engine name; AmspUserError naming --engine and the choices."""
    try:
        return PROFILES[engine]
    except (KeyError, TypeError):
        raise AmspUserError(f"--engine {engine}: unknown engine: use one of "
                            f"{', '.join(ENGINES)}") from None
