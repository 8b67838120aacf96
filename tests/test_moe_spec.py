"""Mixture-of-experts model specs: parameter counts by class against published sizes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from amsp_planner.specs.model import ModelSpec

# Mixtral-8x7B's config.json on the Hub; the model card gives 46.7e9 parameters, 12.9e9 active.
MIXTRAL = dict(name="mixtral-8x7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
               ffn_hidden_size=14336, vocab_size=32000, num_experts=8, experts_per_token=2)


def test_mixtral_total_and_active_match_the_model_card():
    m = ModelSpec(**MIXTRAL)
    assert m.num_params == pytest.approx(46.7e9, rel=0.002)
    assert m.num_active_params == pytest.approx(12.9e9, rel=0.005)
    # hand count of one expert: SwiGLU gate, up, down of 4096 x 14336
    assert m.expert_params() == 3 * 4096 * 14336
    assert sum(m.unit_expert_params()) == 32 * 8 * 3 * 4096 * 14336


def test_dense_layers_keep_their_mlp_and_a_dense_model_is_unchanged():
    dense = ModelSpec(**{k: v for k, v in MIXTRAL.items()
                         if k not in ("num_experts", "experts_per_token")})
    m = ModelSpec(**MIXTRAL, dense_layers=(0, 1))
    assert m.num_moe_layers == 30
    assert m.unit_params()[1] == dense.block_params() and m.unit_expert_params()[1] == 0
    assert dense.num_active_params == dense.num_params
    assert "num_experts" not in dense.model_dump()


@pytest.mark.parametrize("bad, field", [
    (dict(experts_per_token=9), "experts_per_token"),
    (dict(experts_per_token=0), "experts_per_token"),
    (dict(dense_layers=(32,)), "dense_layers"),
    (dict(dense_layers=tuple(range(32))), "dense_layers"),
])
def test_bad_moe_fields_are_refused_by_name(bad, field):
    with pytest.raises(ValidationError, match=field):
        ModelSpec(**{**MIXTRAL, **bad})


def test_moe_fields_without_experts_are_refused():
    with pytest.raises(ValidationError, match="experts_per_token is set but num_experts is 0"):
        ModelSpec(**{**MIXTRAL, "num_experts": 0})
