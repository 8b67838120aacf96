"""Optimizer states offloaded to host memory (``TrainingSpec.optimizer_offload`` 'cpu'): what
DeepSpeed's ``zero_optimization.offload_optimizer {device: cpu}`` (ZeRO-Offload, Ren et al.,
arXiv 2101.06840) moves off the GPU and what it costs, read from DeepSpeed's code
(github.com/microsoft/DeepSpeed at 38327e07, deepspeed/runtime/zero/stage3.py; stage 2's
``cpu_offload`` in stage_1_and_2.py keeps the same states on the host).

Memory (cost/memory.py ``model_state_bytes``): the fp32 master and Adam's two moments (12 bytes
per element of the rank's optimizer shard) live in host memory; so does the reduced gradient
shard where gradients are sharded (s_G > 1: stage3.py allocates ``grad_partitions_flat_buffer``
on ``self.device``, the CPU when offloading). The 16-bit parameter shard and the buckets stay.

Time, per rank and step, on the shard of E = Phi / s_OS elements:

- during backward, on the reduction stream: stage3.py ``partition_grads`` copies each reduced
  gradient partition into the pinned host buffer (g_b bytes, device -> host), back to the GPU
  (``grad_buffer.to(device)``, g_b bytes host -> device) for the norm, and its fp32 cast to
  the fp32 gradient on the host (4 bytes, device -> host). Overlapped with the backward's
  compute (``overlap_comm``): not priced (``grad_copy_s`` says how long it is).
- after backward, exposed: the CPU Adam step (DeepSpeedCPUAdam, csrc/includes/cpu_adam.h:
  reads the fp32 master, gradient and both moments, writes master and moments: 28 bytes of host
  memory per element) and ``_reassign_or_swap_out_partitioned_parameters``: the fp32 master
  copied into the 16-bit parameter shard on the GPU (torch converts on the host for a
  cross-device copy, aten/src/ATen/native/cuda/Copy.cu: 4 + p_b bytes of host memory, then
  p_b bytes host -> device). One sub-group after another (``sub_group_size`` 1e9): the copy
  follows the step.

The node's ranks step at once and share its host memory: the CPU step takes
R x E x 32 bytes (p_b = 2) / (``host_mem_gbyte_per_s`` x ``CPU_ADAM_FRACTION``).
"""

from __future__ import annotations

from amsp_planner.errors import AmspUserError

ADAM_HOST_BYTES = 28
"""Host memory bytes per element of DeepSpeed's CPU Adam step: read the fp32 master, gradient,
exp_avg, exp_avg_sq (16), write the master and both moments (12) (csrc/includes/cpu_adam.h)."""

CPU_ADAM_FRACTION = 0.26
"""Fraction of the node's data-sheet host memory bandwidth that the ranks' CPU Adam steps and
the copy of the master into the 16-bit parameters reach together. CALIBRATED, one value: to
the published run stas-h200-8b-offload-8k (presets/validation.yaml; DGX H200, 8 ranks of
1.0e9 elements each, step 2.99 s measured against 1.22 s priced without the offload, its
attention priced as the FlashAttention-3 it ran: 0.28 while it was priced with
FlashAttention-2), the only row of its source where the optimizer's share of the step is
large; checked against
azure-1t-1024 (another host, another model, 1,024 GPUs; docs/validation.md). For scale:
DeepSpeed's launcher binds no cores by default, so 8 processes' OpenMP threads share the
sockets (deepspeed PR #7474: --bind_cores_to_rank gave 1.3x on a CPU Adam-bound step)."""


def offloaded(job) -> bool:
    return job.training.optimizer_offload == "cpu"


def check_cluster(cluster) -> None:
    """Offload needs the host link and the host memory bandwidth: refused in one line."""
    for field in ("host_link_gbyte_per_s", "host_mem_gbyte_per_s"):
        if getattr(cluster, field) is None:
            raise AmspUserError(
                f"--offload-optimizer: cluster {cluster.name} has no {field}: give it with "
                f"--set {field}=<GB/s> (docs/cost-model.md, \"Optimizer offload\")")


def host_step_time(job, elements: float) -> float:
    """Seconds, exposed, of the CPU step on a rank's `elements` optimizer elements and of the
    copy of the updated parameters to the GPU."""
    c, pb = job.cluster, job.training.param_bytes
    ranks = min(c.gpus_per_node, job.num_gpus)
    host = ranks * elements * (ADAM_HOST_BYTES + 4 + pb) / (
        c.host_mem_gbyte_per_s * 1e9 * CPU_ADAM_FRACTION)
    return host + elements * pb / (c.host_link_gbyte_per_s * 1e9)


def grad_copy_s(job, elements: float) -> float:
    """Seconds of the gradient copies during backward (overlapped, not in the step): the
    device -> host direction carries g_b + 4 bytes per element, the other g_b."""
    gb = job.training.grad_bytes
    return elements * (gb + 4) / (job.cluster.host_link_gbyte_per_s * 1e9)
