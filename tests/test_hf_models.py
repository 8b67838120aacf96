"""Hugging Face model folders and families: published sizes, and transformers' own modules."""

from __future__ import annotations

import json

import pytest

from amsp_planner.errors import AmspUserError
from amsp_planner.specs import load_model
from amsp_planner.specs.hf import FAMILIES
from amsp_planner.specs.hf_moe import MOE_FAMILIES

# Published configs (their config.json on the Hub) and published parameter counts (model cards;
# the Hub's safetensors total where the card rounds).
_BASE = {"hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 4096}
PUBLISHED = {
    "Qwen3-8B": (8.19e9, {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                          "num_hidden_layers": 36, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}),
    "Qwen3-0.6B": (0.596e9, {"model_type": "qwen3", "hidden_size": 1024,
                             "intermediate_size": 3072, "num_hidden_layers": 28,
                             "num_attention_heads": 16, "num_key_value_heads": 8,
                             "head_dim": 128, "vocab_size": 151936,
                             "tie_word_embeddings": True}),
    "Phi-3-mini-4k": (3.82e9, {"model_type": "phi3", "hidden_size": 3072,
                               "intermediate_size": 8192, "num_hidden_layers": 32,
                               "num_attention_heads": 32, "num_key_value_heads": 32,
                               "vocab_size": 32064}),
    "gemma-7b": (8.54e9, {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576,
                          "num_hidden_layers": 28, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000,
                          "hidden_activation": "gelu_pytorch_tanh",
                          "tie_word_embeddings": True}),
    "gemma-2-9b": (9.24e9, {"model_type": "gemma2", "hidden_size": 3584,
                            "intermediate_size": 14336, "num_hidden_layers": 42,
                            "num_attention_heads": 16, "num_key_value_heads": 8,
                            "head_dim": 256, "vocab_size": 256000,
                            "hidden_activation": "gelu_pytorch_tanh",
                            "tie_word_embeddings": True}),
    "gemma-3-1b": (1.0e9, {"model_type": "gemma3_text", "hidden_size": 1152,
                           "intermediate_size": 6912, "num_hidden_layers": 26,
                           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                           "vocab_size": 262144, "hidden_activation": "gelu_pytorch_tanh",
                           "tie_word_embeddings": True}),
    "OLMo-2-1124-7B": (7.30e9, {"model_type": "olmo2", "hidden_size": 4096,
                                "intermediate_size": 11008, "num_hidden_layers": 32,
                                "num_attention_heads": 32, "num_key_value_heads": 32,
                                "vocab_size": 100352}),
    "granite-3.0-8b": (8.17e9, {"model_type": "granite", "hidden_size": 4096,
                                "intermediate_size": 12800, "num_hidden_layers": 40,
                                "num_attention_heads": 32, "num_key_value_heads": 8,
                                "vocab_size": 49155, "tie_word_embeddings": True}),
    "Mistral-Nemo-12B": (12.2e9, {"model_type": "mistral", "hidden_size": 5120,
                                  "intermediate_size": 14336, "num_hidden_layers": 40,
                                  "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "head_dim": 128, "vocab_size": 131072}),
}


def _folder(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**_BASE, **cfg}))
    return d


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_family_counts_match_published_size(tmp_path, name):
    published, cfg = PUBLISHED[name]
    m = load_model(str(_folder(tmp_path, name, cfg)))
    assert m.num_params == pytest.approx(published, rel=0.006), m.num_params
    assert m.name == name  # named after its folder when _name_or_path is absent


def test_every_family_has_a_published_size():
    assert {cfg["model_type"] for _, cfg in PUBLISHED.values()} >= set(FAMILIES) - {
        "llama", "qwen2"} - set(MOE_FAMILIES)  # presets: test_specs.py, MoE: test_moe_models.py


def test_folder_and_its_config_json_are_the_same_model(tmp_path):
    d = _folder(tmp_path, "q", {**PUBLISHED["Qwen3-8B"][1], "_name_or_path": "Qwen/Qwen3-8B"})
    a, b = load_model(str(d)), load_model(str(d / "config.json"))
    assert a == b and a.name == "Qwen3-8B"


def test_head_dim_apart_changes_attention_flops_by_hand():
    from amsp_planner.specs.model import ModelSpec

    # gemma-7b's shapes: q width 16 * 256 = 4096 != hidden 3072
    m = ModelSpec(name="g", num_layers=1, hidden_size=3072, num_heads=16, head_dim=256,
                  ffn_hidden_size=8, vocab_size=2, ffn_type="geglu", tied_embeddings=True)
    attn = 3072 * 4096 * 3 + 4096 * 3072  # q, k, v (16 kv heads) and o
    assert m.block_params() == attn + 3 * 3072 * 8 + 2 * 3072
    assert m.flops_per_token(10) - 6 * m.num_flop_params == 12 * 1 * 4096 * 10


@pytest.mark.parametrize("change, needle", [
    ({"model_type": ["llama"]}, "'model_type' must be a string"),
    ({"model_type": {"a": 1}}, "'model_type' must be a string"),
    ({"model_type": "qwen3", "num_experts": 128}, "'qwen3' with experts is not supported"),
    ({"model_type": "gemma3", "text_config": {}}, "multimodal"),
    ({"model_type": "gpt_neox"}, "not supported"),
    ({"hidden_act": "relu"}, "hidden_act"),
])
def test_inexpressible_configs_are_refused_with_their_reason(tmp_path, change, needle):
    d = _folder(tmp_path, "m", {**PUBLISHED["Qwen3-8B"][1], **change})
    with pytest.raises(AmspUserError, match=needle):
        load_model(str(d))


# ----- against transformers' own modules ------------------------------------------------------
def _shrink(cfg: dict) -> dict:
    """The same family at a small size (the meta device allocates nothing, but keep it quick)."""
    small = {**_BASE, **cfg, "num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 96}
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    small["num_attention_heads"], small["num_key_value_heads"] = 4, 4 * kv // heads or 1
    small["hidden_size"] = 64
    small.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if "head_dim" in cfg:
        small["head_dim"] = 24  # apart from 64 / 4 = 16
    return small


VARIANTS = [(n, {}) for n in sorted(PUBLISHED)] + [
    ("Qwen3-8B", {"attention_bias": True}),
    ("granite-3.0-8b", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"model_type": "llama", "attention_bias": True, "mlp_bias": True,
               "num_attention_heads": 32, "num_key_value_heads": 8}),
    ("qwen2", {"model_type": "qwen2", "num_attention_heads": 32, "num_key_value_heads": 8,
               "tie_word_embeddings": True}),
]


@pytest.mark.parametrize("name, change", VARIANTS, ids=[f"{n}-{sorted(c)}" for n, c in VARIANTS])
def test_counts_equal_transformers_modules(tmp_path, name, change):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    base = PUBLISHED[name][1] if name in PUBLISHED else {}
    cfg = _shrink({**base, **change})
    spec = load_model(str(_folder(tmp_path, "m", cfg)))
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    numel = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert numel(model) == spec.num_params
    units = spec.unit_params()
    inner = model.model
    assert numel(inner.embed_tokens) == units[0]
    assert [numel(b) for b in inner.layers] == units[1:-1]
    lm = 0 if spec.tied_embeddings else numel(model.lm_head)
    assert numel(inner.norm) + lm == units[-1]
