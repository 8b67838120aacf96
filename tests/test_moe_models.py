"""Mixture-of-experts families: presets and Hugging Face imports against published sizes, and
against the modules transformers builds on the meta device from the same config."""

from __future__ import annotations

import json

import pytest

from amsp_planner.errors import AmspUserError
from amsp_planner.specs import load_model

# preset: (published total, published active, active counted without the embedding?, source)
PRESETS = {
    # model card of Qwen/Qwen3-30B-A3B: "30.5B in total and 3.3B activated"
    "qwen3-30b-a3b": (30.5e9, 3.3e9, False),
    # model card of Qwen/Qwen3-235B-A22B: "235B in total and 22B activated"
    "qwen3-235b-a22b": (235e9, 22e9, False),
    # release post mistral.ai/news/mixtral-of-experts: 46.7B total, 12.9B per token (the paper,
    # arXiv 2401.04088, rounds to 47B and 13B)
    "mixtral-8x7b": (46.7e9, 12.9e9, False),
    # OLMoE, arXiv 2409.02060: 6.9B total, 1.3B active (the abstract rounds to 7B and 1B)
    "olmoe-1b-7b": (6.9e9, 1.3e9, False),
    # model card of Qwen/Qwen2-57B-A14B and the Qwen2 report (arXiv 2407.10671): 57B total,
    # 14B activated
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


# ----- Hugging Face imports --------------------------------------------------------------------
# The published config.json of each model on the Hugging Face Hub (the keys amsp reads), its
# published total and active counts, whether that active count leaves the embedding out, and
# the preset that models it.
_QWEN3_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
              "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
              "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0}
_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
            "attention_bias": True, "max_position_embeddings": 131072, "rope_theta": 150000}
_DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
                "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
                "scoring_func": "sigmoid", "num_nextn_predict_layers": 1, "vocab_size": 129280,
                "max_position_embeddings": 163840, "rope_theta": 10000}
_DEEPSEEK_V2 = {**_DEEPSEEK_V3, "model_type": "deepseek_v2", "hidden_size": 5120,
                "intermediate_size": 12288, "moe_intermediate_size": 1536,
                "num_hidden_layers": 60, "n_shared_experts": 2, "n_routed_experts": 160,
                "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_group": 3,
                "topk_method": "group_limited_greedy", "scoring_func": "softmax",
                "vocab_size": 102400, "num_nextn_predict_layers": None}
HF = {
    "Qwen3-30B-A3B": (_QWEN3_30B, 30.5e9, 3.3e9, False, "qwen3-30b-a3b"),
    "Qwen3-235B-A22B": ({**_QWEN3_30B, "hidden_size": 4096, "intermediate_size": 12288,
                         "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                         "num_attention_heads": 64}, 235e9, 22e9, False, "qwen3-235b-a22b"),
    # model card and Qwen2 report (arXiv 2407.10671): 57B, 14B activated
    "Qwen2-57B-A14B": ({"model_type": "qwen2_moe", "hidden_size": 3584,
                        "intermediate_size": 18944, "moe_intermediate_size": 2560,
                        "shared_expert_intermediate_size": 20480, "num_hidden_layers": 28,
                        "num_attention_heads": 28, "num_key_value_heads": 4, "num_experts": 64,
                        "num_experts_per_tok": 8, "vocab_size": 151936,
                        "max_position_embeddings": 32768, "rope_theta": 1000000.0},
                       57.4e9, 14e9, False, "qwen2-57b-a14b"),
    "Mixtral-8x7B-v0.1": ({"model_type": "mixtral", "hidden_size": 4096,
                           "intermediate_size": 14336, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 8,
                           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                           "max_position_embeddings": 32768, "rope_theta": 1000000.0},
                          46.7e9, 12.9e9, False, "mixtral-8x7b"),
    "OLMoE-1B-7B-0924": ({"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
                          "num_hidden_layers": 16, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
                          "vocab_size": 50304, "max_position_embeddings": 4096},
                         6.9e9, 1.3e9, False, "olmoe-1b-7b"),
    # model card of ibm-granite/granite-3.0-3b-a800m-base, its table: "# Parameters 3.3B",
    # "# Active Parameters 800M"
    "granite-3.0-3b-a800m": ({"model_type": "granitemoe", "hidden_size": 1536,
                              "intermediate_size": 512, "num_hidden_layers": 32,
                              "num_attention_heads": 24, "num_key_value_heads": 8,
                              "num_local_experts": 40, "num_experts_per_tok": 8,
                              "vocab_size": 49155, "tie_word_embeddings": True,
                              "max_position_embeddings": 4096}, 3.3e9, 0.8e9, True, None),
    "gpt-oss-120b": ({**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
                     116.83e9, 5.13e9, True, "gpt-oss-120b"),
    # gpt-oss model card, arXiv 2508.10925, table 1: 20.91B total, 3.61B active
    "gpt-oss-20b": ({**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
                    20.91e9, 3.61e9, True, None),
    # DeepSeek-V2, arXiv 2405.04434, section 1: 236B total, 21B activated
    "DeepSeek-V2": (_DEEPSEEK_V2, 236e9, 21e9, False, None),
    # DeepSeek-V2-Lite model card: 15.7B total, 2.4B activated (no query compression; the
    # embedding left out of the active count, as 2.45B here says)
    "DeepSeek-V2-Lite": ({**_DEEPSEEK_V2, "hidden_size": 2048, "intermediate_size": 10944,
                          "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                          "num_attention_heads": 16, "num_key_value_heads": 16,
                          "n_routed_experts": 64, "q_lora_rank": None,
                          "topk_method": "greedy"}, 15.7e9, 2.4e9, True, None),
    # DeepSeek-V3 (arXiv 2412.19437): 671B + the MTP module (test_deepseek_v3_main_model_...)
    "DeepSeek-V3": (_DEEPSEEK_V3, None, None, False, "deepseek-v3"),
}
_BASE = {"hidden_act": "silu", "tie_word_embeddings": False}


def _folder(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**_BASE, **cfg}))
    return str(d)


def _counts(m) -> tuple:
    return (m.num_params, m.num_active_params, m.unit_params(), m.unit_expert_params(),
            m.flops_per_token(4096))


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_config_matches_published_size_and_its_preset(tmp_path, name):
    cfg, total, active, no_emb, preset = HF[name]
    m = load_model(_folder(tmp_path, name, cfg))
    assert m.name == name and m.is_moe
    if total is not None:
        assert m.num_params == pytest.approx(total, rel=0.01), m.num_params
        assert _active(m, no_emb) == pytest.approx(active, rel=0.03), m.num_active_params
    if preset:
        assert _counts(m) == _counts(load_model(preset))


def _shrink(cfg: dict) -> dict:
    """The same family at a small size: its MoE layout kept, every width small."""
    small = {**_BASE, **cfg, "hidden_size": 64, "intermediate_size": 96, "vocab_size": 512,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 1
    small["num_attention_heads"], small["num_key_value_heads"] = 4, max(4 * kv // heads, 1)
    small["num_hidden_layers"] = min(cfg["num_hidden_layers"], 6)
    for key, value in {"moe_intermediate_size": 40, "shared_expert_intermediate_size": 72,
                       "head_dim": 24, "q_lora_rank": 32, "kv_lora_rank": 24,
                       "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 20}.items():
        if cfg.get(key) is not None:
            small[key] = value
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if key in cfg:
            small[key] = 8
    small["num_experts_per_tok"] = 2
    small.pop("n_group", None), small.pop("topk_group", None)
    return small


# (family, changes to its small config): the published layouts, then every placement key
VARIANTS = [(n, {}) for n in sorted(HF)] + [
    ("Qwen3-30B-A3B", {"decoder_sparse_step": 2, "mlp_only_layers": [2]}),
    ("Qwen3-30B-A3B", {"attention_bias": True, "tie_word_embeddings": True}),
    ("Qwen2-57B-A14B", {"decoder_sparse_step": 3, "qkv_bias": False}),
    ("DeepSeek-V3", {"first_k_dense_replace": 2, "attention_bias": True, "head_dim": 8}),
    ("DeepSeek-V2-Lite", {"first_k_dense_replace": 0}),
    ("gpt-oss-20b", {"layer_types": ["full_attention"] * 3 + ["sliding_attention"] * 3,
                     "attention_bias": False}),
    ("granite-3.0-3b-a800m", {"attention_bias": True}),
]


@pytest.mark.parametrize("name, change", VARIANTS, ids=[f"{n}-{sorted(c)}" for n, c in VARIANTS])
def test_counts_equal_transformers_modules(tmp_path, name, change):
    """Total, embedding, head and every layer's dense and routed-expert parts, against the
    modules transformers builds from the same (small) config on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = {**_shrink(HF[name][0]), **change, "num_nextn_predict_layers": 0}
    spec = load_model(_folder(tmp_path, "m", cfg))
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                  if k != "num_nextn_predict_layers"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    numel = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert numel(model) == spec.num_params
    inner = model.model
    assert numel(inner.embed_tokens) == spec.unit_params()[0]
    lm = 0 if spec.tied_embeddings else numel(model.lm_head)
    assert numel(inner.norm) + lm == spec.unit_params()[-1]
    experts = [sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}")
               for layer in inner.layers]
    assert experts == spec.unit_expert_params()[1:-1]
    assert [numel(b) for b in inner.layers] == spec.unit_params()[1:-1]
    assert [e > 0 for e in experts] == [spec.is_moe_layer(i) for i in range(spec.num_layers)]
    assert 0 < spec.num_moe_layers


@pytest.mark.parametrize("name", sorted(HF))
def test_full_size_totals_equal_transformers(tmp_path, name):
    """Each published config at full size (the meta device allocates nothing): the total and
    the routed experts' share equal transformers' modules exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = {**_BASE, **HF[name][0], "num_nextn_predict_layers": 0}
    spec = load_model(_folder(tmp_path, "m", cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                 if k != "num_nextn_predict_layers"}))
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == spec.num_params
    routed = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert routed == sum(spec.unit_expert_params())


def test_full_size_deepseek_v3_main_model_equals_transformers(tmp_path):
    """The published config at full size (the meta device allocates nothing): transformers
    builds the 671B main model; amsp's count without the MTP module is the same."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = {**_BASE, **_DEEPSEEK_V3, "num_nextn_predict_layers": 0}
    spec = load_model(_folder(tmp_path, "ds", cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg))
    assert sum(p.numel() for p in model.parameters()) == spec.num_params
    mtp = load_model(_folder(tmp_path, "ds-mtp", {**cfg, "num_nextn_predict_layers": 1}))
    assert mtp.num_layers == 62 and mtp.mtp_layers == 1
    # the MTP module: a MoE block like layer 60, eh_proj 2h x h and three RMSNorms of h
    block = sum(p.numel() for p in model.model.layers[60].parameters())
    assert mtp.num_params - spec.num_params == block + 2 * 7168 * 7168 + 3 * 7168


# ----- what cannot be expressed, and bad MoE input: one line, exit 2 --------------------------
@pytest.mark.parametrize("name, change, needle", [
    ("Qwen3-30B-A3B", {"num_experts_per_tok": 129},
     "'num_experts_per_tok' = 129 exceeds 'num_experts' = 128"),
    ("Qwen3-30B-A3B", {"mlp_only_layers": [48]}, "field 'mlp_only_layers' has layer 48"),
    ("Qwen3-30B-A3B", {"decoder_sparse_step": 49}, "leave no mixture-of-experts layer"),
    ("Qwen3-30B-A3B", {"num_experts": True}, "field 'num_experts'"),
    ("DeepSeek-V3", {"first_k_dense_replace": 62}, "'first_k_dense_replace' and 'moe_layer_freq'"),
    ("DeepSeek-V3", {"scoring_func": "softplus"}, "field 'scoring_func': routing"),
    ("DeepSeek-V2", {"topk_method": "random"}, "field 'topk_method': routing"),
    ("DeepSeek-V2", {"mlp_bias": True}, "field 'mlp_bias'"),
    ("Qwen2-57B-A14B", {"shared_expert_intermediate_size": 0},
     "field 'shared_expert_intermediate_size' is 0"),
    ("DeepSeek-V3", {"kv_lora_rank": None}, "field 'kv_lora_rank' is missing"),
    ("DeepSeek-V3", {"first_k_dense_replace": None}, "field 'first_k_dense_replace' is missing"),
    ("gpt-oss-20b", {"layer_types": ["chunked_attention"] * 24}, "'chunked_attention'"),
    ("Mixtral-8x7B-v0.1", {"num_local_experts": None}, "'num_local_experts' is missing"),
    ("Mixtral-8x7B-v0.1", {"model_type": "jamba"}, "hybrid with state-space"),
    ("Mixtral-8x7B-v0.1", {"model_type": "qwen3_next"}, "hybrid with state-space"),
    ("Mixtral-8x7B-v0.1", {"model_type": "llama4", "text_config": {}}, "multimodal"),
    ("Mixtral-8x7B-v0.1", {"model_type": "phimoe"}, "'phimoe' with experts is not supported"),
    ("Mixtral-8x7B-v0.1", {"model_type": "mistral"}, "'mistral' with experts is not supported"),
])
def test_inexpressible_or_bad_moe_configs_are_refused_with_their_reason(tmp_path, name, change,
                                                                         needle):
    d = _folder(tmp_path, "m", {**HF[name][0], **change})
    with pytest.raises(AmspUserError, match=needle.replace("(", r"\(")):
        load_model(d)


@pytest.mark.parametrize("change, needle", [
    ({"experts_per_token": 9}, "experts_per_token 9 must be in [1, num_experts = 8]"),
    ({"routing": "expert_choice"}, "field 'routing'"),
    ({"dense_layers": [4]}, "dense_layers [4] must be distinct layer indices below"),
    ({"sliding_layers": [0]}, "sliding_window and sliding_layers go together"),
    ({"v_head_dim": 16}, "v_head_dim is set but kv_lora_rank is not"),
    ({"mtp_layers": 4}, "mtp_layers 4 must be below num_layers"),
    ({"shared_expert_gate": True}, "shared_expert_gate is set but"),
])
def test_bad_moe_spec_file_is_one_line_exit_2(tmp_path, change, needle):
    """The spec file's field named, with its fix, through the real CLI (amsp specs show)."""
    import yaml
    from amsp_testlib import assert_user_error, run_cli

    from amsp_planner.specs.loader import PRESETS

    doc = yaml.safe_load((PRESETS / "model_specs" / "tiny-moe.yaml").read_text())
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({**doc, **change}))
    assert_user_error(*run_cli(["specs", "show", str(path)]), needle)


def test_bad_moe_config_json_is_one_line_exit_2(tmp_path):
    d = _folder(tmp_path, "m", {**HF["Qwen3-30B-A3B"][0], "num_experts_per_tok": 129})
    from amsp_testlib import assert_user_error, run_cli

    assert_user_error(*run_cli(["specs", "show", d]), "num_experts_per_tok", "give the router's top-k")


def test_specs_show_gives_total_and_active_parameters_and_experts():
    from amsp_testlib import run_cli

    code, out, _ = run_cli(["specs", "show", "qwen3-30b-a3b"])
    assert code == 0
    m = load_model("qwen3-30b-a3b")
    for line in ("num_experts: 128", "experts_per_token: 8", "expert_ffn_hidden_size: 768",
                 f"params: {m.num_params:,}", f"active_params: {m.num_active_params:,}",
                 "moe_layers: 48", f"routed_expert_params: {48 * 128 * 3 * 2048 * 768:,}"):
        assert f"  {line}\n" in out, line
    code, out, _ = run_cli(["specs", "show", "deepseek-v3", "--json"])
    derived = json.loads(out)["derived"]
    assert derived["moe_layers"] == 59 and derived["active_params"] < derived["params"]
    assert derived["dense_params"] + derived["routed_expert_params"] == derived["params"]
    _, out, _ = run_cli(["specs", "show", "llama-7b"])
    assert "active_params" not in out and "moe_layers" not in out


@pytest.mark.parametrize("name, field", [("gpt-oss-120b", "attention_sinks"),
                                         ("deepseek-v3", "kv_lora_rank"),
                                         ("deepseek-v3", "mtp_layers: 0"),
                                         ("qwen2-57b-a14b", "shared_expert_gate: false")])
def test_runtime_refuses_what_it_does_not_run(name, field):
    """The bundled runtime's attention is full grouped-query attention and its router a
    softmax top-k without bias: MLA, sinks, sliding windows, router biases, the shared
    expert's gate and MTP modules are refused by name before anything is launched."""
    from amsp_planner.runtime.support import check_supported

    with pytest.raises(AmspUserError, match=field):
        check_supported(load_model(name))


POISONS = [float("nan"), -1, 0, True, "x", [1, "a"], {"a": 1}, None, 10**9]


@pytest.mark.parametrize("name", ["Qwen2-57B-A14B", "DeepSeek-V3", "gpt-oss-20b"])
def test_any_poisoned_moe_config_key_is_one_line_or_ignored(tmp_path, name):
    """Every key of a published MoE config, set to each poison: exit 0 (a key amsp does not
    read, or a value it takes) or one line and exit 2, never a traceback."""
    from amsp_testlib import assert_user_error, run_cli

    cfg = {**_BASE, **HF[name][0]}
    for n, (key, poison) in enumerate((k, p) for k in sorted(cfg) for p in POISONS):
        d = _folder(tmp_path, f"m{n}", {**cfg, key: poison})
        code, out, err = run_cli(["specs", "show", d])
        if code != 0:
            assert_user_error(code, out, err)


def test_flops_count_sliding_windows_mla_and_the_mtp_head_by_hand():
    """Attention FLOPs per token, forward and backward, by hand from the papers' shapes:
    6 * keys seen * (H * d_qk + H * d_v) per layer (PaLM's 12 * d_q * s when d_qk = d_v)."""
    s = 4096
    oss = load_model("gpt-oss-120b")  # 64 heads of 64; 18 layers see 128 keys, 18 see all
    attn = 6 * (64 * 64 + 64 * 64) * (18 * s + 18 * 128)
    assert oss.flops_per_token(s) == 6 * oss.num_flop_params + attn
    # 6 x the published 5.13B active parameters (no embedding) is the matmul part
    assert 6 * oss.num_flop_params == pytest.approx(6 * 5.13e9, rel=0.002)
    ds = load_model("deepseek-v3")  # 128 heads, d_qk 128 + 64, d_v 128, 62 blocks with MTP
    attn = 6 * (128 * 192 + 128 * 128) * s * 62
    mtp_head = 6 * 129280 * 7168  # the MTP module runs the shared output head once more
    assert ds.flops_per_token(s) == 6 * ds.num_flop_params + attn + mtp_head
    mix = load_model("mixtral-8x7b")  # top-2 of 8 experts: the active 12.9B, not 46.7B
    assert mix.flops_per_token(s) == 6 * mix.num_flop_params + 12 * 32 * 4096 * s
    assert mix.num_flop_params == pytest.approx(12.9e9 - 32000 * 4096, rel=0.005)
