"""The blocks' elementwise time follows the model's norm and position embedding.

Eager PyTorch, per token and block, forward (cost/compute.py docstring):
  RMSNorm (Llama's Python module): ~7 passes of h per norm, 2 x 14h
  LayerNorm (torch.nn.functional.layer_norm, one native kernel): read h, write h, 2 x 2h
  RoPE on q and k 6(h + d_kv); a model with learned positions rotates nothing
The published llm-foundry runs (MPT: LayerNorm, learned positions) check the result.
"""

from __future__ import annotations

import statistics

import pytest
from amsp_testlib import make_job, small_model

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.strategy import Strategy
from amsp_planner.validation import predict_rows


def _op_recompute_s(model) -> float:
    """Seconds that op-level checkpointing adds: the blocks' forward elementwise kernels."""
    job = make_job(16, model, cluster="dgx-a100-hdr")
    ev = evaluate(job, Strategy(micro_batch=2))
    op = evaluate(job, Strategy(micro_batch=2, ckpt_op=True))
    return op.time.compute_s - ev.time.compute_s, job.cluster.gpu.hbm_gbyte_per_s * 1e9


def test_layernorm_and_learned_positions_by_hand():
    # small_model: h 128, d_kv 128, f 256 (SwiGLU 5f), bf16 (2 bytes), seq 128 x micro-batch 2
    # = 256 tokens, 2 blocks. RMSNorm + RoPE: 28h + 6(h + d_kv) + 6h + 5f = 7,168 elements
    rope, hbm = _op_recompute_s(small_model())
    assert rope == pytest.approx(2 * 256 * 7_168 * 2 / hbm)
    # LayerNorm + learned positions: 4h + 6h + 5f = 2,560 elements
    learned, _ = _op_recompute_s(small_model(norm_type="layernorm",
                                             position_embedding="learned"))
    assert learned == pytest.approx(2 * 256 * 2_560 * 2 / hbm)
    # each change alone: LayerNorm saves 24h, learned positions 6(h + d_kv)
    ln, _ = _op_recompute_s(small_model(norm_type="layernorm"))
    assert ln == pytest.approx(2 * 256 * (7_168 - 24 * 128) * 2 / hbm)
    pos, _ = _op_recompute_s(small_model(position_embedding="learned"))
    assert pos == pytest.approx(2 * 256 * (7_168 - 6 * 256) * 2 / hbm)


def test_llm_foundry_rows_carry_no_bias_on_either_gpu():
    """MosaicML's MPT runs on A100 and H100: the signed median error of each GPU's rows within
    6 % (charged RMSNorm's passes and RoPE, the H100 rows were predicted 11 % slow)."""
    rows = [r for r in predict_rows() if r.source == "llm-foundry" and r.scope == "in"
            and r.metric != "memory" and r.predicted is not None]
    for gpu in ("mpt-a100-", "mpt-h100-"):
        errs = [r.error for r in rows if r.id.startswith(gpu)]
        assert len(errs) >= 20
        assert abs(statistics.median(errs)) < 0.06, (gpu, statistics.median(errs))
