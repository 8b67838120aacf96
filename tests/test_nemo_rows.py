"""The NeMo 24.07 rows and the Megatron-LM README rows of presets/validation.yaml: their setup
against the published tables (typed here from the sources, not from the file), and the
nemo@24.07 profile that prices the NeMo rows (amsp_planner/engine_versions.py).

Sources: NVIDIA/NeMo docs/source/performance/performance_summary.md at 9c5c5e9 ("24.07 perf
numbers", 2024-09-09); NVIDIA/NeMo-Framework-Launcher tag 24.07 (8325688d)
launcher_scripts/conf/training/*.yaml; NVIDIA/Megatron-LM images/model_table.png at f2e5db4.
"""

from __future__ import annotations

import math

import pytest

from amsp_planner.cost.compute import _elementwise_block
from amsp_planner.cost.fp8 import family_of
from amsp_planner.cost.tp_overlap import BULK
from amsp_planner.engines import PROFILES, runs_as
from amsp_planner.strategy import parse_strategy_or_baseline
from amsp_planner.validation import load_rows, predict_rows, priced_job

# performance_summary.md at 9c5c5e9, pre-training table (FP8, DGX-H100):
# model, GPUs, GBS, MBS, seq, TP, PP, CP, VP, tokens/s/GPU
TABLE = {
    "nemo2407-gpt3-5b-64": (64, 2048, 4, 2048, 1, 1, 1, 1, 23406),
    "nemo2407-gpt3-20b-64": (64, 256, 2, 2048, 2, 1, 1, 1, 5851),
    "nemo2407-gpt3-175b-128": (128, 256, 1, 2048, 4, 8, 1, 6, 716),
    "nemo2407-gpt3-175b-512": (512, 2048, 2, 2048, 4, 8, 1, 6, 825),
    "nemo2407-llama2-7b-8": (8, 128, 1, 4096, 1, 1, 1, 1, 16934),
    "nemo2407-llama2-13b-16": (16, 128, 1, 4096, 1, 4, 1, 10, 8715),
    "nemo2407-llama2-70b-64": (64, 128, 1, 4096, 4, 4, 1, 20, 1728),
    "nemo2407-nemotron-8b-64": (64, 256, 4, 4096, 2, 1, 1, 1, 12507),
    "nemo2407-nemotron-22b-64": (64, 256, 2, 4096, 2, 4, 1, 10, 4312),
    "nemo2407-nemotron-340b-128": (128, 32, 1, 4096, 8, 8, 1, 12, 326),
    "nemo2407-llama3-8b-8": (8, 128, 1, 8192, 1, 1, 2, 1, 12273),
    "nemo2407-llama3-70b-64": (64, 128, 1, 8192, 4, 4, 2, 5, 1524),
}

# launcher_scripts/conf/training/<model>.yaml at 24.07: layers, hidden, heads, query groups,
# FFN, the tokenizer's vocabulary; ub_tp_comm_overlap
SHAPES = {
    "nemo-gpt3-5b": (24, 4096, 32, None, 4 * 4096, 50257),
    "nemo-gpt3-20b": (44, 6144, 48, None, 4 * 6144, 50257),
    "nemo-gpt3-175b": (96, 12288, 96, None, 4 * 12288, 50257),
    "nemo-llama2-7b": (32, 4096, 32, None, 11008, 32000),
    "nemo-llama2-7b-tp4": (32, 4096, 32, None, 11008, 32000),
    "nemo-llama2-7b-tp8": (32, 4096, 32, None, 11008, 32000),
    "nemo-llama2-13b": (40, 5120, 40, None, 13824, 32000),
    "nemo-llama2-70b": (80, 8192, 64, 8, 28672, 32000),
    "nemo-llama3-70b": (80, 8192, 64, 8, 28672, 128256),
    "nemo-nemotron-8b": (32, 4096, 32, None, 16384, 256000),
    "nemo-nemotron-22b": (40, 6144, 48, None, 24576, 256000),
}
# the 512-GPU GPT3-175B row: gpt3/175b_mlperf.yaml at 7316a8d9 (64 nodes, GBS 2048, MBS 2,
# VP 6: ub_tp_comm_overlap True, fp8_params true); the 128-GPU row: 175b.yaml (False)
UB_OVERLAP = {"nemo2407-llama3-70b-64": True, "nemo2407-gpt3-20b-64": True, "nemo2407-gpt3-175b-128": False,
              "nemo2407-gpt3-175b-512": True, "nemo2407-llama2-70b-64": True,
              "nemo2407-nemotron-8b-64": True, "nemo2407-nemotron-22b-64": True}


@pytest.fixture(scope="module")
def doc():
    return load_rows()


def _row(doc, rid):
    return next(r for r in doc["rows"] if r["id"] == rid)


@pytest.mark.parametrize("rid", sorted(TABLE))
def test_nemo_rows_carry_the_published_setup(doc, rid):
    gpus, gbs, mbs, seq, tp, pp, cp, vp, value = TABLE[rid]
    r = _row(doc, rid)
    assert (r["source"], r["engine"], r["engine_version"]) == ("nemo-24.07", "nemo", "24.07")
    assert (r["gpus"], r["seq_len"], r["value"], r["metric"]) == (gpus, seq, value,
                                                                   "tps_per_gpu")
    if rid.endswith("340b-128"):  # Megatron's selective recomputation is not modelled
        assert r["scope"].startswith("selective recomputation")
        return
    assert r["scope"] == "in" and r["global_batch_seqs"] == gbs
    s = parse_strategy_or_baseline(r["strategy"], gpus, 8)
    assert (s.tp, s.pp, s.vpp, s.cp, s.micro_batch) == (tp, pp, vp, cp, mbs)
    # distributed_fused_adam: optimizer states over the data-parallel group with context
    # parallelism (DP x CP ranks), gradients and parameters whole on each ('os')
    assert (s.s_p, s.s_g, s.s_os) == (1, 1, gpus // (tp * pp))
    t = r["training"]
    assert (t["precision"], t["fp8_recipe"], t["dp_overlap"]) == ("fp8", "delayed", True)
    assert t.get("tp_overlap", False) == UB_OVERLAP.get(rid, False)
    assert t["fp8_all_gather"] == ("on" if rid == "nemo2407-gpt3-175b-512" else "off")
    # grad_sync_dtype=bf16 in the GPT and Llama FP8 scripts, Apex's fp32 otherwise
    assert t["grad_accum_dtype"] == ("fp32" if "nemotron" in rid else "bf16")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_nemo_models_are_the_release_configs(doc, name):
    layers, h, heads, groups, ffn, vocab = SHAPES[name]
    m = doc["models"][name]
    assert (m["num_layers"], m["hidden_size"], m["num_heads"], m.get("num_kv_heads"),
            m["ffn_hidden_size"]) == (layers, h, heads, groups, ffn)
    # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by (128) x TP;
    # every row of a model runs one TP degree
    tps = {parse_strategy_or_baseline(r["strategy"], r["gpus"], 8).tp
           for r in doc["rows"] if r.get("model") == name}
    tp = max(tps)  # TP 1 and 2 pad 32,000 alike (a multiple of 256)
    assert all(math.ceil(vocab / (128 * t)) == math.ceil(vocab / (128 * tp)) * tp // t
               for t in tps)
    assert m["vocab_size"] == math.ceil(vocab / (128 * tp)) * 128 * tp


def test_the_padding_by_hand():
    # GPT-2 BPE 50,257 at TP 1, 2, 4: 393 x 128, 197 x 256, 99 x 512
    assert [math.ceil(50257 / (128 * t)) * 128 * t for t in (1, 2, 4)] == [50304, 50432, 50688]


def test_nemo_rows_are_priced_with_the_nemo_profile(doc):
    for rid in TABLE:
        r = _row(doc, rid)
        if r["scope"] == "in":
            assert priced_job(r, doc["models"])[2] == "nemo@24.07"
    results = {x.id: x for x in predict_rows(doc)}
    assert all(results[rid].priced_as == "nemo@24.07" for rid in TABLE
               if results[rid].scope == "in")
    assert all(results[rid].fits for rid in TABLE if results[rid].scope == "in")


def test_the_nemo_profile_is_megatron_core_with_nemos_differences():
    nemo, mcore = PROFILES["nemo@24.07"], PROFILES["megatron"]
    assert runs_as("nemo@24.07") == "megatron" and runs_as("deepspeed@0.3.14") == "deepspeed"
    assert runs_as("fsdp2") == "fsdp2"
    # Transformer Engine FP8, TE userbuffers' bulk overlap: the megatron rules
    assert family_of("nemo@24.07") == family_of("megatron") == "te"
    assert runs_as("nemo@24.07") in BULK
    assert (nemo.shapes, nemo.tp, nemo.ckpt_kinds) == (mcore.shapes, mcore.tp, mcore.ckpt_kinds)
    # Megatron forces fp32 gradient reduction; Apex's grad_sync_dtype is a setting
    assert mcore.reduce_dtype == "fp32" and nemo.reduce_dtype is None
    assert nemo.fused_elementwise and not mcore.fused_elementwise
    assert nemo.activation_profile == "fused"
    assert "overlap_grad_sync" in nemo.execution.overlap_flags


def test_fused_elementwise_bytes_by_hand(doc):
    # Llama 2 7B, bf16 activations (2 bytes): fused, 2 add+norm kernels of 4h, RoPE on q and
    # k 2(h + kv), SwiGLU 3f; eager 28h + 6(h + kv) + 6h + 5f (cost/compute.py docstring)
    h, kv, f = 4096, 4096, 11008
    row = dict(_row(doc, "nemo2407-llama2-7b-8"))
    job = priced_job(row, doc["models"])[0]
    assert _elementwise_block(job) == (8 * h + 2 * (h + kv) + 3 * f) * 2
    mcore = priced_job({**row, "engine": "megatron", "engine_version": None,
                        "training": {**row["training"], "grad_accum_dtype": "fp32"}},
                       doc["models"])[0]
    assert _elementwise_block(mcore) == (28 * h + 6 * (h + kv) + 6 * h + 5 * f) * 2


# images/model_table.png at f2e5db4: size, heads, hidden, layers, TP, PP, DP, GPUs, batch,
# TFLOP/s per GPU
README = [("70b", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
          ("119b", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
          ("177b", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
          ("314b", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
          ("462b", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9)]


@pytest.mark.parametrize("size,heads,hidden,layers,tp,pp,dp,gpus,batch,value", README)
def test_megatron_readme_rows_carry_the_table(doc, size, heads, hidden, layers, tp, pp, dp,
                                              gpus, batch, value):
    r = _row(doc, f"mlm-h100-{size}-{gpus}")
    m = doc["models"][r["model"]]
    assert (m["num_heads"], m["hidden_size"], m["num_layers"]) == (heads, hidden, layers)
    assert (m["vocab_size"], m["max_seq_len"], r["seq_len"]) == (131072, 4096, 4096)
    assert (r["global_batch_seqs"], r["value"], r["metric"]) == (batch, value, "tflops_model")
    s = parse_strategy_or_baseline(r["strategy"], gpus, 8)
    assert (s.tp, s.pp, s.s_os, tp * pp * dp) == (tp, pp, dp, gpus)
    # the micro-batch, interleaving and recomputation are not published
    assert r["scope"].startswith("setup not published")


def test_megatron_context_parallelism_is_the_te_ring_by_hand(doc):
    # Llama 3 8B, CP 2 on one DGX H100 node, micro-batch 1 of 8192 tokens: each rank holds
    # t_l = 4096 tokens; a hop carries K and V, 2 d_kv a_b t_l = 2 x 1024 x 2 x 4096 bytes,
    # over NVLink (latency + bytes / bandwidth); the forward hides its one hop behind one ring
    # step (the block's attention / 2); backward: the K, V + dK, dV hop behind a step of the
    # attention backward, the last dK, dV hop whole
    from amsp_planner.cost.context_parallel import cp_kind, cp_view, p2p_hop_seconds
    from amsp_planner.cost.evaluate import evaluate

    job, s, engine, _ = priced_job(_row(doc, "nemo2407-llama3-8b-8"), doc["models"])
    assert engine == "nemo@24.07" and cp_kind(job) == "p2p"
    view, c = cp_view(job, 2), job.cluster
    kv = 2 * 1024 * 2 * 4096
    hop = c.intra_latency_us * 1e-6 + kv / c.intra_bytes_per_s
    assert p2p_hop_seconds(view, s, kv) == pytest.approx(hop)
    gpu = c.gpu  # attention in bf16 (TE's FP8 covers the linears), at the GPU's flash rate
    assert job.training.dtype_name == "bf16"
    attn = 2.0 * 4096 * 8192 * 4096 / (gpu.peak_flop_per_s("bf16") * gpu.attention_fraction)
    ev = evaluate(job, s)
    cp = {e.phase: e for e in ev.schedule if e.group == "CP"}
    per_step = ev.n_micro * 32
    fwd = max(0.0, hop - attn / 2)
    hop2 = c.intra_latency_us * 1e-6 + 2 * kv / c.intra_bytes_per_s
    bwd = max(0.0, hop2 - 2.5 * attn / 2) + hop
    assert cp["forward"].time_s == pytest.approx(per_step * fwd)
    assert cp["backward"].time_s == pytest.approx(per_step * bwd)
    assert "recompute" not in cp  # no recomputation


def test_te_delayed_sequence_parallel_all_gathers_move_fp8_by_hand(doc):
    # GPT3-175B, TP 4, PP 8 (12 blocks a stage), 64 micro-batches of 1 x 2048 tokens: Transformer
    # Engine (layernorm_linear.py / layernorm_mlp.py / base.py at v1.8) gathers the FP8 norm
    # output before linear_qkv and linear_fc1 and the FP8 output gradient before linear_proj and
    # linear_fc2 (1 byte per element, 2 gathers a block each way); the head's gather stays bf16
    # (1 a micro-batch, 2 bytes); the reduce-scatters carry bf16 GEMM outputs
    from amsp_planner.cost.evaluate import evaluate

    job, s, engine, _ = priced_job(_row(doc, "nemo2407-gpt3-175b-128"), doc["models"])
    assert engine == "nemo@24.07"
    ev = evaluate(job, s)
    tp = {(e.phase, e.op): e for e in ev.schedule if e.group == "TP"}
    elems = 2048 * 12288
    gathers = 64 * 12 * 2 * elems * 1 + 64 * 1 * elems * 2
    for phase in ("forward", "backward"):
        assert tp[(phase, "all_gather")].dtype == "fp8"
        assert tp[(phase, "all_gather")].full_bytes_per_step == gathers
        assert tp[(phase, "reduce_scatter")].dtype == "bf16"
        assert tp[(phase, "reduce_scatter")].full_bytes_per_step == 64 * 25 * elems * 2
    # delayed scaling takes its scale from the amax history: no amax all-reduce per gather, so
    # the forward all-reduces are the cross-entropy's 3 per micro-batch alone
    assert tp[("forward", "all_reduce")].calls_per_step == 64 * 3


# performance_long_sequence.md at 19fadb67b0, "LLAMA2-7B (FP8) - H100" (NeMo 24.03.01): seq (K),
# GPUs, batch size, with CP: TP, PP, DP, CP, TFLOPS / GPU
LONG = [(4, 4, 1024, 1, 1, 4, 1, 768), (8, 8, 512, 1, 2, 4, 1, 730),
        (16, 16, 256, 2, 1, 8, 1, 660), (32, 32, 128, 2, 1, 8, 2, 610),
        (64, 64, 64, 4, 1, 8, 2, 574), (128, 128, 32, 4, 1, 8, 4, 555),
        (256, 256, 16, 4, 1, 8, 8, 549), (512, 512, 8, 8, 1, 4, 16, 549),
        (1024, 1024, 4, 8, 1, 4, 32, 536)]


@pytest.mark.parametrize("k,gpus,batch,tp,pp,dp,cp,tflops", LONG)
def test_long_sequence_rows_carry_the_published_setup(doc, k, gpus, batch, tp, pp, dp, cp,
                                                      tflops):
    r = _row(doc, f"nemolong-l2-7b-{k}k-{gpus}")
    assert (r["source"], r["engine"], r["engine_version"]) == ("nemo-long-seq", "nemo",
                                                               "24.03.01")
    assert (r["gpus"], r["seq_len"], r["global_batch_seqs"]) == (gpus, k * 1024, batch)
    assert (r["metric"], r["value"], r["scope"]) == ("tflops_model", tflops, "in")
    assert tp * pp * dp * cp == gpus and batch * k * 1024 == 4 * 1024**3 // 1024  # 4M tokens
    s = parse_strategy_or_baseline(r["strategy"], gpus, 8)
    assert (s.tp, s.pp, s.cp, s.micro_batch) == (tp, pp, cp, 1)
    # distributed_fused_adam over the DP x CP ranks
    assert (s.s_p, s.s_g, s.s_os) == (1, 1, dp * cp)
    t = r["training"]
    assert (t["precision"], t["fp8_recipe"], t["grad_accum_dtype"]) == ("fp8", "delayed", "bf16")
    assert t.get("sequence_parallel", False) == (tp > 1)


def test_long_sequence_rows_are_priced_with_the_24_03_01_profile(doc):
    # the same stack as 24.07 (engine_versions.py): every field but the title and sources
    import dataclasses

    a, b = PROFILES["nemo@24.03.01"], PROFILES["nemo@24.07"]
    diff = {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}
    assert diff <= {"name", "title", "sources"}, diff
    results = {x.id: x for x in predict_rows(doc)}
    rows = [results[f"nemolong-l2-7b-{k}k-{g}"] for k, g, *_ in LONG]
    assert all(x.priced_as == "nemo@24.03.01" and x.fits for x in rows)
