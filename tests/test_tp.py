"""Tensor (+ sequence) parallelism inside the node (issue #14): the layout and schedule derived
by hand for t = 2 and t = 8 on two 8-GPU nodes, memory and FLOPs per GPU by hand, the planner's
choices, the plan file, the exports, and the one-line refusals."""

from __future__ import annotations

import json

import pytest
from amsp_testlib import assert_user_error, run_cli

from amsp_planner.cost.activations import block_bytes_per_token
from amsp_planner.cost.compute import block_compute, head_compute
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

# LLaMA-7B: h, f, V, L, heads (MHA: kv = h)
H, F, V, L, A = 4096, 11008, 32000, 32, 32
SEQ = 2048


def job_7b(gpus=16, batch=16, cluster="dgx-h100-ndr", **train):
    t = TrainingSpec(seq_len=SEQ, global_batch_seqs=batch, **train)
    return Job.create(load_model("llama-7b"), load_cluster(cluster), t, gpus)


def pad(x: int, q: int) -> int:
    return -(-x // q) * q


def units_by_hand(t: int, n: int = 16) -> tuple[int, int, int]:
    """(embedding, block, head) elements one TP rank holds: 1/t of every matrix, the two
    RMSNorm weights of a block and the final norm whole; padded to (N/t) x 256."""
    q = n // t * 256
    return (pad(V * H // t, q), pad((4 * H * H + 3 * H * F) // t + 2 * H, q),
            pad(V * H // t + H, q))


def entries(e):
    return {(x.phase, x.op, x.group): x for x in e.schedule}


def schedule_of(text: str, t: int):
    """(phase, op, group) -> entry of strategy `text` on the 16-GPU job, and Phi by hand."""
    emb, blk, head = units_by_hand(t)
    return entries(evaluate(job_7b(), Strategy.parse(text))), emb + L * blk + head


def check_entry(x, size, stride, per_node, calls, full, intra_frac, inter_frac):
    """One schedule entry against its hand-derived values; intra/inter: fractions of full."""
    assert (x.group_size, x.stride, x.members_per_node) == (size, stride, per_node)
    assert x.calls_per_step == calls
    assert x.full_bytes_per_step == full
    assert x.intra_bytes_per_rank_per_step == pytest.approx(intra_frac * full, rel=1e-12)
    assert x.inter_bytes_per_rank_per_step == pytest.approx(inter_frac * full, rel=1e-12)


def check_zero3_entries(got, size, stride, per_node, full, intra_frac, inter_frac):
    """ZeRO-3's three per-micro-batch entries (2 micro-batches of the 34 units)."""
    for key in (("forward", "all_gather", "P"), ("backward", "all_gather", "P"),
                ("backward", "reduce_scatter", "G")):
        check_entry(got[key], size, stride, per_node, 2 * (L + 2), full, intra_frac, inter_frac)


def check_tp_entries(got, t, mb, n_micro, ckpt_blocks=0):
    """The TP collectives by hand: per block and micro-batch, forward 2 all-gathers + 2
    reduce-scatters of b*s*h bf16 elements, backward the same again, the recomputed forward
    of each checkpointed block the forward's again; the head's all-gather (before the LM head)
    and the embedding's reduce-scatter (the vocabulary-parallel lookup) in forward, their
    transposes in backward; one all-reduce of the replicated norm weights' gradients per unit
    that has them (32 blocks of 2h, the head's h)."""
    act = mb * SEQ * H * 2
    ring = (t - 1) / t
    per_mb = 2 * L + 1
    for phase, op in (("forward", "all_gather"), ("forward", "reduce_scatter"),
                      ("backward", "all_gather"), ("backward", "reduce_scatter")):
        check_entry(got[phase, op, "TP"], t, 1, t, n_micro * per_mb, n_micro * per_mb * act,
                    ring, 0.0)
    for op in ("all_gather", "reduce_scatter"):
        if ckpt_blocks:
            check_entry(got["recompute", op, "TP"], t, 1, t, n_micro * 2 * ckpt_blocks,
                        n_micro * 2 * ckpt_blocks * act, ring, 0.0)
        else:
            assert ("recompute", op, "TP") not in got
    norms = (L * 2 * H + H) * 2
    check_entry(got["backward", "all_reduce", "TP"], t, 1, t, n_micro * (L + 1),
                n_micro * norms, 2 * ring, 0.0)
    # the vocabulary-parallel cross-entropy: 3 all-reduces of b*s fp32 values per micro-batch
    check_entry(got["forward", "all_reduce", "TP"], t, 1, t, n_micro * 3,
                n_micro * 3 * mb * SEQ * 4, 2 * ring, 0.0)


def test_tp2_zero3_schedule_by_hand():
    # 16 GPUs = 2 nodes x 8; t = 2: TP groups {0,1}, {2,3}, ...; 8 data-parallel ranks, 4 per
    # node; data-parallel rank d = global ranks 2d, 2d+1, so a DP group of the same TP index
    # is 8 ranks at stride 2: 4 per node, 2 nodes
    job = job_7b()
    e = evaluate(job, Strategy.parse("tp=2,p=8,g=8,os=8,mb=1"))
    assert e.n_micro == 2  # 16 sequences / (8 DP ranks x 1)
    emb, blk, head = units_by_hand(2)
    assert job.tp_units(2) == (emb,) + (blk,) * L + (head,)
    phi = emb + L * blk + head
    got = entries(e)
    # 2 micro-batches x the TP shard in bf16; hierarchical split: intra (k-1)/k, inter
    # (g-1)/g / k with k = 4 per node, g = 2 nodes
    check_zero3_entries(got, 8, 2, 4, 2 * phi * 2, 3 / 4, 1 / 8)
    check_tp_entries(got, 2, 1, 2)
    assert set(got) == {("forward", "all_gather", "P"), ("backward", "all_gather", "P"),
                        ("backward", "reduce_scatter", "G"), ("forward", "all_gather", "TP"),
                        ("forward", "reduce_scatter", "TP"), ("backward", "all_gather", "TP"),
                        ("backward", "reduce_scatter", "TP"), ("backward", "all_reduce", "TP"),
                        ("forward", "all_reduce", "TP"), ("update", "all_reduce", "world")}
    assert got["update", "all_reduce", "world"].group_size == 16


def test_tp8_zero3_schedule_by_hand_with_checkpointing():
    # t = 8: one TP group per node, 2 data-parallel ranks (one per node): the P group is the
    # 2 ranks at stride 8, all of its bytes leave the node
    got, phi = schedule_of("tp=8,p=2,g=2,os=2,mb=4,ckpt", 8)  # 16 seqs / (2 x 4): 2 micro-batches
    check_zero3_entries(got, 2, 8, 1, 2 * phi * 2, 0.0, 1 / 2)
    check_tp_entries(got, 8, 4, 2, ckpt_blocks=L)


def test_tp2_amsp_point_schedule_by_hand():
    # p=1, g=4 (one node of DP ranks), os=8 (both nodes): the G group is 4 DP ranks at stride 2
    # in one node; the step reduce-scatter runs among the 2 OS ranks holding the same G shard
    # (DP stride 4 -> global stride 8: one per node); the update all-gather over the 8 OS
    # ranks sharing the P shard (DP stride 1 -> global stride 2)
    got, phi = schedule_of("tp=2,p=1,g=4,os=8,mb=1", 2)
    check_entry(got["backward", "reduce_scatter", "G"], 4, 2, 4, 2 * (L + 2), 2 * phi * 2,
                3 / 4, 0.0)
    check_entry(got["grad_sync", "reduce_scatter", "OS_shard"], 2, 8, 1, L + 2,
                phi // 4 * 2, 0.0, 1 / 2)
    check_entry(got["update", "all_gather", "P_update"], 8, 2, 4, L + 2, phi * 2, 3 / 4, 1 / 8)
    assert ("forward", "all_gather", "P") not in got
    assert ("grad_sync", "all_reduce", "OS_replica") not in got
    check_tp_entries(got, 2, 1, 2)


def test_tp8_amsp_point_schedule_by_hand():
    # ZeRO-1 over the 2 DP ranks: the step reduce-scatter and the update all-gather run
    # between the two nodes (global stride 8), once per step
    got, phi = schedule_of("tp=8,p=1,g=1,os=2,mb=4,ckpt=10", 8)
    check_entry(got["grad_sync", "reduce_scatter", "OS_shard"], 2, 8, 1, L + 2, phi * 2,
                0.0, 1 / 2)
    # the gathered tensor is the whole P shard (s_P = 1: the TP shard of the unit)
    check_entry(got["update", "all_gather", "P_update"], 2, 8, 1, L + 2, phi * 2, 0.0, 1 / 2)
    check_tp_entries(got, 8, 4, 2, ckpt_blocks=10)


def test_memory_per_gpu_by_hand():
    # tp=2 ZeRO-3 over 8 DP ranks, mb=1, eager bf16, no checkpointing
    job = job_7b()
    e = evaluate(job, Strategy.parse("tp=2,p=8,g=8,os=8,mb=1"))
    emb, blk, head = units_by_hand(2)
    phi = emb + L * blk + head
    m = e.memory
    assert m.params == phi / 8 * 2 and m.grads == phi / 8 * 2
    assert m.optimizer == phi / 8 * 12
    assert m.gather_buffers == 2 * blk * 2 and m.grad_buffers == 2 * blk * 2
    # eager saved bytes per token (docs/memory.md): RMSNorm 4h + 4 + 2h*2; attention (MHA)
    # QKV 3h*2, RoPE q,k 2h*2, attention output + merged copy 2h*2, log-sum-exp 4a; SwiGLU 4f*2
    norm = 4 * H + 4 + 2 * H * 2
    block = 2 * norm + 3 * H * 2 + 2 * H * 2 + 2 * H * 2 + 4 * A + 4 * F * 2
    # t = 2 with SP: everything halved but the gathered inputs of QKV and the MLP (h*2 each,
    # kept whole), the head's gathered LM-head input and the int64 ids and targets
    block2 = block / 2 + 2 * (H * 2) / 2
    head2 = (norm + 4 * V) / 2 + H * 2 / 2 + 16
    assert m.activations == pytest.approx(SEQ * (L * block2 + head2) + SEQ * 128 * 2, rel=1e-12)
    assert m.loss_peak == pytest.approx(8 * V * SEQ / 2, rel=1e-12)


def test_fused_activations_divide_by_t_as_korthikanti_says():
    # Korthikanti et al. 2022 section 4.2.2: with sequence parallelism every activation of a
    # block is divided by the TP degree
    job = job_7b(activation_profile="fused")
    for t in (2, 4, 8):
        assert block_bytes_per_token(job, t) == pytest.approx(block_bytes_per_token(job) / t)


def test_flops_per_gpu_by_hand():
    # on CPU processes (no HBM roofline, no kernel overhead) a block's forward is its FLOPs /
    # (peak x achievable): 2T(4h^2 + 3hf)/t matmuls + 2T s h / t attention per TP rank
    job = job_7b(gpus=8, batch=8, cluster="cpu-local")
    rate = 0.05e12 * 0.5
    T = 2 * SEQ
    for t in (1, 2, 4):
        fwd = (2 * T * (4 * H * H + 3 * H * F) + 2 * T * SEQ * H) / t
        got = block_compute(job, 2, False, t)
        assert got.forward * rate == pytest.approx(fwd, rel=1e-12)
        bwd = (2 * 2 * T * (4 * H * H + 3 * H * F) + 2.5 * 2 * T * SEQ * H) / t
        assert got.backward * rate == pytest.approx(bwd, rel=1e-12)
        assert head_compute(job, 2, t).forward * rate == pytest.approx(2 * T * H * V / t)


def test_tp_is_on_the_critical_path_and_reported_apart():
    job = job_7b()
    e = evaluate(job, Strategy.parse("tp=2,p=8,g=8,os=8,mb=1"))
    tp = sum(x.time_s for x in e.schedule if x.group == "TP")
    assert e.time.tp_comm_s == pytest.approx(tp) and tp > 0
    assert e.time.step_s == pytest.approx(e.time.compute_s + e.time.kernel_s
                                          + e.time.optimizer_s + e.time.contention_s
                                          + e.time.exposed_forward_s + e.time.exposed_backward_s
                                          + e.time.exposed_update_s + tp)
    assert "tp_comm_s" not in evaluate(job, Strategy.parse("p=16,g=16,os=16,mb=1")).time.to_dict()


def test_the_string_form_and_groups():
    s = Strategy.parse("tp=8,p=32,g=32,os=32,mb=1")
    assert str(s) == "tp=8,p=32,g=32,os=32,mb=1" and s.tp == 8
    assert str(Strategy.parse("p=8,g=8,os=8,mb=1")) == "p=8,g=8,os=8,mb=1"
    assert s.mesh("p", 8) == (1, 32)  # one DP rank per node, 32 nodes
    with pytest.raises(ValueError, match="tp=16 does not divide the 8 GPUs per node"):
        Strategy.parse("tp=16,p=1,g=1,os=1,mb=1").check(256, 8)


@pytest.mark.parametrize("argv,needle", [
    (["plan", "-m", "llama-7b", "-n", "64", "--tp", "3"], "--tp 3: tensor parallelism stays"),
    (["plan", "-m", "llama-7b", "-n", "64", "--tp", "x"], "--tp x: use auto"),
    (["plan", "-m", "llama-7b", "-n", "64", "--strategy", "tp=16,p=4,g=4,os=4,mb=1"],
     "tp=16 does not divide the 8 GPUs per node"),
    (["plan", "-m", "tiny", "-n", "8", "--tp", "4", "-c", "cpu-local"], "--tp 4: 4 does not divide"),
    (["plan", "-m", "llama-7b", "-n", "64", "--engine", "deepspeed", "--tp", "2"],
     "--tp 2: DeepSpeed 0.19 does not run it"),
])
def test_bad_tp_is_one_line_exit_2(argv, needle):
    assert_user_error(*run_cli([*argv, "-o", "-"]), needle)


def plan_doc(*argv):
    code, out, err = run_cli(["plan", *argv, "--json", "-o", "-"])
    assert code == 0, err
    return json.loads(out)


def test_plan_file_carries_tp_in_version_3_and_loads(tmp_path):
    from amsp_planner.plan import load_plan

    path = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "-m", "llama-7b", "-n", "64", "--strategy",
                            "tp=2,p=32,g=32,os=32,mb=1", "-o", str(path)])
    assert code == 0, err
    doc = json.loads(path.read_text())
    assert doc["version"] == 3 and doc["decision"]["tp"] == 2
    assert doc["decision"]["components"]["p"]["mesh"] == [4, 8]  # 4 DP ranks per node
    p = load_plan(path)
    assert p.strategy.tp == 2
    doc1 = plan_doc("-m", "llama-7b", "-n", "64", "--tp", "1")
    assert doc1["version"] in (1, 2) and "tp" not in doc1["decision"]


def test_train_refuses_what_the_runtime_does_not_run_with_tp_in_one_line(tmp_path):
    path = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "-m", "tiny", "-n", "4", "-c", "cpu-local", "--strategy",
                            "tp=2,p=2,g=2,os=2,mb=1", "--seq-len", "31",
                            "--global-batch-seqs", "8", "-o", str(path)])
    assert code == 0, err
    assert_user_error(*run_cli(["train", str(path), "--steps", "1"]),
                      "plan has tp=2 but seq_len 31 is not a multiple of 2: the bundled runtime "
                      "splits the vocabulary, the MLP and the sequence evenly over the TP ranks")


def test_preflight_checks_tp_without_torch():
    from amsp_planner.errors import AmspUserError
    from amsp_planner.runtime.preflight import check_tp

    check_tp(Strategy())
    check_tp(Strategy(tp=2, s_p=8, s_g=8, s_os=8, qwz=True, qgz=True, hpz=2, ckpt_op=True))
    t = TrainingSpec(seq_len=30, global_batch_seqs=8, precision="fp32")
    job = Job.create(load_model("tiny"), load_cluster("cpu-local"), t, 4)
    with pytest.raises(AmspUserError, match="plan has tp=4 but seq_len 30 is not a multiple of 4"):
        check_tp(Strategy(tp=4), job)


def test_the_planner_takes_tp_where_it_wins_and_explain_says_why(tmp_path):
    # GPT-3 175B on 1024 A100 (seq 2048, 4M tokens): data parallel only, the planner's rule
    # must checkpoint activations; with TP + SP the activations shrink by the degree and the
    # plan it chooses checkpoints less (tests/golden/llama2-70b_dgx-h100-ndr_512.json holds
    # tp=8 for Llama-2-70B on 512 H100, and tests/golden/llama-7b_dgx-a100-hdr_1024.json tp=1
    # for LLaMA-7B on 1024 GPUs)
    from amsp_planner.cost.compute import recompute_s
    from amsp_planner.plan import load_plan
    from amsp_planner.report.explain import explain_plan

    path = tmp_path / "gpt3.json"
    code, _, err = run_cli(["plan", "-m", "gpt3-175b", "-n", "1024", "--seq-len", "2048",
                            "-o", str(path)])
    assert code == 0, err
    p = load_plan(path)
    s = p.strategy
    assert s.tp > 1
    facts = explain_plan(p, sensitivity=False)
    others = {r["tp"]: r for r in facts["tensor_parallel"]["others"]}
    assert facts["tensor_parallel"]["chosen"] == s.tp and 1 in others
    dp_only = Strategy.parse(others[1]["strategy"])
    assert dp_only.tp == 1 and dp_only.ckpt_value  # data parallel only checkpoints
    job = p.job
    assert (recompute_s(job, s.micro_batch, s.ckpt_value, s.tp)
            < recompute_s(job, dp_only.micro_batch, dp_only.ckpt_value))
    assert any(line.startswith(f"tensor parallelism: tp={s.tp} chosen") for line in facts["lines"])


def test_the_searched_degrees_split_the_mlp_and_the_sequence_evenly():
    """Column-sharded gate/up need t | ffn; sequence parallelism needs t | seq_len: a degree
    that leaves a remainder is not searched (it would be refused by the runtime, and no
    engine splits unevenly)."""
    cluster = load_cluster("dgx-a100-hdr")
    base = load_model("llama-7b")

    def tps(model, seq_len=2048):
        t = TrainingSpec(seq_len=seq_len, global_batch_seqs=1024)
        return Job.create(model, cluster, t, 64).tp_options()

    assert tps(base) == (1, 2, 4, 8)
    assert tps(base.model_copy(update={"ffn_hidden_size": 11004})) == (1, 2, 4)  # 11004 = 4 x 2751
    assert tps(base, seq_len=2046) == (1, 2)  # 2046 = 2 x 1023
