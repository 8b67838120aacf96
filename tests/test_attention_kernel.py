"""The attention kernel of a job (cost/attention_kernel.py, presets/attention_kernels.yaml):
rates from the published statements, attention seconds by hand, the default unchanged."""

import pytest
import yaml

from amsp_planner.cost.attention_kernel import attention_fraction, kernel_table
from amsp_planner.cost.compute import block_compute
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.validation import ROWS_FILE


def test_rates_are_the_published_statements():
    t = kernel_table()
    # FlashAttention-2 abstract (arXiv 2307.08691): FlashAttention reaches 25-40 % of peak (A100)
    assert t["flash1"]["ampere"] == pytest.approx((0.25 + 0.40) / 2)
    # its FlashAttention-2 range halved ("around 2x"): 50-73 % / 2 lies around the same value
    assert 0.50 / 2 <= t["flash1"]["ampere"] <= 0.73 / 2
    # FlashAttention-3 abstract (arXiv 2407.08608): FlashAttention-2 at 35 % on H100, halved
    assert t["flash1"]["hopper"] == pytest.approx(0.35 / 2)
    # flash_attn_triton.py: "slightly slower" than the CUDA v1 overall, not quantified
    assert t["triton"] == t["flash1"]
    # FlashAttention-3 abstract: "1.5-2.0x" over FlashAttention-2's 35 % on H100 (the middle,
    # 1.75x), under its "up to ... 75% utilization"; Hopper only (wgmma/TMA)
    assert t["flash3"] == {"hopper": pytest.approx(0.35 * 1.75, abs=0.005)}
    assert 0.35 * 1.5 <= t["flash3"]["hopper"] <= min(0.35 * 2.0, 0.75)


def _job(cluster: str, kernel: str | None, seq: int = 4096):
    training = TrainingSpec(seq_len=seq, global_batch_seqs=64, attention_kernel=kernel)
    return Job.create(load_model("llama-7b"), load_cluster(cluster), training, 8)


@pytest.mark.parametrize("cluster, peak, fa2, kernel_rate", [
    ("dgx-a100-hdr", 312e12, 0.45, 0.325),   # A100 80GB: gpus.yaml's attention_fraction
    ("dgx-h100-ndr", 989e12, 0.32, 0.175),   # H100 SXM
])
def test_attention_seconds_by_hand(cluster, peak, fa2, kernel_rate):
    """llama-7b (32 heads x 128), s = 4096, one sequence: causal attention forward 2 t s h =
    2 x 4096^3 FLOP; backward 2.5x that; only the attention's rate differs between kernels."""
    flops = 2 * 4096 ** 3
    extra = flops / (peak * kernel_rate) - flops / (peak * fa2)
    fast = block_compute(_job(cluster, None), 1, False)
    slow = block_compute(_job(cluster, "triton"), 1, False)
    assert slow.forward - fast.forward == pytest.approx(extra, rel=1e-9)
    assert slow.backward - fast.backward == pytest.approx(2.5 * extra, rel=1e-9)
    # full checkpointing recomputes the forward: the attention forward once more
    fast_c, slow_c = (block_compute(_job(cluster, k), 1, True) for k in (None, "flash1"))
    assert slow_c.backward - fast_c.backward == pytest.approx(3.5 * extra, rel=1e-9)


def test_flash2_is_the_gpu_tables_rate_and_the_default():
    job = _job("dgx-a100-hdr", None)
    assert attention_fraction(job) == job.cluster.gpu.attention_fraction == 0.45
    assert attention_fraction(_job("dgx-a100-hdr", "flash2")) == 0.45


def test_the_default_stays_out_of_the_dump():
    assert "attention_kernel" not in TrainingSpec().model_dump()
    assert TrainingSpec(attention_kernel="triton").model_dump()["attention_kernel"] == "triton"


def test_a_generation_without_a_published_rate_is_refused():
    job = _job("dgx-a100-hdr", "triton")
    gpu = job.cluster.gpu.model_copy(update={"arch": "volta"})
    job = Job.create(job.model, job.cluster.model_copy(update={"gpu": gpu}), job.training, 8)
    with pytest.raises(AmspUserError, match="training.attention_kernel: triton has no published "
                                            "rate on volta"):
        block_compute(job, 1, False)


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="attention_kernel"):
        TrainingSpec(attention_kernel="xformers")


def test_only_rows_whose_source_states_the_kernel_set_it():
    """llm-foundry's benchmark script defaulted to attn_impl triton at the commits that published
    its tables; S. Bekman's benchmark.py (stas-h200) picks Hugging Face's flash_attention_3 on
    Hopper (its H200 rows) and flash_attention_4 on Blackwell (its B200 rows, out of scope:
    FlashAttention-4 has no rate); no other source states a kernel other than
    FlashAttention-2 / SDPA."""
    rows = yaml.safe_load(ROWS_FILE.read_text())["rows"]
    kernels = {(r["source"], r.get("training", {}).get("attention_kernel")) for r in rows}
    assert {k for s, k in kernels if s == "llm-foundry"} == {"triton"}
    stas = {(r["cluster"], r["training"].get("attention_kernel")) for r in rows
            if r["source"] == "stas-h200" and "training" in r}
    assert stas == {("dgx-h200-ndr", "flash3"), ("dgx-b200", None)}
    assert all("FlashAttention-4" in r["scope"] for r in rows
               if r["source"] == "stas-h200" and r.get("cluster", "dgx-b200") == "dgx-b200"
               and r["metric"] != "memory")
    assert {k for s, k in kernels if s not in ("llm-foundry", "stas-h200")} == {None}


def test_flash3_prices_the_h200_rows_attention_at_its_rate():
    """llama-7b at s = 4096 on H100: FlashAttention-3's attention forward by hand, and refused
    off Hopper (no published rate on Ampere)."""
    flops, peak = 2 * 4096 ** 3, 989e12
    fa2 = block_compute(_job("dgx-h100-ndr", None), 1, False)
    fa3 = block_compute(_job("dgx-h100-ndr", "flash3"), 1, False)
    assert fa2.forward - fa3.forward == pytest.approx(flops / (peak * 0.32)
                                                      - flops / (peak * 0.61), rel=1e-9)
    with pytest.raises(AmspUserError, match="flash3 has no published rate on ampere"):
        block_compute(_job("dgx-a100-hdr", "flash3"), 1, False)
