"""A fused QKV projection (ModelSpec.fused_qkv: Megatron-LM's ``query_key_value``) as an engine
that gathers and reduces module by module sees it: one module, one weight and one bias."""

from __future__ import annotations

import dataclasses

import pytest
from amsp_testlib import make_job

from amsp_planner.cost.schedule import call_groups, on_demand, unit_elements
from amsp_planner.cost.unit_tensors import unit_tensor_counts, unit_tensors
from amsp_planner.specs import load_model
from amsp_planner.specs.model import ModelSpec

H = 20480  # the 530B model's width (Smith et al., arXiv 2201.11990): 105 layers, 128 heads


def gpt530(fused: bool) -> ModelSpec:
    return ModelSpec(name="gpt-530b", num_layers=105, hidden_size=H, num_heads=128,
                     ffn_hidden_size=4 * H, ffn_type="gelu", vocab_size=51200,
                     max_seq_len=2048, norm_type="layernorm", position_embedding="learned",
                     attention_bias="all", mlp_bias=True, fused_qkv=fused)


def late_share(model: ModelSpec) -> tuple[tuple[bool, ...], float]:
    """(on demand per gather call of a block, the on-demand calls' share of its bytes)."""
    job = make_job(640, model=model, seq_len=2048, batch_seqs=640).for_engine("deepspeed")
    # the coordinator's prefetch rule, priced where the prefetch overlaps (prefetch_overlap
    # on; DeepSpeed's profile waits for every gather: tests/test_deepspeed_azure_rows.py)
    job = dataclasses.replace(job, settings=(("prefetch_overlap", True),))
    u = unit_elements(job)[1]
    late = on_demand(job, 1, u)
    fr = [f for _, f in call_groups(job, "gather", 1, u)]
    return late, sum(f for f, d in zip(fr, late, strict=True) if d) / sum(fr)


def test_a_530b_block_with_fused_qkv_fetches_two_thirds_of_its_bytes_on_demand():
    # Gathered modules of a block (the two LayerNorms, 2 x 20480 < 1e5, are kept whole):
    # query_key_value 3h^2 + 3h = 1,258,352,640, dense h^2 + h = 419,450,880,
    # fc1 4h^2 + 4h = 1,677,803,520, fc2 4h^2 + h = 1,677,742,080: 5,033,349,120 in all.
    # stage3_max_live_parameters 1e9: the call after a module of 1e9 or more is fetched on
    # demand: qkv (after the previous block's fc2), dense (after qkv), fc2 (after fc1).
    qkv, o, fc1, fc2 = 3 * H * H + 3 * H, H * H + H, 4 * H * H + 4 * H, 4 * H * H + H
    assert (qkv, o, fc1, fc2) == (1_258_352_640, 419_450_880, 1_677_803_520, 1_677_742_080)
    late, share = late_share(gpt530(True))
    assert late == (True, True, False, True)
    assert share == pytest.approx((qkv + o + fc2) / (qkv + o + fc1 + fc2))
    assert share == pytest.approx(0.6667, abs=1e-4)
    # q, k and v apart (419M each, under 1e9): only q and fc2 wait, 2 of 6 calls, 41.7 %
    late, share = late_share(gpt530(False))
    assert late == (True, False, False, False, False, True)
    assert share == pytest.approx((o + fc2) / (qkv + o + fc1 + fc2))
    assert share == pytest.approx(0.4167, abs=1e-4)


def test_fusing_keeps_the_parameters_and_cuts_the_tensors():
    a, b = gpt530(False), gpt530(True)
    assert a.unit_params() == b.unit_params()
    assert [sum(t) for t in unit_tensors(b)] == [sum(t) for t in unit_tensors(a)]
    # a block: 2 LayerNorms (weight, bias each), q, k, v, o, fc1, fc2 and their 6 biases = 16;
    # fused: qkv, o, fc1, fc2 and 4 biases, the same norms = 12
    assert unit_tensor_counts(a) == (2, 16, 3)
    assert unit_tensor_counts(b) == (2, 12, 3)
    # GQA (Llama-3-8B shape): one (d_q + 2 d_kv) x h module, 4096 x (4096 + 2 x 1024)
    m = load_model("llama3-8b").model_copy(update={"fused_qkv": True})
    assert unit_tensors(m)[1][1] == 4096 * (4096 + 2 * 1024)


def test_the_default_module_list_is_unchanged():
    # LLaMA-7B: norm, q, k, v, o (4096^2 each), norm, gate, up, down (4096 x 11008 each)
    m = load_model("llama-7b")
    assert not m.fused_qkv
    a, f = 4096 * 4096, 4096 * 11008
    assert unit_tensors(m)[1] == (4096, a, a, a, a, 4096, f, f, f)
    assert unit_tensor_counts(m) == (1, 9, 2)
    assert "fused_qkv" not in m.model_dump()  # plan files and hashes as before


def test_fused_qkv_with_latent_attention_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="fused_qkv is set with kv_lora_rank"):
        ModelSpec(name="x", num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=128,
                  vocab_size=100, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, fused_qkv=True)


def test_the_deepspeed_host_times_are_the_fits_of_their_documented_procedure():
    # engines.REDUCE_HOST_US (the current profile, fitted to DeepSpeed 0.6.2's runs) and
    # engine_versions.GATHER_HOST_US_0_3_14 (fitted to the 2021 runs) stand in partly for what
    # the model lacks at scale (docs/cost-model.md); each is the least-squares fit over its
    # 175B rows that bench/fit_reduce_host.py prints, redone whenever the model moves them
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import fit_reduce_host

    from amsp_planner.engines import PROFILES
    from amsp_planner.validation import load_rows

    doc = load_rows()
    for key, (field, fit, _, _, _) in fit_reduce_host.TERMS.items():
        rows = fit_reduce_host.rows_of(doc, key)
        assert len([r for r in rows["rows"] if r["id"].startswith(fit)]) >= 3
        now = getattr(PROFILES[key].execution, field)
        assert now > 0

        def sq(us, key=key, rows=rows):
            return fit_reduce_host.sse(rows, us, key)

        # the value is a local least-squares minimum on the script's 0.5 us grid
        assert sq(now) <= sq(now - 0.5) and sq(now) <= sq(now + 0.5), key
        assert getattr(PROFILES[key].execution, field) == now  # restored after the fit
