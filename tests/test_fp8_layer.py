"""One Llama-style block, bf16 against FP8 (torchao tensorwise, torch.compile), derived by hand
on a GPU with round numbers: 1,000 TFLOP/s bf16 peak, matmuls at 0.5 of it, attention at 0.25,
1,000 GB/s for memory-bound kernels, no per-kernel overhead (docs/fp8.md, docs/cost-model.md).

Block: h = 4096, 32 heads of 128, 8 KV heads (d_kv = 1024), SwiGLU f = 16384; one sequence of
T = 4096 tokens. torchtitan's linears (K, N): wq (4096, 4096), wk, wv (4096, 1024),
wo (4096, 4096), w1, w3 (4096, 16384), w2 (16384, 4096):
  sum K N = 2 x 16,777,216 + 2 x 4,194,304 + 3 x 67,108,864 = 243,269,632
  sum K   = 6 x 4096 + 16384 = 40,960            sum N = 47,104

bf16, forward:
  matmuls    2 T sum(K N) / 5e14        = 2 x 4096 x 243,269,632 / 5e14 = 3.98573 ms
             (each compute-bound: wk's 68.7 us of FLOPs against 50 us of its bytes)
  attention  2 T s heads d / 2.5e14     = 2 x 4096^3 / 2.5e14            = 0.549756 ms
  elementwise, compiled: (2 x 4h + 2(h + d_kv) + 3f) x 2 B = 184,320 B per token
             x 4096 / 1e12                                               = 0.754975 ms
  backward: 2 x matmuls + 2.5 x attention + 2 x elementwise.

FP8: each linear's three GEMMs at 2 x 0.95 x the bf16 rate (9.5e14 FLOP/s), plus its casts at
1e12 B/s. Every FP8 GEMM is compute-bound but the input gradients of wk and wv, which read
1-byte operands and write a bf16 (T x 4096) output: 4096 x 1024 x 2 + 2 x 4096^2 = 41,943,040 B
= 41.943 us against 2 x 4096 x 1024 x 4096 / 9.5e14 = 36.168 us of FLOPs: +2 x 5.775 us.
torchao's compiled casts (torchao roofline_utils): input and output gradient 4 B per element
(amax fused into the producer, one kernel writing both layouts), weight 8 B (amax 2, two casts
of 3), plus two fp32 tensorwise scales per operand (24 B per linear):
  casts = 4 T sum K + 8 sum(K N) + 4 T sum N + 7 x 24
        = 671,088,640 + 1,946,157,056 + 771,751,936 + 168 = 3,388,997,800 B = 3.3890 ms
  FP8 - bf16 over forward + backward = 6 T sum(K N) (1/9.5e14 - 1/5e14) + casts + 11.550 us
        = -5.66398 ms + 3.38900 ms + 0.01155 ms = -2.26343 ms
"""

from __future__ import annotations

import json

import pytest

from amsp_planner.cost.compute import block_compute
from amsp_planner.cost.job import Job
from amsp_planner.specs import ModelSpec, TrainingSpec, load_cluster

ROUND_GPU = {"gpu.peak_bf16_tflop_per_s": 1000, "gpu.hbm_gbyte_per_s": 1000,
             "gpu.achievable_fraction": 0.5, "gpu.attention_fraction": 0.25,
             "gpu.kernel_overhead_us": 0}
MODEL = ModelSpec(name="block", num_layers=1, hidden_size=4096, num_heads=32, num_kv_heads=8,
                  ffn_hidden_size=16384, vocab_size=32768, max_seq_len=4096)


def _block(precision: str, compile_: bool = True):
    fp8 = {"fp8_recipe": "tensorwise"} if precision == "fp8" else {}
    t = TrainingSpec(seq_len=4096, global_batch_seqs=8, precision=precision, compile=compile_,
                     **fp8)
    job = Job.create(MODEL, load_cluster("dgx-h100-ndr", ROUND_GPU), t, 8, engine="torchtitan")
    return block_compute(job, 1, False)


def test_bf16_block_by_hand():
    u = _block("bf16")
    mm, attn, elem = 3.98573e-3, 0.549756e-3, 0.754975e-3
    assert u.forward == pytest.approx(mm + attn + elem, rel=1e-5)
    assert u.backward == pytest.approx(2 * mm + 2.5 * attn + 2 * elem, rel=1e-5)


def test_fp8_block_saves_the_hand_derived_time():
    bf16, fp8 = _block("bf16"), _block("fp8")
    saved = (bf16.forward + bf16.backward) - (fp8.forward + fp8.backward)
    assert saved == pytest.approx(2.26343e-3, rel=1e-4)
    total = 3 * 3.98573e-3 + 3.5 * 0.549756e-3 + 3 * 0.754975e-3
    assert (bf16.forward + bf16.backward) == pytest.approx(total, rel=1e-5)


def test_eager_casts_and_elementwise_cost_more():
    """Eager (no torch.compile): the elementwise kernels at their eager traffic and torchao's
    eager casts (amax pass 2 B + a cast kernel per layout 2 x 3 B = 8 B per element of x, W and
    dy; the weight's 8 B as compiled): the FP8 saving shrinks by (8 - 4) (T sum K + T sum N)
    = 4 x (167,772,160 + 192,937,984) = 1,442,840,576 B = 1.44284 ms."""
    eager = _block("bf16", False).forward + _block("bf16", False).backward \
        - _block("fp8", False).forward - _block("fp8", False).backward
    assert eager == pytest.approx(2.26343e-3 - 1.44284e-3, rel=1e-4)


def test_compile_option_reaches_the_plan_and_stays_out_by_default(tmp_path):
    from amsp_testlib import run_cli

    args = ["plan", "--model", "llama3-8b", "--gpus", "16", "--cluster", "dgx-h100-ndr",
            "--engine", "torchtitan", "--strategy", "zero3", "--micro-batch", "1"]
    docs = []
    for extra in ([], ["--compile"]):
        out = tmp_path / f"p{len(extra)}.json"
        code, _, err = run_cli([*args, *extra, "-o", str(out)])
        assert code == 0, err
        docs.append(json.loads(out.read_text()))
    assert "compile" not in docs[0]["inputs"]["training"]
    assert docs[1]["inputs"]["training"]["compile"] is True
    # compiled elementwise kernels move less memory: the same strategy runs faster
    assert docs[1]["predictions"]["tokens_per_s"] > docs[0]["predictions"]["tokens_per_s"]


def test_a_compiled_plan_exports_torchtitan_with_compile_on():
    from amsp_testlib import make_job

    from amsp_planner.exports.torchtitan import FP8_FLAGS, render
    from amsp_planner.strategy import parse_strategy_or_baseline

    for compile_, want in ((False, False), (True, True)):
        job = make_job(16, cluster="dgx-h100-ndr", compile=compile_)
        text = render(job, parse_strategy_or_baseline("zero3,mb=1", 16, 8))
        assert all(flag in text.split("\n") for flag in FP8_FLAGS) == want
