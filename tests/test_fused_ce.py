"""Liger's fused linear cross-entropy (``cross_entropy: fused_linear``) and a whole-model load
under ZeRO-3 (``model_load: whole``): memory derived by hand for Llama-3-8B on one DGX H200
node, Liger's chunk size against the example in its own code, the published memory line of
the source that runs both, and where each is refused or left out."""

from __future__ import annotations

import pytest

from amsp_planner.cost.activations import (
    flce_chunk_tokens,
    head_bytes_per_token,
    loss_peak_bytes,
    saved_bytes,
)
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

GIB = 2**30
ZERO3 = Strategy(s_p=8, s_g=8, s_os=8, micro_batch=1, ckpt=True)
V, H = 128_256, 4096  # Llama-3-8B's vocabulary and hidden size


def job(seq=8192, ce="fused_linear", load="sharded", profile="fused", model="llama3-8b",
        offload="none"):
    t = TrainingSpec(seq_len=seq, global_batch_seqs=8, activation_profile=profile,
                     cross_entropy=ce, model_load=load, optimizer_offload=offload)
    return Job.create(load_model(model), load_cluster("dgx-h200-ndr"), t, 8, engine="deepspeed")


def test_chunk_size_is_ligers_own_example():
    # liger_kernel/ops/fused_linear_cross_entropy.py (v0.8.0): "BT = 4096*4, V = 32000,
    # H = 4096 ==> inc_factor = 8, chunk_size = 2048"
    j = job(seq=4096, model="llama-7b")  # V = 32,000, H = 4,096
    assert (j.model.vocab_size, j.model.hidden_size) == (32_000, 4096)
    assert flce_chunk_tokens(j, 4) == 2048
    # Llama-3: ceil(128256 / 4096) = 32; 8,192 tokens / 32 = 256 (a power of two already)
    assert flce_chunk_tokens(job(), 1) == 256
    assert flce_chunk_tokens(job(seq=10_000), 1) == 512  # ceil(10000 / 32) = 313 -> 512


@pytest.mark.parametrize("profile", ["fused", "eager", "torchtitan"])
def test_no_logits_are_kept_by_hand(profile):
    full, fused = job(ce="logits", profile=profile), job(profile=profile)
    # the 4 bytes per token and vocabulary entry (fp32 log-probabilities) leave the head;
    # the input's gradient (h x 2 bytes) replaces the head matmul's saved input: same size
    assert head_bytes_per_token(full) - head_bytes_per_token(fused) == 4 * V
    tokens = 8192
    # ... and the head weight's gradient, V x H in bf16, is saved once per micro-batch
    assert saved_bytes(full, 1, True) - saved_bytes(fused, 1, True) == pytest.approx(
        4 * V * tokens - 2 * V * H)
    # the loss peak: one chunk's logits and input gradient (256 tokens), not eager's 8V
    assert loss_peak_bytes(fused, 1) == 256 * (V + H) * 2
    if profile == "eager":
        assert loss_peak_bytes(full, 1) == 8 * V * tokens


def test_whole_model_load_sets_the_reserved_floor():
    # the source's job: the optimizer in host memory, so little is left on the GPU at 8K
    sharded = evaluate(job(offload="cpu"), ZERO3).memory
    whole = evaluate(job(load="whole", offload="cpu"), ZERO3).memory
    # DeepSpeed moves the unsharded bf16 model to the GPU before ZeRO-3 shards it
    assert whole.load_peak == pytest.approx(2 * 8_030_261_248, rel=1e-4)
    assert sharded.load_peak == 0 and sharded.reserved < whole.load_peak
    assert whole.reserved == whole.load_peak  # at 8K the load is the peak
    assert whole.allocated == sharded.allocated  # training itself allocates the same
    # unsharded parameters (ZeRO-2) hold the whole model anyway: nothing to add
    z2 = Strategy(s_p=1, s_g=8, s_os=8, micro_batch=1, ckpt=True)
    assert evaluate(job(load="whole"), z2).memory.load_peak == 0
    assert "load_peak" not in evaluate(job(), ZERO3).memory.to_dict()  # plans unchanged


def test_published_memory_line():
    """The source's own fit of its ZeRO-3 + offload + Liger runs (ml-engineering
    insights/when-to-upgrade-gpus): peak ~ 12.6 GiB + 0.00043 GiB per token, 8K to 256K
    tokens per GPU. The predicted slope is the per-token part the model derives."""
    def peak(seq):
        t = TrainingSpec(seq_len=seq, global_batch_seqs=8, activation_profile="fused",
                         cross_entropy="fused_linear", model_load="whole",
                         optimizer_offload="cpu", attention_kernel="flash3")
        j = Job.create(load_model("llama3-8b"), load_cluster("dgx-h200-ndr"), t, 8,
                       engine="deepspeed")
        return evaluate(j, ZERO3).memory.reserved / GIB

    slope = (peak(262_144) - peak(32_768)) / (262_144 - 32_768)
    assert slope == pytest.approx(0.00043, rel=0.05)
    # the published peaks (max_memory_reserved, worst rank), within the memory target (20 %)
    for seq, published in ((8192, 16.3), (32_768, 25.8), (131_072, 66.5), (262_144, 124.5)):
        assert peak(seq) == pytest.approx(published, rel=0.2)
    # with the logits kept (4V bytes per token more) the slope would be doubled
    assert 4 * V / GIB > 0.00043


def test_spec_and_cli():
    t = TrainingSpec(seq_len=4096)
    assert "cross_entropy" not in t.model_dump() and "model_load" not in t.model_dump()
    assert TrainingSpec(cross_entropy="fused_linear").model_dump()["cross_entropy"] == (
        "fused_linear")
    with pytest.raises(ValueError):
        TrainingSpec(cross_entropy="chunked")


def test_bundled_runtime_refuses_in_one_line():
    from amsp_planner.runtime.support import check_tp

    with pytest.raises(AmspUserError) as e:
        check_tp(ZERO3, job())
    assert "--cross-entropy logits" in str(e.value) and "\n" not in str(e.value)
    check_tp(ZERO3, job(ce="logits"))  # the default runs


def test_transformer_engine_loss_kernel_bytes_by_hand():
    """Megatron-Bridge runs the loss in Transformer Engine's Triton cross-entropy
    (``cross_entropy_fusion_impl 'te'``): forward, ``online_softmax_kernel`` reads the bf16
    logits, ``cross_entropy_kernel`` reads them again and writes the bf16 gradient; backward,
    ``element_mul_kernel`` reads and writes it. 3 + 2 passes of 2 bytes per logit, against
    the eager fp32 loss's 12 + 18 bytes; the head's matmul is the same."""
    from amsp_planner.cost.compute import _rates, head_compute
    from amsp_planner.engines import profile

    assert all(profile(f"megatron-bridge@{v}").fused_cross_entropy == "te"
               for v in ("0.2.0", "0.3.0", "0.3.1", "0.4.0", "0.4.1", "0.5.0"))
    assert profile("megatron").fused_cross_entropy == ""
    assert profile("nemo@24.07").fused_cross_entropy == ""  # Megatron-Core's own jit fusion

    def head(engine, tp=4):
        t = TrainingSpec(seq_len=8192, global_batch_seqs=64)
        j = Job.create(load_model("llama3-70b"), load_cluster("dgx-h100-ndr"), t, 64,
                       engine=engine)
        return j, head_compute(j, 1, tp)

    j, eager = head("megatron")
    _, te = head("megatron-bridge@0.4.0")
    logits = 8192 * 128_256 / 4  # one micro-batch's logits on one of 4 TP ranks
    hbm = _rates(j).hbm
    assert te.forward == pytest.approx(eager.forward - (12 - 3 * 2) * logits / hbm, rel=1e-9)
    assert te.backward == pytest.approx(eager.backward - (18 - 2 * 2) * logits / hbm, rel=1e-9)
    # about 2.6 ms of the 25 ms eager head per micro-batch on H100
    saved = (eager.forward + eager.backward) - (te.forward + te.backward)
    assert 1e-3 < saved < 5e-3
