"""Mixture-of-experts families: presets and Hugging Face imports against published sizes, and
against the modules transformers builds on the meta device from the same config."""

from __future__ import annotations

import pytest

from amsp_planner.specs import load_model

# preset: (published total, published active, active counted without the embedding?, source)
PRESETS = {
    # model card of Qwen/Qwen3-30B-A3B: "30.5B in total and 3.3B activated"
    "qwen3-30b-a3b": (30.5e9, 3.3e9, False),
    # model card of Qwen/Qwen3-235B-A22B: "235B in total and 22B activated"
    "qwen3-235b-a22b": (235e9, 22e9, False),
    # Mixtral of Experts, arXiv 2401.04088, section 2.1: 46.7B, 13B active (12.9B in the
    # release post mistral.ai/news/mixtral-of-experts)
    "mixtral-8x7b": (46.7e9, 12.9e9, False),
    # OLMoE, arXiv 2409.02060, table 1: 6.9B total, 1.3B active
    "olmoe-1b-7b": (6.9e9, 1.3e9, False),
    # Qwen2 technical report, arXiv 2407.10671, table 1: 57B total, 14B activated
    "qwen2-57b-a14b": (57.4e9, 14e9, False),
    # gpt-oss-120b model card, arXiv 2508.10925, table 1: 116.83B total, 5.13B active
    # ("active parameters": every parameter a token uses but the embedding)
    "gpt-oss-120b": (116.83e9, 5.13e9, True),
}


def _active(m, without_embedding: bool) -> int:
    return m.num_active_params - (m.embedding_params() if without_embedding else 0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_total_and_active_match_published(name):
    total, active, no_emb = PRESETS[name]
    m = load_model(name)
    # model cards round to 2-3 digits: 1 % on the total, 3 % on the active count (3.3 vs 3.35)
    assert m.num_params == pytest.approx(total, rel=0.01), m.num_params
    assert _active(m, no_emb) == pytest.approx(active, rel=0.03), m.num_active_params
    assert m.is_moe and m.num_active_params < m.num_params


def test_deepseek_v3_main_model_and_mtp_module_match_published():
    """DeepSeek-V3 technical report (arXiv 2412.19437), section 1 and 2.2: 671B parameters, 37B
    activated per token, in the main model; the Hub card: 685B "including 671B of the Main Model
    weights and 14B of the Multi-Token Prediction (MTP) Module weights", the MTP module storing
    its own copy of the shared embedding and head."""
    m = load_model("deepseek-v3")
    mtp = m.layer_params(m.num_layers - 1)
    assert m.is_mtp_layer(61) and not m.is_mtp_layer(60) and m.num_moe_layers == 59
    assert m.num_params - mtp == pytest.approx(671e9, rel=0.001)
    main_active = m.num_active_params - (mtp - (256 - 8) * m.expert_params())
    assert main_active == pytest.approx(37e9, rel=0.02)
    copies = 2 * m.vocab_size * m.hidden_size
    assert mtp + copies == pytest.approx(14e9, rel=0.05)
    assert m.num_params + copies == pytest.approx(685e9, rel=0.002)


def test_tiny_moe_preset_counted_by_hand():
    m = load_model("tiny-moe")
    h, v = 64, 256
    attn = h * (64 + 2 * 32) + 64 * h  # 4 query heads of 16, 2 key/value heads
    expert = 3 * h * 32  # SwiGLU gate, up, down of width 32
    layer = attn + 2 * h + h * 8 + 8 * expert  # norms, router h x 8, 8 experts
    assert m.unit_params() == [v * h] + [layer] * 4 + [h]  # tied: the head is the final norm
    assert m.num_active_params == m.num_params - 4 * 6 * expert
    assert m.unit_expert_params() == [0] + [8 * expert] * 4 + [0]
