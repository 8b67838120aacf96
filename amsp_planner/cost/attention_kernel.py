"""The attention kernel a job runs, and the fraction of the GPU's peak its forward + backward
reaches.

``training.attention_kernel``: ``flash2`` (the default; every engine profile runs
FlashAttention-2 or PyTorch's SDPA flash kernel) prices attention at the GPU table's
``attention_fraction`` (presets/gpus.yaml). ``flash1`` (FlashAttention v1, CUDA), ``triton``
(flash-attn's experimental Triton FlashAttention, llm-foundry's ``attn_impl: triton``) and
``flash3`` (FlashAttention-3, Hopper only; transformers' ``flash_attention_3``) read
their rates per GPU generation from ``presets/attention_kernels.yaml``, where each value states
its published source and derivation. A generation with no published rate is refused.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from amsp_planner.errors import AmspUserError

KERNELS_FILE = Path(__file__).resolve().parent.parent / "presets" / "attention_kernels.yaml"
DEFAULT_KERNEL = "flash2"


@lru_cache(maxsize=1)
def kernel_table() -> dict[str, dict[str, float]]:
    import yaml

    return yaml.safe_load(KERNELS_FILE.read_text())["kernels"]


def attention_fraction(job) -> float:
    """Fraction of the job's GPU peak (its dtype) that the attention kernel reaches."""
    gpu = job.cluster.gpu
    kernel = job.training.attention_kernel or DEFAULT_KERNEL
    if kernel == DEFAULT_KERNEL:
        return gpu.attention_fraction or gpu.achievable_fraction
    rates = kernel_table()[kernel]
    if gpu.arch not in rates:
        raise AmspUserError(
            f"training.attention_kernel: {kernel} has no published rate on {gpu.arch} GPUs "
            f"({gpu.name}); use flash2, or run it on {' or '.join(sorted(rates))} GPUs")
    return rates[gpu.arch]
