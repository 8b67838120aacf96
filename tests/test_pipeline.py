"""Pipeline parallelism (pp=, vpp=): the bubble and the sends by hand, the first stage's
memory by hand, the refusals, and pp=1 unchanged (docs/cost-model.md, "Pipeline parallelism")."""

from __future__ import annotations

import pytest
from amsp_testlib import assert_user_error, make_job, run_cli, small_model

from amsp_planner.cost.activations import block_bytes_per_token, rope_table_bytes
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.pipeline import stage_job
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy


def _job(gpus=8, layers=4, **kw):
    """small_model with `layers` blocks (h = 128) at seq 128 on `gpus` DGX-A100 GPUs."""
    return make_job(gpus, model=small_model(num_layers=layers), **kw)


def test_bubble_is_p_minus_1_over_m_of_the_stage_work():
    # 8 GPUs, pp=2: stages of 4 GPUs, DDP over 4 ranks; batch 16 sequences, mb=1: m = 4.
    # Narayanan et al. 2021 sec. 2.2.1: the bubble is (p-1)/m of the ideal time, i.e. of the
    # m micro-batches' forward and backward; interleaving with v chunks divides it by v.
    job = _job(batch_seqs=16)
    for vpp, want in ((1, 1 / 4), (2, 1 / 8)):
        e = evaluate(job, Strategy.parse(f"pp=2,vpp={vpp},mb=1" if vpp > 1 else "pp=2,mb=1"))
        t = e.time
        assert e.n_micro == 4
        assert (t.tp_comm_s, t.kernel_s, t.exposed_forward_s) == (0, 0, 0)
        assert t.bubble_s == pytest.approx(want * t.compute_s, rel=1e-12)


def test_sends_bytes_and_placement_by_hand():
    # Each micro-batch crosses a boundary forward (its activation) and backward (its gradient):
    # mb x seq x hidden x 2 bytes = 2 x 128 x 128 x 2 = 65,536 bytes per send; with v chunks
    # per rank v times as many: 2 v m sends per GPU and step (m = 16 / (4 DP x 2) = 2).
    job = _job(batch_seqs=16)
    for vpp in (1, 2):
        s = Strategy.parse("pp=2,mb=2" + (f",vpp={vpp}" if vpp > 1 else ""))
        (p2p,) = [x for x in evaluate(job, s).schedule if x.group == "PP"]
        assert p2p.calls_per_step == 2 * vpp * 2
        assert p2p.intra_bytes_per_rank_per_step == 2 * vpp * 2 * 65_536  # stages in one node
        assert p2p.inter_bytes_per_rank_per_step == 0
    # 16 GPUs, pp=2: a stage is a whole 8-GPU node, its neighbour the other one: the NIC
    e = evaluate(_job(16, batch_seqs=32), Strategy.parse("pp=2,mb=1"))
    (p2p,) = [x for x in e.schedule if x.group == "PP"]
    assert p2p.inter_bytes_per_rank_per_step == 2 * 4 * 32_768 and not p2p.intra_bytes_per_rank_per_step
    # tensor parallelism splits the send over the TP ranks (Megatron's sequence-parallel shard)
    e = evaluate(_job(16, batch_seqs=32), Strategy.parse("tp=2,pp=2,mb=1"))
    (p2p,) = [x for x in e.schedule if x.group == "PP"]
    assert p2p.inter_bytes_per_rank_per_step == 2 * 8 * 32_768 / 2


def test_first_stage_memory_by_hand():
    # llama-7b (32 blocks) on 16 GPUs, pp=2, DDP over 8 ranks of a stage, no checkpointing,
    # batch 64, mb=1: m = 8 >= p, so 1F1B's first stage holds p = 2 micro-batches of its 16
    # blocks; its parameters are the embedding and 16 blocks, in bf16 (padding < 1e-4).
    job = make_job(16, model=load_model("llama-7b"), seq_len=2048, batch_seqs=64)
    m = job.model
    e = evaluate(job, Strategy.parse("pp=2,mb=1"))
    first = m.embedding_params() + 16 * m.layer_params(0)
    assert e.memory.params == pytest.approx(2 * first, rel=1e-4)
    assert e.memory.grads == pytest.approx(2 * first, rel=1e-4)
    assert e.memory.optimizer == pytest.approx(12 * first, rel=1e-4)  # fp32 master + m + v
    sj = stage_job(job, Strategy(pp=2))
    one = 16 * block_bytes_per_token(sj) * 2048 + rope_table_bytes(sj)
    assert e.memory.activations == pytest.approx(2 * one, rel=1e-9)
    assert e.memory.loss_peak == 0  # the loss is the last stage's
    # interleaved (v = 2): p (1 + (p-1)/(p v)) = 2.5 micro-batches' worth (Narayanan sec. 2.2.2)
    e2 = evaluate(job, Strategy.parse("pp=2,vpp=2,mb=1"))
    assert e2.memory.activations == pytest.approx(2.5 * one, rel=1e-9)


@pytest.mark.parametrize("gpus, strategy, needle", [
    (16, "pp=3,mb=1", "pp=3 does not divide the 16 GPUs"),
    (24, "pp=2,mb=1", "stages of 12 GPUs, neither whole 8-GPU nodes"),
    (16, "pp=16,vpp=4,mb=1", "each (virtual) stage needs a block"),
    (16, "vpp=2,mb=1", "without pipeline stages"),
    (16, "pp=2,vpp=3,mb=1", "do not split evenly"),
    (16, "pp=2,pp.sched=interleaved-1f1b,mb=1", "needs vpp >= 2"),
    (16, "pp=2,pp.sched=zb,mb=1", "pp.sched=zb: use one of"),
])
def test_bad_pipeline_is_one_line_exit_2(gpus, strategy, needle):
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", str(gpus), "--strategy",
                              strategy, "--global-batch-seqs", "96", "-o", "-"])
    assert_user_error(code, out, err, needle)


def test_bad_pp_option_is_one_line_exit_2():
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "16", "--pp", "3", "-o", "-"])
    assert_user_error(code, out, err, "--pp 3", "does not divide")
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "16", "--pp", "two", "-o", "-"])
    assert_user_error(code, out, err, "--pp two")


def test_more_stages_than_blocks_refused():
    with pytest.raises(AmspUserError, match="each \\(virtual\\) stage needs a block"):
        evaluate(_job(16, layers=2, batch_seqs=32), Strategy.parse("pp=4,mb=1"))


def test_pp1_strategy_string_and_pricing_unchanged():
    s = Strategy.parse("tp=2,p=4,g=4,os=4,mb=1")
    assert str(s) == "tp=2,p=4,g=4,os=4,mb=1" and s.pp == 1
    assert "bubble_s" not in evaluate(_job(16, batch_seqs=32), s).time.to_dict()


def test_pipeline_plan_is_refused_by_the_runtime_and_other_exports(tmp_path):
    plan = tmp_path / "pp.json"
    code, out, err = run_cli(["plan", "--model", "llama-7b", "--gpus", "16", "--pp", "2",
                              "--engine", "megatron", "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["train", str(plan), "--steps", "1"])
    assert_user_error(code, out, err, "pp=2", "does not run pipeline parallelism")
    code, out, err = run_cli(["export", str(plan), "--to", "fsdp2", "-o", "-"])
    assert_user_error(code, out, err, "--to fsdp2", "pipeline parallelism")
    args = tmp_path / "megatron.sh"
    code, out, err = run_cli(["export", str(plan), "--to", "megatron", "-o", str(args)])
    assert code == 0 and "--pipeline-model-parallel-size 2" in args.read_text(), err


def test_tp_without_sequence_parallelism_by_hand():
    # sequence_parallel: false (Megatron before 2022): the two norms and the residual adds,
    # 28h + 6h = 34h elements of 2 bytes, 34 x 128 x 2 = 8,704 bytes per token forward, run
    # over every token on every TP rank: at t = 8 each rank reads 7/8 of them more than with
    # sequence parallelism; fused activations keep 2 LayerNorm inputs (2h a + 8 = 520 bytes
    # each) and the 2 matmul inputs after them (2h a = 256 each) whole: (2 x 520 + 2 x 256) x 7/8.
    from amsp_planner.cost.compute import block_compute

    gelu = small_model(num_layers=2, ffn_type="gelu", norm_type="layernorm", num_heads=8)
    sp = make_job(8, model=gelu, activation_profile="fused")
    nosp = make_job(8, model=gelu, activation_profile="fused", sequence_parallel=False)
    tokens = 2 * 128
    hbm = sp.cluster.gpu.hbm_gbyte_per_s * 1e9
    extra = tokens * 8_704 * 7 / 8 / hbm
    a, b = block_compute(sp, 2, False, tp=8), block_compute(nosp, 2, False, tp=8)
    assert b.forward - a.forward == pytest.approx(extra, rel=1e-9)
    assert b.backward - a.backward == pytest.approx(2 * extra, rel=1e-9)
    assert block_bytes_per_token(nosp, 8) - block_bytes_per_token(sp, 8) == pytest.approx(
        (2 * 520 + 2 * 256) * 7 / 8)
    assert block_compute(nosp, 2, False, tp=1) == block_compute(sp, 2, False, tp=1)


def _fitting(job, pp: int, usable: float) -> list:
    """Every candidate of the stage's space priced with `pp` stages (the brute force) that
    fits `usable` bytes."""
    from amsp_planner.solver.space import SearchSpace

    sj = stage_job(job, Strategy(pp=pp))
    fits = []
    for c in SearchSpace.for_job(sj).candidates(sj):
        try:
            e = evaluate(job, c.with_(pp=pp))
        except AmspUserError:
            continue
        if e.memory.total <= usable:
            fits.append(e)
    return fits


@pytest.mark.parametrize("usable_gib", [30, 60])
def test_pipeline_search_equals_brute_force(usable_gib):
    # the search bisects block checkpointing in each group of otherwise equal candidates; a
    # brute force over every candidate of the stage finds the same step time
    from amsp_planner.solver.pipeline_search import solve_pipeline

    job = make_job(32, model=load_model("llama-7b"), seq_len=2048, batch_seqs=128)
    usable = usable_gib * 2**30
    best = solve_pipeline(job, 2, None, usable)[0]
    fits = [e.step_s for e in _fitting(job, 2, usable)]
    assert fits and best.step_s == pytest.approx(min(fits), rel=1e-12)


@pytest.mark.parametrize("prefer", ["speed", "memory"])
def test_pipeline_search_chooses_by_the_planners_rule(prefer):
    # with the planner's rule (the band, least recompute, fewest groups, step, memory) the
    # search's choice is the rule's order over every fitting candidate of the stage
    from amsp_planner.solver.brute import preferred_order
    from amsp_planner.solver.pipeline_search import solve_pipeline
    from amsp_planner.solver.space import Preference

    job = make_job(32, model=load_model("llama-7b"), seq_len=2048, batch_seqs=128)
    pref = Preference.default(job=job, prefer=prefer)
    usable = 40 * 2**30
    got = solve_pipeline(job, 2, None, usable, preference=pref)[0]
    want = preferred_order(job, _fitting(job, 2, usable), "time", pref)[0]
    assert str(got.strategy) == str(want.strategy)


def _torchtitan_chunks(num_layers: int, chunks: int) -> list[int]:
    """Blocks per model chunk as torchtitan's generate_split_points places them
    (torchtitan/parallelisms/pipelining_utils.py at 9dec370): base = L // S in the first chunk,
    base + 1 in the middle ones while the remainder lasts, the rest in the last."""
    base, extra, sizes = num_layers // chunks, num_layers % chunks, []
    for i in range(chunks - 1):
        grow = i > 0 and extra > 0
        extra -= grow
        sizes.append(base + grow)
    return sizes + [num_layers - sum(sizes)]


def test_uneven_chunks_put_ceil_l_over_p_blocks_on_the_busiest_rank():
    """Rank r of an interleaved schedule holds chunks r, r + P, ...: under torchtitan's split
    and Megatron's (the embedding and the loss in a block's place) the busiest holds
    ceil(L/P) blocks, what the cost model prices (stage_blocks)."""
    from amsp_planner.strategy_pipeline import splits_into, stage_blocks

    for L in range(4, 130):
        for P in range(2, 9):
            for V in range(2, 5):
                if P * V > L:
                    continue
                c = _torchtitan_chunks(L, P * V)
                assert min(c) >= 1 and splits_into(L, P * V, "any")
                assert max(sum(c[r::P]) for r in range(P)) == stage_blocks(L, P), (L, P, V)
                if L % (P * V) and splits_into(L, P * V, "megatron"):
                    per = (L + 2) // (P * V)  # chunks of `per`, the first and last one fewer
                    m = [per - 1] + [per] * (P * V - 2) + [per - 1]
                    assert sum(m) == L
                    assert max(sum(m[r::P]) for r in range(P)) == stage_blocks(L, P), (L, P, V)
    assert _torchtitan_chunks(126, 16) == [7] + [8] * 14 + [7]  # the 405B rows' split


def test_interleaved_chunks_split_as_the_engine_splits_them(tmp_path):
    # 30 blocks, pp=4 x vpp=4 = 16 chunks: not even; Megatron's split (32 / 16 = 2 each, the
    # first and last one block and the embedding / the loss) and torchtitan's run it
    s = Strategy.parse("pp=4,vpp=4,mb=1")
    with pytest.raises(AmspUserError, match="do not split evenly"):
        evaluate(_job(32, layers=30, batch_seqs=64), s)
    for engine in ("megatron", "torchtitan"):
        e = evaluate(_job(32, layers=30, batch_seqs=64).for_engine(engine), s)
        assert e.step_s > 0
    # 29 blocks: neither 29 nor 31 divides into 16 chunks: Megatron refuses, naming both
    with pytest.raises(AmspUserError, match="divisor of 29 or of 31"):
        evaluate(_job(32, layers=29, batch_seqs=64).for_engine("megatron"), s)
    code, out, err = run_cli(["plan", "--model", "llama3-405b", "--gpus", "512", "--engine",
                              "megatron", "--strategy", "tp=8,pp=8,vpp=8,os=8,mb=1",
                              "--global-batch-seqs", "512", "--seq-len", "8192", "-o",
                              str(tmp_path / "p.json")])
    assert code == 0, err
    code, _, err = run_cli(["export", str(tmp_path / "p.json"), "--to", "megatron", "-o",
                            str(tmp_path / "m.sh")])
    assert code == 0, err
    out = (tmp_path / "m.sh").read_text()
    # 126 blocks + the embedding + the loss = 128 = 8 x 8 x 2: megatron/training/arguments.py
    for flag in ("--num-virtual-stages-per-pipeline-rank 8", "--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split"):
        assert flag in out
    assert "--num-layers-per-virtual-pipeline-stage" not in out


def test_a_given_pipeline_whose_batch_splits_only_over_a_stage_is_planned_and_read_back(
        tmp_path):
    # 64 GPUs, tp=8, pp=4: a stage's 16 GPUs are 2 data-parallel ranks, so 4 sequences are 2
    # micro-batches of 1 per rank; without stages the 8 ranks of tp=8 need a multiple of 8.
    import json

    out = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "-m", "llama3-70b", "-n", "64", "--engine", "megatron",
                            "--global-batch-seqs", "4", "--strategy",
                            "tp=8,pp=4,p=1,g=1,os=2,mb=1,ckpt", "-o", str(out)])
    assert code == 0, err
    assert "named baselines (pp=1) not priced" in err
    doc = json.loads(out.read_text())
    assert (doc["decision"]["pipeline"]["pp"], doc["decision"]["grad_accum"]) == (4, 2)
    assert doc["baselines"] == {}
    code, text, err = run_cli(["validate", str(out)])
    assert code == 0 and "valid amsp plan" in text, err
    code, text, err = run_cli(["explain", str(out), "--no-sensitivity"])
    assert code == 0 and "Traceback" not in err, err
    # the same batch without stages: refused in one line
    code, _, err = run_cli(["plan", "-m", "llama3-70b", "-n", "64", "--engine", "megatron",
                            "--global-batch-seqs", "4", "-o", "-"])
    assert code == 2 and "global batch of 4 sequences" in err, err


def test_a_pipeline_plan_is_explained_on_an_engine_that_runs_it_as_made(tmp_path):
    # megatron runs tp=8,pp=4 as made (so does its export); DeepSpeed, which runs neither TP
    # nor stages here, gets the closest data-parallel strategy. Megatron used to find "no
    # valid strategy", its candidates searched at the pipeline's accumulation
    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--model", "llama3-70b", "--gpus", "64", "--pp", "4",
                            "-o", str(plan)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(plan), "--engine", "megatron", "--no-sensitivity"])
    assert code == 0, err
    assert "runs tp=8,pp=4," in out and "the plan's strategy" in out.splitlines()[0]
    code, out, err = run_cli(["explain", str(plan), "--engine", "deepspeed",
                              "--no-sensitivity"])
    assert code == 0, err
    assert out.startswith("engine: deepspeed") and "the closest strategy it runs" in out
