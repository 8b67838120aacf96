"""The dgxc-benchmarking rows of presets/validation.yaml: their setup against the published
README tables and configs (typed here from the sources, not from the file), and the
nemo@24.12 profile that prices them (amsp_planner/engine_versions.py).

Source: NVIDIA/dgxc-benchmarking at 8f5cbb37 (v25.02, nvcr.io/nvidia/nemo:24.12):
llama3.1/README_{8b,70b,405b}.md, nemo_megatron/README_175b.md, nemotron/README_15b.md, the
table headers "(TP=, PP=, CP=, VP=, MBS=)" and columns "Nx H100 GPUs (GBS=)"; the yamls and
configure.sh of the same commit (the 175B's VP: its yaml's 6, not the README's 12).
"""

from __future__ import annotations

import pytest

from amsp_planner.engines import PROFILES
from amsp_planner.strategy import parse_strategy_or_baseline
from amsp_planner.validation import load_rows

# key: (TP, PP, VP, CP, MBS, seq), {GPUs: (GBS, BF16 tokens/s, FP8 tokens/s)}
README = {
    "l31-8b": ((1, 1, 1, 2, 1, 8192), {8: (128, 82028, 111054), 16: (256, 161443, 221358),
                                       32: (512, 322638, 437088), 64: (1024, 645277, 870639),
                                       128: (2048, 1275155, 1725163)}),
    "l31-70b": ((4, 4, 5, 2, 1, 8192), {64: (128, 71756, 100275), 128: (256, 142663, 199292),
                                        256: (512, 284881, 390167),
                                        512: (1024, 566797, 779393),
                                        1024: (2048, 1129246, 1549142),
                                        2048: (4096, 2260623, 3053178)}),
    # the 405B's proxy columns (configure.sh: 7, 21, 42 layers; PP 1, 3, 3; VP null, 7, 7)
    "l31-405b-l7": ((8, 1, 1, 2, 1, 8192), {32: (126, 114637, 179511)}),
    "l31-405b-l21": ((8, 3, 7, 2, 1, 8192), {96: (126, 116342, 183337)}),
    "l31-405b-l42": ((8, 3, 7, 2, 1, 8192), {192: (252, 119328, 191146)}),
    "l31-405b": ((8, 9, 7, 2, 1, 8192), {576: (252, 117964, 187671),
                                         1152: (504, 234589, 371961),
                                         2304: (1008, 466527, 737280)}),
    "gpt3-175b": ((4, 8, 6, 1, 1, 2048), {128: (256, 63099, 93190), 256: (512, 124712, 183157),
                                          512: (1024, 249068, 363206),
                                          1024: (2048, 496191, 720671),
                                          2048: (4096, 988057, 1407485)}),
    "nemotron4-15b": ((4, 1, 1, 1, 4, 4096), {16: (64, 93223, 128565), 32: (128, 185654, 256250),
                                              64: (256, 368568, 512000),
                                              128: (512, 733526, 1018529),
                                              256: (1024, 1470654, 2021351),
                                              512: (2048, 2917777, 3956891),
                                              1024: (4096, 5795239, 8012042),
                                              2048: (8192, 11622595, 15827562)}),
}


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in load_rows()["rows"] if r["source"] == "dgxc-benchmarking"}


@pytest.mark.parametrize("key", README)
def test_rows_are_the_readme_tables(rows, key):
    (tp, pp, vp, cp, mb, seq), cols = README[key]
    for gpus, (gbs, bf16, fp8) in cols.items():
        b, f = rows[f"dgxc2502-{key}-{gpus}"], rows[f"dgxc2502-{key}-{gpus}-fp8"]
        for r, total in ((b, bf16), (f, fp8)):
            assert (r["gpus"], r["global_batch_seqs"], r["seq_len"]) == (gpus, gbs, seq)
            assert r["value"] == pytest.approx(total / gpus, rel=1e-8)
            s = parse_strategy_or_baseline(r["strategy"], gpus, 8)
            assert (s.tp, s.pp, s.vpp, s.cp, s.micro_batch) == (tp, pp, vp, cp, mb)
            # the distributed optimizer shards over the data-parallel x context-parallel ranks
            assert (s.s_p, s.s_g, s.s_os) == (1, 1, gpus // (tp * pp))
            assert (r["engine"], r["engine_version"], r["scope"]) == ("nemo", "24.12", "in")
        # the FP8 run is the BF16 config with fp8, fp8_hybrid and fp8_params (configure.sh;
        # the 405B's FP8 runs also write the forward reduce-scatters in FP8, fp8_buf: not
        # modelled)
        assert f["strategy"] == b["strategy"] and f["bf16_row"] == b["id"]
        extra = {k: v for k, v in f["training"].items() if b["training"].get(k) != v}
        assert extra == {"precision": "fp8", "fp8_recipe": "delayed", "fp8_all_gather": "on"}
        # TP > 1: sequence parallelism with userbuffers' TP overlap (ub_tp_comm_overlap true)
        assert b["training"].get("tp_overlap", False) == (tp > 1)


def test_the_405b_is_the_configs_shape(rows):
    # llama3.1_405b.yaml: 126 layers, hidden 16384, 128 heads, num_query_groups 16,
    # ffn 53248; GPT2BPETokenizer (50,257) padded to a multiple of 128 x TP 8
    m = load_rows()["models"]["dgxc-llama31-405b"]
    assert (m["num_layers"], m["hidden_size"], m["num_heads"], m["num_kv_heads"],
            m["ffn_hidden_size"]) == (126, 16384, 128, 16, 53248)
    assert m["vocab_size"] == -(-50257 // 1024) * 1024
    assert 126 % (9 * 7) == 0  # PP 9 x VP 7 chunks of 2 layers
    models = load_rows()["models"]
    for layers in (7, 21, 42):  # the proxies: the same block, fewer of them
        p = models[f"dgxc-llama31-405b-l{layers}"]
        assert p["num_layers"] == layers and {k: v for k, v in p.items() if k not in (
            "name", "num_layers")} == {k: v for k, v in m.items() if k not in ("name", "num_layers")}


def test_every_column_is_collected(rows):
    # every GPU column of the five tables (the 340B's out of scope), both precisions
    assert len(rows) == 2 * sum(len(cols) for _, cols in README.values()) + 2


def test_nemo_24_12_prices_as_24_07(rows):
    # the same Launcher-style settings (engine_versions.py): everything but the name
    new, old = PROFILES["nemo@24.12"], PROFILES["nemo@24.07"]
    assert new.execution == old.execution and new.reduce_dtype == old.reduce_dtype
    assert new.title == "NeMo 24.12 (Megatron-Core)"
