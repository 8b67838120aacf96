"""The Megatron-Bridge rows of presets/validation.yaml (source megatron-bridge): their setup
against the published table (typed here from the source, not from the file), and the
megatron-bridge@<release> profiles that price them (amsp_planner/engine_versions.py).

Source: NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (0a25f91; 4ab94dfa for
the 26.02.01-26.06 sections), System DGX-H100; the performance configs at v0.2.0-v0.5.0."""

from __future__ import annotations

import pytest

from amsp_planner.engines import PROFILES, runs_as
from amsp_planner.strategy import parse_strategy_or_baseline
from amsp_planner.validation import load_rows, predict_rows

# release, GPUs, GBS, MBS, seq, FSDP, TP, PP, CP, VP, tokens/s/GPU (FP8-CS)
TABLE = {
    "mbridge2511-l31-405b-1024": ("0.2.0", 1024, 512, 1, 8192, 0, 8, 8, 2, 8, 292),
    "mbridge2602-l31-405b-1024": ("0.3.0", 1024, 1536, 1, 8192, 0, 8, 8, 2, 8, 311),
    "mbridge2511-l3-70b-64": ("0.2.0", 64, 128, 1, 8192, 0, 4, 8, 1, 5, 1602),
    "mbridge2602-l3-70b-64": ("0.3.0", 64, 256, 1, 8192, 0, 4, 8, 1, 5, 1621),
    # 26.02.01, 26.04, 26.04.01, 26.06 (precision "FP8": the H100 configs' FP8_CS_V2)
    "mbridge2602p1-l3-70b-64": ("0.3.1", 64, 256, 1, 8192, 0, 4, 8, 1, 5, 1639),
    "mbridge2604-l3-70b-64": ("0.4.0", 64, 256, 1, 8192, 0, 4, 8, 1, 5, 1633),
    "mbridge2604p1-l3-70b-64": ("0.4.1", 64, 256, 1, 8192, 0, 4, 8, 1, 5, 1664),
    "mbridge2604p1-l31-405b-1024": ("0.4.1", 1024, 1536, 1, 8192, 0, 8, 8, 2, 8, 328),
    "mbridge2606-l31-405b-1024": ("0.5.0", 1024, 1536, 1, 8192, 0, 8, 8, 2, 8, 326),
}


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in load_rows()["rows"] if r["source"] == "megatron-bridge"}


def test_rows_are_the_published_table(rows):
    assert set(TABLE) <= set(rows)
    for rid, (rel, gpus, gbs, mbs, seq, fsdp, tp, pp, cp, vp, tps) in TABLE.items():
        r = rows[rid]
        s = parse_strategy_or_baseline(r["strategy"], gpus, 8)
        assert (r["engine_version"], r["gpus"], r["global_batch_seqs"], r["seq_len"],
                r["value"]) == (rel, gpus, gbs, seq, tps), rid
        assert (s.micro_batch, s.tp, s.pp, s.cp, s.vpp) == (mbs, tp, pp, cp, vp), rid
        # FSDP 0: DDP with the distributed optimizer over the DP x CP ranks (no P or G shard)
        assert fsdp == 0 and (s.s_p, s.s_g, s.s_os) == (1, 1, gpus // (tp * pp)), rid
        t = r["training"]  # get_precision_config('fp8_cs'), grad_reduce_in_fp32 False
        assert (t["precision"], t["fp8_recipe"], t["fp8_all_gather"], t["grad_accum_dtype"],
                t["tp_overlap"], t["dp_overlap"]) == ("fp8", "tensorwise", "on", "bf16", True,
                                                      True), rid


def test_the_bridge_profiles_are_megatron_core_with_the_settings_of_the_configs():
    for key in {f"megatron-bridge@{v[0]}" for v in TABLE.values()}:
        p = PROFILES[key]
        assert runs_as(key) == "megatron"
        # Megatron-LM forces fp32 reduction with bf16; the bridge configs turn it off
        assert PROFILES["megatron"].reduce_dtype == "fp32" and p.reduce_dtype is None
        assert p.fused_elementwise and p.activation_profile == "fused"
        assert p.execution == PROFILES["megatron"].execution  # its DDP and buffers


def test_the_405b_chunks_need_megatrons_embedding_and_loss_split(rows):
    # 126 blocks over PP 8 x VP 8 = 64 chunks only with the embedding and the loss each in a
    # block's place (llama31_405b_pretrain_config: account_for_*_in_pipeline_split True)
    from amsp_planner.strategy_pipeline import splits_into

    assert not splits_into(126, 64, "even") and splits_into(126, 64, "megatron")
    res = {r.id: r for r in predict_rows({"rows": list(rows.values()), "sources": {}})}
    for rid in TABLE:
        assert res[rid].fits and res[rid].priced_as.startswith("megatron-bridge@"), rid
