"""Specs: parameter counts against published sizes, HF config.json, validation and loaders."""

from __future__ import annotations

import json

import pytest
from amsp_testlib import small_model
from pydantic import ValidationError

from amsp_planner.errors import AmspUserError
from amsp_planner.specs import (
    ClusterSpec,
    ModelSpec,
    TrainingSpec,
    list_presets,
    load_cluster,
    load_model,
    parse_batch,
)
from amsp_planner.strategy import Strategy

# Published parameter counts (papers / model cards), and the preset that models each.
PUBLISHED = {
    "llama-7b": 6.74e9,  # LLaMA, arXiv 2302.13971, table 2
    "llama-13b": 13.0e9,
    "llama-30b": 32.5e9,  # released as "30B"
    "llama-65b": 65.2e9,
    "llama2-70b": 68.98e9,  # Llama 2, arXiv 2307.09288 (model card: 68,976,648,192)
    "llama3-8b": 8.03e9,  # Llama 3 model card
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,  # Llama 3.1, arXiv 2407.21783
    "mistral-7b": 7.24e9,  # Mistral 7B model card
    "qwen2.5-72b": 72.7e9,  # Qwen2.5, arXiv 2412.15115
    "gpt3-175b": 175e9,  # GPT-3, arXiv 2005.14165
}


@pytest.mark.parametrize("name, published", sorted(PUBLISHED.items()))
def test_preset_parameter_count_matches_published_size(name, published):
    n = load_model(name).num_params
    assert abs(n - published) / published < 0.005, (name, n)


def test_every_model_preset_is_checked_or_is_the_test_model():
    from test_moe_models import PRESETS as MOE  # the MoE presets, against their model cards

    moe = set(MOE) | {"deepseek-v3"}  # checked by test_deepseek_v3_main_model_and_mtp_...
    assert set(list_presets("model")) == set(PUBLISHED) | moe | {"tiny", "tiny-moe"}


def test_small_model_counted_by_hand():
    m = small_model()
    # See small_model's docstring for the derivation.
    assert m.unit_params() == [65_536, 164_096, 164_096, 65_664]
    assert m.num_params == 65_536 + 2 * 164_096 + 65_664
    # Tied: the head keeps only the final norm (h); the matrix is counted once, as the LM head.
    tied = small_model(tied_embeddings=True)
    assert tied.unit_params() == [65_536, 164_096, 164_096, 128]
    assert tied.num_flop_params == tied.num_params == 65_536 + 2 * 164_096 + 128
    # Untied: the input embedding is a lookup, not a matmul.
    assert m.num_flop_params == m.num_params - 65_536
    # GQA with 2 KV heads of dim 32: QKV h*(h + 2*64) + out h*h = 128*256 + 16384 = 49,152
    gqa = small_model(num_kv_heads=2)
    assert gqa.block_params() == 49_152 + 98_304 + 256


def test_gpt_style_counts_biases_layernorm_and_positions():
    # h=64, a=4, GELU f=256, V=100, learned positions S=32, LayerNorm, biases everywhere, tied.
    m = ModelSpec(name="g", num_layers=1, hidden_size=64, num_heads=4, ffn_hidden_size=256,
                  ffn_type="gelu", vocab_size=100, tied_embeddings=True, max_seq_len=32,
                  norm_type="layernorm", position_embedding="learned", attention_bias="all",
                  mlp_bias=True)
    # embedding: V*h + S*h = 6400 + 2048
    assert m.embedding_params() == 8_448
    # block: QKV 64*192 + bias 192, out 64*64 + bias 64, fc1 64*256 + 256, fc2 256*64 + 64,
    #        two LayerNorms 2*(2*64)
    assert m.block_params() == 12_288 + 192 + 4_096 + 64 + 16_384 + 256 + 16_384 + 64 + 256
    # head: final LayerNorm only (tied)
    assert m.head_params() == 128


def test_flops_per_token_is_palm_formula_on_published_llama_7b():
    m = load_model("llama-7b")
    # 6 * (matmul params = all but the 32000 x 4096 input embedding) + 12 * L * h * s
    expected = 6 * (m.num_params - 32_000 * 4_096) + 12 * 32 * 4_096 * 2_048
    assert m.flops_per_token(2_048) == pytest.approx(expected)
    # Sanity against the usual "6N": attention adds 12*32*4096*2048 / (6*6.6e9) ~ 8%.
    assert 1.05 < m.flops_per_token(2048) / (6 * 6.6e9) < 1.12


# ----- Hugging Face config.json ---------------------------------------------------------------
LLAMA_7B_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "vocab_size": 32000, "torch_dtype": "float16",
}
QWEN25_72B_HF = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 8192, "intermediate_size": 29568, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 80, "max_position_embeddings": 32768,
    "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0,
}
MIXTRAL_HF = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def _write(tmp_path, cfg, name="config.json"):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text(json.dumps(cfg))
    return str(p)


@pytest.mark.parametrize("cfg, preset", [(LLAMA_7B_HF, "llama-7b"), (QWEN25_72B_HF, "qwen2.5-72b")])
def test_hf_config_counts_like_the_preset(tmp_path, cfg, preset):
    m = load_model(_write(tmp_path, cfg))
    assert m.num_params == load_model(preset).num_params
    assert m.unit_params() == load_model(preset).unit_params()


def test_hf_moe_config_counts_like_the_preset(tmp_path):
    m = load_model(_write(tmp_path, MIXTRAL_HF))  # more families: tests/test_moe_models.py
    assert m.unit_params() == load_model("mixtral-8x7b").unit_params()
    assert m.unit_expert_params() == load_model("mixtral-8x7b").unit_expert_params()
    with pytest.raises(AmspUserError, match="'num_local_experts' = 8: model_type 'llama' with "
                                            "experts is not supported"):
        load_model(_write(tmp_path, {**LLAMA_7B_HF, "num_local_experts": 8}, "llama.json"))


@pytest.mark.parametrize("key", ["num_hidden_layers", "hidden_size", "num_attention_heads",
                                 "intermediate_size", "vocab_size"])
def test_hf_config_missing_key_names_it(tmp_path, key):
    cfg = {k: v for k, v in LLAMA_7B_HF.items() if k != key}
    with pytest.raises(AmspUserError, match=f"'{key}' is missing"):
        load_model(_write(tmp_path, cfg, f"no-{key}.json"))


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"hidden_act": ["silu"]}, "hidden_act"),
    ({"num_hidden_layers": [32]}, "num_hidden_layers"),
])
def test_hf_config_unsupported_shapes_are_refused(tmp_path, change, needle):
    with pytest.raises(AmspUserError, match=needle):
        load_model(_write(tmp_path, {**LLAMA_7B_HF, **change}, "odd.json"))


# ----- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("change, field", [
    ({"num_heads": 5}, "num_heads"),  # 128 % 5
    ({"num_kv_heads": 3}, "num_kv_heads"),  # 4 % 3
    ({"num_kv_heads": 8}, "num_kv_heads"),  # more KV heads than query heads
    ({"num_layers": 0}, "num_layers"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"ffn_type": "relu"}, "ffn_type"),
    ({"colour": "red"}, "colour"),
])
def test_model_spec_rejects_bad_fields(change, field):
    with pytest.raises(ValidationError, match=field):
        small_model(**change)


def test_training_spec_batch_rules():
    assert TrainingSpec().batch_tokens == 4 * 2**20
    assert TrainingSpec(seq_len=2048).batch_seqs == 2048
    with pytest.raises(ValidationError, match="not a multiple of seq_len"):
        TrainingSpec(seq_len=4096, global_batch_tokens=5000)
    with pytest.raises(ValidationError, match="not both"):
        TrainingSpec(global_batch_seqs=8, global_batch_tokens=8 * 4096)
    with pytest.raises(ValidationError, match="default global batch"):
        TrainingSpec(seq_len=3000)
    t = TrainingSpec(global_batch_seqs=96)
    assert Strategy(micro_batch=1).n_micro(t.batch_seqs, 32) == 3
    with pytest.raises(ValueError, match="multiple of 64"):
        Strategy(micro_batch=2).n_micro(t.batch_seqs, 32)


@pytest.mark.parametrize("text, value", [("4M", 4 * 2**20), ("512K", 512 * 1024), ("16384", 16384),
                                         ("1g", 2**30)])
def test_parse_batch(text, value):
    assert parse_batch(text) == value


@pytest.mark.parametrize("text", ["", "M", "4.5M", "-1", "0", "4T"])
def test_parse_batch_rejects(text):
    with pytest.raises(AmspUserError, match="--global-batch"):
        parse_batch(text)


# ----- clusters -------------------------------------------------------------------------------
def test_cluster_presets_carry_published_link_speeds():
    # DESIGN.md 4: NVLink 3 300 GB/s, NVLink 4 450 GB/s per direction; HDR 200, NDR 400 Gb/s.
    a100, h100 = load_cluster("dgx-a100-hdr"), load_cluster("dgx-h100-ndr")
    assert (a100.intra_gbyte_per_s, a100.nic_gbit_per_s) == (300, 200)
    assert (h100.intra_gbyte_per_s, h100.nic_gbit_per_s) == (450, 400)
    # NVLink at the measured bus bandwidth, about 80% of spec; InfiniBand NICs at 90 % of line
    # rate (fitted to published nccl-tests rows): 8 HDR NICs = 200 GB/s -> 180 GB/s.
    assert a100.bus_efficiency == 0.8 and a100.network == "infiniband"
    assert a100.node_nic_bytes_per_s == pytest.approx(180e9)
    assert a100.intra_bytes_per_s == pytest.approx(240e9)
    # EFA and RoCE reach less of their line rate: p4d's 4x 100 Gb/s = 50 GB/s -> 31 GB/s
    assert load_cluster("aws-p4d").node_nic_bytes_per_s == pytest.approx(31e9)
    assert load_cluster("aws-p5").nics_per_node * load_cluster("aws-p5").nic_gbit_per_s == 3200
    for name in list_presets("cluster"):
        assert isinstance(load_cluster(name), ClusterSpec)


def test_set_overrides_top_level_and_nested_fields():
    c = load_cluster("dgx-a100-hdr", {"nic_gbit_per_s": 400, "gpu.memory_gib": 40})
    assert c.nic_gbit_per_s == 400
    assert c.gpu.memory_gib == 40
    assert c.gpu.peak_bf16_tflop_per_s == 312  # the rest of the group is kept
    assert load_cluster("dgx-a100-hdr").gpu.memory_gib == 80  # presets are not modified


@pytest.mark.parametrize("overrides, needle", [
    ({"nic_gbps": 400}, "no such cluster field"),
    ({"gpu.memory_gib": -1}, "gpu.memory_gib"),
    ({"gpu.colour": 1}, "gpu.colour"),
    ({"gpus_per_node.x": 1}, "not a group of fields"),
    ({"oversubscription": 0.5}, "oversubscription"),
])
def test_set_overrides_rejected(overrides, needle):
    with pytest.raises(AmspUserError, match=needle):
        load_cluster("dgx-a100-hdr", overrides)


def test_measured_table_points_must_increase():
    with pytest.raises(ValidationError, match="strictly increasing"):
        ClusterSpec.model_validate({
            **load_cluster("dgx-a100-hdr").model_dump(),
            "measured": [{"op": "all_gather", "scope": "intra",
                          "points": [{"size_bytes": 10, "busbw_gbyte_per_s": 1},
                                     {"size_bytes": 5, "busbw_gbyte_per_s": 1}]}],
        })
