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
  a 175B model's blocks) are one prefetch each: overlapped as now.
- the rest as now: parameters fetched per module (``PartitionedParameterCoordinator``
  ``fetch_sub_module``), prefetched only while the parameters held stay under
  ``stage3_max_live_parameters`` 1e9 (``prefetch_next_sub_modules``:
  ``total_available_parameter_numel < max_available_parameters_in_numel``), parameters under
  ``stage3_param_persistence_threshold`` 1e5 kept whole (``persistent_parameters``).

Only stage 3 is profiled (``shapes`` 'zero3'): stages 1 and 2 of that release (stage1.py,
stage2.py) are other code, not read here.
"""

from __future__ import annotations

from amsp_planner.engine_execution import Execution

_DS_0_3_14 = "github.com/microsoft/DeepSpeed v0.3.14 (0cd9abf2)"

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
            sharded_reduce="all_reduce",
            sources=(
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
}
"""``<engine>@<version>`` -> the fields that differ from ``engines.PROFILES[base]``."""
