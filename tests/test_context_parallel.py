"""Context parallelism (``cp=C``, cost/context_parallel.py), by hand: a rank's activations are
those of its s/C tokens, the exchange adds its buffers, the batch splits over N/(t C)
data-parallel ranks, and what cannot run it is refused in one line."""

from __future__ import annotations

import pytest
from amsp_testlib import run_cli

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.memory import memory
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import Strategy, parse_strategy_or_baseline


def _job(engine: str = "torchtitan", seq_len: int = 1024):
    """h 256, 8 heads of 32, 2 KV heads (d_kv 64), SwiGLU f 512, V 1000, 2 blocks, bf16, the
    fused profile; 8 GPUs of one node, 8 sequences per step."""
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_cluster
    from amsp_planner.specs.model import ModelSpec

    spec = ModelSpec(name="gqa", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2,
                     ffn_hidden_size=512, vocab_size=1000, max_seq_len=seq_len)
    t = TrainingSpec(seq_len=seq_len, global_batch_seqs=8, activation_profile="fused")
    return Job.create(spec, load_cluster("dgx-a100-hdr"), t, 8, engine)


# fused, full checkpointing, per token: the L block inputs 2 x 256 x 2, one block recomputed
# (6h + 2 d_kv + 3f) a_b + 4a = (1536 + 128 + 1536) x 2 + 32 = 6432, the head 2h a_b + 4V = 5024
PER_TOKEN = 2 * 512 + 6432 + 5024


def test_ring_attention_memory_by_hand():
    job = _job()
    full = memory(job, Strategy(s_p=8, s_g=8, s_os=8, ckpt=True))
    m = memory(job, Strategy(s_p=8, s_g=8, s_os=8, ckpt=True, cp=4))
    assert full.activations == PER_TOKEN * 1024  # one sequence of 1024 tokens per rank
    assert m.activations == PER_TOKEN * 256  # its 1024 / 4 tokens
    assert m.loss_peak == full.loss_peak == 0  # fused cross-entropy
    # torch's ring, backward: the gathered K, V of 4 ranks 2 x 4 x 64 x 2 = 1024, the fp32 dQ,
    # dK, dV accumulators 4 x 384 = 1536, one sub-SDPA's 384 x 2 = 768, the fp32 dK, dV sent
    # and received 2 x 8 x 64 = 1024: 4352 bytes per token of the rank
    assert m.cp_buffers == 4352 * 256
    # the model states are sharded over all 8 ranks either way (FSDP over dp_shard x cp)
    assert m.model_states == full.model_states and full.cp_buffers == 0
    assert "cp_buffers" not in full.to_dict() and m.to_dict()["cp_buffers"] == 4352 * 256


def test_ulysses_memory_by_hand():
    m = memory(_job("deepspeed"), Strategy(s_p=1, s_g=8, s_os=8, ckpt=True, cp=2))
    assert m.activations == PER_TOKEN * 512
    # the all-to-alls' inputs and outputs of q, k, v: 2 (256 + 128) x 2 bytes per token
    assert m.cp_buffers == 1536 * 512


def test_the_batch_splits_over_the_data_parallel_ranks_and_the_ring_is_priced():
    job = _job()
    e = evaluate(job, Strategy(s_p=8, s_g=8, s_os=8, cp=4))
    assert e.n_micro == 4  # 8 sequences over 8 / 4 = 2 data-parallel ranks, 1 per micro-batch
    ag = [x for x in e.schedule if x.group == "CP" and x.phase == "forward"]
    # one all-gather of K and V per block and micro-batch: 4 ranks x 2 x 64 x 2 B x 256 tokens
    assert [x.full_bytes_per_step for x in ag] == [4 * 2 * 4 * 2 * 64 * 2 * 256]
    assert e.time.cp_comm_s > 0 and "cp_comm_s" not in evaluate(
        job, Strategy(s_p=8, s_g=8, s_os=8)).time.to_dict()
    assert e.tokens_per_s == 8 * 1024 / e.step_s  # every token of the step, once


def test_strategy_string_and_baselines_carry_cp():
    s = parse_strategy_or_baseline("zero3,mb=1,ckpt,cp=2", 8, 8)
    assert (s.s_p, s.cp, str(s)) == (8, 2, "cp=2,p=8,g=8,os=8,mb=1,ckpt")
    assert Strategy.parse(str(s)) == s and Strategy().cp == 1
    with pytest.raises(ValueError, match="cp=3 does not divide"):
        Strategy(cp=3).check(8, 8)


@pytest.mark.parametrize(("engine", "seq", "s", "says"), [
    ("internevo", 1024, Strategy(cp=2), "InternEvo does not run context parallelism"),
    ("torchtitan", 1002, Strategy(cp=2), "multiple of 4"),
    ("deepspeed", 1024, Strategy(cp=4), "cp must divide the 8 query and 2 key/value heads"),
])
def test_what_cannot_run_cp_is_refused_in_one_line(engine, seq, s, says):
    with pytest.raises(AmspUserError, match=says) as e:
        _job(engine, seq).check(s)
    assert "\n" not in str(e.value)


def test_exports_and_the_runtime_refuse_cp(tmp_path):
    out = tmp_path / "p.json"
    args = ["plan", "-m", "llama3-8b", "-n", "8", "--engine", "torchtitan", "--seq-len", "8192",
            "--global-batch-seqs", "4", "--strategy", "zero3,mb=1,ckpt,cp=2", "-o", str(out)]
    code, _, err = run_cli(args)
    assert code == 0, err
    code, _, err = run_cli(["export", str(out), "--to", "torchtitan"])
    assert code == 2 and "cp=2" in err and len(err.strip().splitlines()) == 1
    from amsp_planner.runtime.support import check_tp

    with pytest.raises(AmspUserError, match="does not run context parallelism"):
        check_tp(Strategy(cp=2), _job())


def test_a_cp_plan_is_version_5_and_reads_back(tmp_path):
    import json

    from amsp_planner.plan import load_plan

    out = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "-m", "llama3-8b", "-n", "8", "--engine", "torchtitan",
                            "--seq-len", "8192", "--global-batch-seqs", "4", "--strategy",
                            "zero3,mb=1,ckpt,cp=2", "-o", str(out)])
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert (doc["version"], doc["decision"]["cp"], doc["decision"]["grad_accum"]) == (5, 2, 1)
    assert load_plan(out).strategy.cp == 2


def test_a_batch_that_splits_only_over_the_cp_ranks_is_planned_read_back_and_explained(
        tmp_path):
    # 16 GPUs (2 nodes), cp=16: one data-parallel rank, so 1 sequence per step is ga 1; without
    # cp the fewest data-parallel ranks are 2 (tp=8, the most a node holds). It used to be
    # refused by the batch check, and a plan of it crashed `explain`'s re-solve (no strategy
    # without cp splits the batch).
    import json

    out = tmp_path / "p.json"
    argv = ["plan", "-m", "llama3-8b", "-n", "16", "--engine", "torchtitan", "--seq-len",
            "65536", "--global-batch-seqs", "1"]
    code, _, err = run_cli([*argv, "--strategy", "zero3,mb=1,ckpt,cp=16", "-o", str(out)])
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert (doc["decision"]["cp"], doc["decision"]["grad_accum"]) == (16, 1)
    code, text, err = run_cli(["validate", str(out)])
    assert code == 0 and "valid amsp plan" in text, err
    code, text, err = run_cli(["explain", str(out), "--no-sensitivity"])
    assert code == 0 and "Traceback" not in err, err
    assert "binding constraint" in text
    # without cp the same batch is still refused in one line
    code, _, err = run_cli([*argv, "-o", "-"])
    assert code == 2 and "global batch of 1 sequences" in err, err
