"""Engine profiles of past releases: how an engine executed at the version a published run used.

``engines.PROFILES`` holds each engine as its current release runs; a published measurement
made with an older release (``engine_version`` of a row of presets/validation.yaml) is priced
with that release's profile where one is here, under the key ``<engine>@<version>``. The
planner never offers these (``--engine`` takes ``engines.ENGINES``). Each entry overrides the
current profile's fields; every execution value carries its source in the release's code at
its tag (git commit named in ``sources``).

DeepSpeed 0.3.14 (tag v0.3.14, commit 0cd9abf20416c1fce091e7f79694f02fd21b3687, 2021-04-08:
the last release before arXiv 2104.04473 v1 of 2021-04-09, whose Table 2 measures ZeRO-3 on
Selene; ZeRO-3 first shipped in v0.3.13 of 2021-03-16). Every value below is the same at
v0.3.13, v0.3.16 and v0.4.0-v0.4.3 (stage 3's ``contiguous_gradients`` default turned True in
v0.4.4, 2021-07-29, which changes the gradient reduction). The paper publishes no DeepSpeed
configuration: the profile holds the release's defaults. What it changes against the current
profile, for ZeRO-3:

- gradients: stage 3 does not reduce-scatter them. ``contiguous_gradients`` defaults to False
  for stage 3, so ``reduce_ipg_grads`` takes ``buffered_reduce_fallback``: each bucket of
  ``reduce_bucket_size`` elements is flattened, all-reduced in the gradients' own dtype and
  copied back (``allreduce_and_copy``, ``allreduce_bucket``); every rank then keeps its slice.
- no per-rank interleave on the host: ``reduce_scatter_coalesced`` (the current profile's
  ``reduce_host_us``) first appears in v0.6.0 (deepspeed/runtime/comm/coalesced_collectives.py,
  added 2022-01-20).
- no ZeRO++ (hpZ, qwZ, qgZ: 2023) and no bf16 (fp16 only; ``fp32_allreduce`` is refused with
  ZeRO: engine.py ``assert not self.allreduce_always_fp32()``): gradients reduced in the
  parameters' dtype.
- one all-gather per parameter, never coalesced, each after a ``torch.cuda.synchronize()``
  (partition_parameters.py ``_allgather_param``): of the parameters one prefetch takes (up to
  ``stage3_prefetch_bucket_size`` 5e7 elements, ``get_params_to_prefetch``), every gather but
  the last waits for the one before it with nothing computing (``gather_grouping``
  'parameter', cost/schedule.py ``on_demand``). Modules of 5e7 elements or more (every one of
  a 175B model's blocks) are one prefetch each.
- the compute waits for every gather (``prefetch_overlap`` off, as the current profile: a
  profile of stage 3 of that code line, DeepSpeed issue #1069 of 2021-06-29, shows "the
  kernel operations in default stream are not starting until the allgathers have
  completed").
- host time per (rank, gathered parameter), with the compute waiting (``gather_host_us``):
  ``_allgather_param`` builds its output list in a Python loop over the ranks (a ``narrow``
  and a ``torch.distributed.get_rank`` each) and hands it to torch's list ``all_gather``,
  which in the PyTorch of the period gathers into a flat buffer and copies it out with one
  ``copy_`` per rank issued from the calling thread, all after a ``torch.cuda.synchronize()``.
  Fitted (bench/fit_reduce_host.py) to the 175B runs of arXiv 2104.04473 Table 2, its 530B
  runs held out: 42 us, several times what those calls take alone, so it stands in partly
  for what else slowed that stack (docs/cost-model.md).
- the rest as now: parameters fetched per module (``PartitionedParameterCoordinator``
  ``fetch_sub_module``), prefetched only while the parameters held stay under
  ``stage3_max_live_parameters`` 1e9 (``prefetch_next_sub_modules``:
  ``total_available_parameter_numel < max_available_parameters_in_numel``), parameters under
  ``stage3_param_persistence_threshold`` 1e5 kept whole (``persistent_parameters``).

Only stage 3 is profiled (``shapes`` 'zero3'): stages 1 and 2 of that release (stage1.py,
stage2.py) are other code, not read here.

NeMo 24.07 (``nemo@24.07``: the container of NVIDIA/NeMo docs/source/performance/
performance_summary.md at 9c5c5e9, the rows of source nemo-24.07). NeMo's LLM pre-training
runs Megatron-Core's GPT (``mcore_gpt: True``) with Transformer Engine, so the profile is the
megatron one (tensor + sequence parallelism, the 1F1B and interleaved pipeline schedules,
TP communication overlap through TE userbuffers, FP8 through TE: cost/fp8.py family 'te',
context parallelism through TE's K/V ring: cost/context_parallel.py kind 'p2p');
``engines.runs_as`` maps the key to megatron for those rules. What differs, read from the
training configs of NVIDIA/NeMo-Framework-Launcher at tag 24.07 (8325688d,
launcher_scripts/conf/training/{gpt3,llama,nemotron}/*.yaml and examples/training/*/h100/
*_fp8.sh) and NeMo's model code (branch r2.0.0rc1, db624485, the release of that container
[inf]):

- the data-parallel optimizer is Apex's DistributedFusedAdam (``optim.name:
  distributed_fused_adam``, NeMo's MegatronDistributedFusedAdam), not Megatron-Core's
  distributed optimizer: the same shape (Adam states sharded over the data-parallel ranks,
  with context parallelism the DP x CP ranks: distributed_adam.py takes
  ``get_data_parallel_group(with_context_parallel=True)``;
  gradients reduce-scattered, updated parameters all-gathered, in buckets: 'os'), the same
  schedule (megatron_gpt_model.py ``fwd_bwd_step`` hands the optimizer's ``no_sync``,
  ``reduce_overlap_gradients`` and ``sync_overlap_parameters`` to Megatron-Core's pipeline
  schedules as ``no_sync_func``, ``grad_sync_func``, ``param_sync_func``: the gradients are
  reduced during the last micro-batch's backward, the parameters gathered during the next
  forward), switched on by ``optim.overlap_grad_sync`` / ``overlap_param_sync`` (True in
  every 24.07 training config: rows ``dp_overlap: true``).
- the gradient-reduction dtype is a setting, ``optim.grad_sync_dtype``, not Megatron's
  forced fp32 (``reduce_dtype`` None: the row's ``grad_accum_dtype``): Apex's default is the
  optimizer dtype, fp32 (megatron_base_model.py ``setup_optimization``: ``dtype`` float32);
  the FP8 recipes of the release set ``+training.model.optim.grad_sync_dtype=bf16``
  (examples/training/gpt/h100/*_fp8*.sh, llama/h100/*_fp8.sh; not the nemotron ones).
- the elementwise kernels fused (``fused_elementwise``, priced as cost/compute.py prices a
  compiled block): Megatron-Core's Transformer Engine layer spec (``transformer_engine:
  True``: TE's LayerNormLinear / LayerNormMLP run the norms inside the linear modules) with
  the fusions every 24.07 training config switches on (``bias_activation_fusion``,
  ``bias_dropout_add_fusion``, ``persist_layer_norm``, ``masked_softmax_fusion`` for GPT-3;
  ``apply_rope_fusion: true`` for Llama and Nemotron; ``cross_entropy_loss_fusion: true``
  for Llama 3 and Nemotron). The megatron profile keeps eager pricing: there the same rule moves its
  rows both ways (docs/cost-model.md). What autograd saves follows the same kernels
  (``activation_profile`` 'fused': cost/activations.py's Megatron-Core with Transformer
  Engine).
- not priced (no published row measures them): the bucket size (``optim.bucket_cap_mb``
  400 / 220 / 125 / 100 MB per model; the profile keeps Megatron's bucket) and the master
  weights kept as 16-bit remainders of the bf16 parameters (``store_param_remainders``:
  2 bytes per parameter less optimizer memory than Megatron's fp32 copy).

Megatron-Bridge (``megatron-bridge@0.2.0``, ``@0.3.0``, ``@0.3.1``, ``@0.4.0``, ``@0.4.1``,
``@0.5.0``: the NeMo 25.11, 26.02, 26.02.01, 26.04, 26.04.01 and 26.06 containers' releases
[inf: the container of each section of Megatron-Bridge's docs/performance-summary-archive.md,
matched by date: each tag is the last one before the section was published], the rows of
source megatron-bridge; the Llama H100 configs named below read the same at every one of these
tags). Megatron-Core's own
distributed data parallelism and distributed optimizer (the megatron profile's schedule and
buckets; ``ddp.overlap_grad_reduce`` and ``overlap_param_gather`` True in the recipes:
src/megatron/bridge/recipes/llama/llama3.py ``_llama3_common``), with what the performance
scripts set (scripts/performance/configs/llama31/llama31_llm_pretrain.py and
llama3/llama3_llm_pretrain.py, utils/helpers.py at v0.2.0; configs/llama/ at v0.3.0-v0.5.0):

- the gradient-reduction dtype follows ``ddp.grad_reduce_in_fp32`` (False in every Llama
  performance config: bf16 buffers and reduction), not Megatron-LM's forced fp32
  (``reduce_dtype`` None: the row's ``grad_accum_dtype``);
- Transformer Engine's layer spec with ``apply_rope_fusion`` and ``cross_entropy_fusion_impl
  'te'`` (``set_common_perf_overrides``): ``fused_elementwise`` and the fused activation
  profile, as NeMo 24.07's; the loss in Transformer Engine's Triton cross-entropy
  (``fused_cross_entropy`` 'te': ``cross_entropy_loss_fusion`` True by default,
  src/megatron/bridge/models/gpt_provider.py, off only for PEFT fine-tuning and
  deterministic mode; ``cross_entropy_fusion_impl`` 'te' set by the Llama 3 recipes and the
  performance scripts' overrides at every tag from v0.2.0 to v0.5.0; cost/compute.py
  ``CE_BYTES``). NeMo 24.07's
  ``cross_entropy_loss_fusion`` is Megatron-Core's own jit-fused version, not priced as it
  (its kernel count is not read here): it keeps the eager bytes.
"""

from __future__ import annotations

from amsp_planner.engine_execution import Execution

_DS_0_3_14 = "github.com/microsoft/DeepSpeed v0.3.14 (0cd9abf2)"
GATHER_HOST_US_0_3_14 = 42.0
"""DeepSpeed 0.3.14's host time per (rank, gathered parameter) of a stage-3 all-gather
(fitted by bench/fit_reduce_host.py: module docstring)."""
_NEMO_LAUNCHER = "github.com/NVIDIA/NeMo-Framework-Launcher tag 24.07 (8325688d)"
_NEMO = "github.com/NVIDIA/NeMo branch r2.0.0rc1 (db624485)"
_BRIDGE = "github.com/NVIDIA-NeMo/Megatron-Bridge"


def _bridge(tag: str) -> dict:
    """Megatron-Bridge at `tag` (module docstring): the megatron profile with the gradient
    dtype a setting and the fused kernels."""
    return {
        "base": "megatron",
        "title": f"Megatron-Bridge {tag} (Megatron-Core)",
        "reduce_dtype": None,
        "fused_elementwise": True,
        "fused_cross_entropy": "te",
        "activation_profile": "fused",
        "sources": (
            f"{_BRIDGE} {tag} src/megatron/bridge/recipes/llama/llama3.py _llama3_common "
            "(DistributedDataParallelConfig: overlap_grad_reduce, overlap_param_gather, "
            "use_distributed_optimizer)",
            f"{_BRIDGE} {tag} scripts/performance/configs (set_llama3_common_configs, "
            "set_llama31_common_configs: ddp.grad_reduce_in_fp32 = False; "
            "set_common_perf_overrides: apply_rope_fusion, cross_entropy_fusion_impl 'te')"),
    }

VERSIONS: dict[str, dict] = {
    "deepspeed@0.3.14": {
        "base": "deepspeed",
        "title": "DeepSpeed 0.3.14",
        "shapes": "zero3",
        "hpz": False, "qwz": False, "qgz": False,
        "reduce_dtype": "param",
        "gathers": "stage 3 fetches each module's parameters on its hooks, one all-gather per "
                   "parameter (torch's list all_gather), the next module's prefetched while "
                   "fewer than stage3_max_live_parameters are held",
        "sources": (
            f"{_DS_0_3_14} deepspeed/runtime/zero/constants.py (defaults)",
            f"{_DS_0_3_14} deepspeed/runtime/zero/stage3.py (reduce_ipg_grads, "
            "buffered_reduce_fallback, PartitionedParameterCoordinator)",
            f"{_DS_0_3_14} deepspeed/runtime/engine.py (ZeRO refuses fp32_allreduce)",
        ),
        "execution": Execution(
            gather_grouping="parameter", persistence_threshold=100_000,
            prefetch_bucket=50_000_000,
            max_live_params=1_000_000_000, reduce_bucket=500_000_000,
            sharded_reduce="all_reduce", prefetch_overlap=False,
            gather_host_us=GATHER_HOST_US_0_3_14,
            sources=(
                ("prefetch_overlap", f"{_DS_0_3_14} stage3.py fetch_sub_module issues the "
                 "prefetch on comm_stream, but a profile of stage 3 of that code line "
                 "(DeepSpeed issue #1069, 2021-06-29) shows 'the kernel operations in default "
                 "stream are not starting until the allgathers have completed'"),
                ("gather_host_us", f"{_DS_0_3_14} partition_parameters.py _allgather_param "
                 "(torch.cuda.synchronize(), then a Python loop over world_size building the "
                 "output list for torch.distributed.all_gather, whose tensor-list form copies "
                 "the gathered buffer out rank by rank); fitted to arXiv 2104.04473 Table 2's "
                 "175B runs (bench/fit_reduce_host.py)"),
                ("gather_grouping", f"{_DS_0_3_14} stage3.py PartitionedParameterCoordinator."
                 "fetch_sub_module (the submodule's own parameters) and "
                 "prefetch_next_sub_modules (the next ones in the recorded trace, "
                 "PrefetchCoordinator.get_params_to_prefetch: until they reach the prefetch "
                 "bucket); partition_parameters.py _all_gather -> _allgather_param: one "
                 "torch.distributed.all_gather per parameter, each after "
                 "torch.cuda.synchronize()"),
                ("persistence_threshold", f"{_DS_0_3_14} constants.py "
                 "ZERO_OPTIMIZATION_PARAM_PERSISTENCE_THRESHOLD_DEFAULT = 100000"),
                ("prefetch_bucket", f"{_DS_0_3_14} constants.py "
                 "ZERO_OPTIMIZATION_PREFETCH_BUCKET_SIZE_DEFAULT = 50000000"),
                ("max_live_params", f"{_DS_0_3_14} constants.py "
                 "ZERO_OPTIMIZATION_MAX_LIVE_PARAMETERS_DEFAULT = 1000000000; stage3.py "
                 "prefetch_next_sub_modules prefetches only while total_available_parameter_"
                 "numel < max_available_parameters_in_numel"),
                ("reduce_bucket", f"{_DS_0_3_14} constants.py "
                 "ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT = 500000000"),
                ("sharded_reduce", f"{_DS_0_3_14} constants.py "
                 "ZERO3_OPTIMIZATION_CONTIGUOUS_GRADIENTS_DEFAULT = False; stage3.py "
                 "reduce_ipg_grads -> buffered_reduce_fallback -> allreduce_and_copy: the "
                 "bucket flattened, dist.all_reduce, copied back")),
        ),
    },
    "nemo@24.07": {
        "base": "megatron",
        "title": "NeMo 24.07 (Megatron-Core)",
        "reduce_dtype": None,
        "fused_elementwise": True,
        "activation_profile": "fused",
        "gathers": "Apex DistributedFusedAdam (optim.name distributed_fused_adam): optimizer "
                   "states sharded over the data-parallel ranks, gradients reduce-scattered and "
                   "updated parameters all-gathered in buckets, once per step",
        "sources": (
            f"{_NEMO_LAUNCHER} launcher_scripts/conf/training/gpt3/*.yaml, llama/*.yaml, "
            "nemotron/*.yaml (mcore_gpt, transformer_engine, optim: distributed_fused_adam, "
            "overlap_grad_sync, overlap_param_sync, bucket_cap_mb)",
            f"{_NEMO_LAUNCHER} examples/training/*/h100/*_fp8.sh "
            "(+training.model.optim.grad_sync_dtype=bf16)",
            f"{_NEMO} nemo/collections/nlp/models/language_modeling/megatron_gpt_model.py "
            "fwd_bwd_step (no_sync_func, grad_sync_func, param_sync_func into Megatron-Core's "
            "schedules)",
            f"{_NEMO} nemo/collections/nlp/models/language_modeling/megatron_base_model.py "
            "setup_optimization (optimizer dtype float32, param_sync_dtype the model dtype)",
            f"{_NEMO_LAUNCHER} launcher_scripts/conf/training/*.yaml (fused_elementwise: "
            "transformer_engine, bias_activation_fusion, bias_dropout_add_fusion, "
            "persist_layer_norm, apply_rope_fusion, cross_entropy_loss_fusion)"),
        "execution": Execution(
            reduce_bucket=40_000_000, reduce_bucket_per_rank=1_000_000,
            update_bucket=40_000_000, sync_overlap=False,
            overlap_flags="optim.overlap_grad_sync optim.overlap_param_sync",
            sources=(
                ("overlap_flags", f"{_NEMO} megatron_gpt_model.py fwd_bwd_step: with "
                 "distributed_fused_adam the optimizer's no_sync / reduce_overlap_gradients / "
                 "sync_overlap_parameters become Megatron-Core's no_sync_func / grad_sync_func "
                 "/ param_sync_func; on in every 24.07 training config "
                 f"({_NEMO_LAUNCHER} launcher_scripts/conf/training/*: overlap_grad_sync "
                 "True, overlap_param_sync true)"),
                ("reduce_bucket", "not NeMo's (optim.bucket_cap_mb, 100-400 MB per model): "
                 "Megatron-Core's default bucket kept, no published row measures the size"),
                ("reduce_bucket_per_rank", "the same"),
                ("update_bucket", "the same buffer's buckets (Apex contiguous_param_buffer)"),
                ("sync_overlap", "off unless optim.overlap_grad_sync (the opt-in above)"),
                ("update_overlap", "off unless optim.overlap_param_sync (the opt-in above)")),
        ),
    },
    "megatron-bridge@0.2.0": _bridge("v0.2.0"),
    "megatron-bridge@0.3.0": _bridge("v0.3.0"),
    "megatron-bridge@0.3.1": _bridge("v0.3.1"),
    "megatron-bridge@0.4.0": _bridge("v0.4.0"),
    "megatron-bridge@0.4.1": _bridge("v0.4.1"),
    "megatron-bridge@0.5.0": _bridge("v0.5.0"),
    # Full checkpointing with torch's non-reentrant checkpoint stops recomputing once the
    # block's saved tensors are back (EngineProfile.ckpt_early_stop, torch >= 2.1).
    "torchtitan@0.1.0": {
        "base": "torchtitan",
        "title": "torchtitan 0.1 (and the commits before it)",
        "ckpt_early_stop": True,
        "sources": (
            "github.com/pytorch/torchtitan v0.1.0 (2025-06-17) "
            "torchtitan/models/llama3/infra/parallelize.py _apply_ac_to_transformer_block: "
            "ptd_checkpoint_wrapper(module, preserve_rng_state=False), torch's early stop on "
            "by default; 25413d224 (2025-08-29) passes early_stop=False, v0.2.0 on",),
    },
    "fsdp@1.13.1": {
        "base": "fsdp",
        "title": "FSDP1, torch 1.13.1",
        "ckpt_early_stop": False,
        "sources": ("pytorch/pytorch PR 96866 (2023-03-22): early stop made the default of "
                    "the non-reentrant checkpoint, first released in torch 2.1",),
    },
    "fsdp@2.0.0": {
        "base": "fsdp",
        "title": "FSDP1, torch 2.0",
        "ckpt_early_stop": False,
        "sources": ("pytorch/pytorch PR 96866 (2023-03-22, after torch 2.0 of 2023-03-15): "
                    "no early stop in torch 2.0",),
    },
}
"""``<engine>@<version>`` -> the fields that differ from ``engines.PROFILES[base]``."""

# NeMo 24.03.01 (source nemo-long-seq): the same stack as 24.07. NeMo-Framework-Launcher at tag
# 24.03.01 (launcher_scripts/conf/training/llama/llama2_7b.yaml) against 24.07: mcore_gpt,
# transformer_engine, distributed_fused_adam with overlap_grad_sync / overlap_param_sync, the
# rope, softmax and layer-norm fusions alike; only bias_dropout_add_fusion differs (false;
# Llama has neither bias nor dropout, so an add the fused pricing already counts).
# examples/training/llama/h100/llama2_7b_fp8.sh at 24.03.01: fp8_hybrid and
# +training.model.optim.grad_sync_dtype=bf16, as in 24.07.
VERSIONS["nemo@24.03.01"] = {
    **VERSIONS["nemo@24.07"],
    "title": "NeMo 24.03.01 (Megatron-Core)",
    "sources": ("github.com/NVIDIA/NeMo-Framework-Launcher tag 24.03.01 launcher_scripts/conf/"
                "training/llama/llama2_7b.yaml and examples/training/llama/h100/"
                "llama2_7b_fp8.sh: the settings of nemo@24.07 (git diff 24.03.01 24.07: "
                "bias_dropout_add_fusion false -> true only)",
                *VERSIONS["nemo@24.07"]["sources"]),
}

# NeMo 24.12 (source dgxc-benchmarking): NVIDIA/dgxc-benchmarking at 8f5cbb37 (v25.02) runs
# nvcr.io/nvidia/nemo:24.12 with its own NeMo-Launcher-style configs (llama3.1/llama3.1_*.yaml,
# nemo_megatron/gpt3_175b_hydra.yaml, nemotron/nemotron4-15b-synth.yaml) through
# examples/nlp/language_modeling/megatron_gpt_pretraining.py: mcore_gpt, transformer_engine,
# optim distributed_fused_adam with overlap_grad_sync / overlap_param_sync and grad_sync_dtype
# bf16 (the 15B: mcore_distributed_optim [inf: priced as the same sharded optimizer]), the
# fusions of 24.07; FP8 runs add fp8, fp8_hybrid and +model.fp8_params (configure.sh): the rows'
# fp8_all_gather on. The settings the nemo@24.07 profile reads are those of these configs.
VERSIONS["nemo@24.12"] = {
    **VERSIONS["nemo@24.07"],
    "title": "NeMo 24.12 (Megatron-Core)",
    "sources": ("github.com/NVIDIA/dgxc-benchmarking 8f5cbb37 (v25.02): llama3.1/*.yaml, "
                "nemo_megatron/gpt3_175b_hydra.yaml, nemotron/nemotron4-15b-synth.yaml and "
                "each configure.sh (the container nvcr.io/nvidia/nemo:24.12, setup.sh): the "
                "settings of nemo@24.07",
                *VERSIONS["nemo@24.07"]["sources"]),
}
