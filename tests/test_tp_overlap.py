"""TP communication overlapped with the matmuls (``tp_overlap``, cost/tp_overlap.py) and
Megatron's opt-in data-parallel overlaps (``dp_overlap``): the pipelined rule against a
brute-force event simulation, a TP all-gather of known bytes behind a matmul of known FLOPs
by hand, the Megatron values against Megatron-LM's own text, the exports, and the one-line
refusals."""

from __future__ import annotations

import pytest
from amsp_testlib import assert_user_error, run_cli

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.cost.tp_overlap import pipelined_cost
from amsp_planner.engines import PROFILES
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy


def simulate(comm: float, matmul: float, t: int, gather: bool) -> float:
    """Brute force: the chunk pipeline event by event (one copy stream, one compute stream,
    no slowdown). All-gather: chunk 0 is local; transfer k (k = 1..t-1) runs after transfer
    k - 1; chunk k computes once transfer k is in and chunk k - 1 is done. Reduce-scatter:
    the t - 1 remote chunks are produced first, each sent when produced and the link free;
    the local chunk last."""
    x, c = comm / (t - 1), matmul / t
    if gather:
        arrived, done = [0.0], 0.0
        for _ in range(1, t):
            arrived.append(arrived[-1] + x)
        for k in range(t):
            done = max(done, arrived[k]) + c
        return done
    produced, link = 0.0, 0.0
    for _ in range(t - 1):
        produced += c
        link = max(link, produced) + x
    return max(produced + c, link)


@pytest.mark.parametrize("comm,matmul,t", [(3.0, 8.0, 4), (12.0, 8.0, 4), (1.0, 1.0, 8),
                                           (0.2, 5.0, 2), (7.0, 0.5, 8), (4.0, 4.0, 2)])
def test_the_rule_is_the_chunk_pipeline(comm, matmul, t):
    for gather in (True, False):
        assert matmul + pipelined_cost(comm, matmul, t, 0.0) == pytest.approx(
            simulate(comm, matmul, t, gather))


def test_the_rule_by_hand():
    # compute-bound: every transfer hidden, the matmul slowed by sigma per second under it
    assert pipelined_cost(3e-3, 8e-3, 4, 0.1) == pytest.approx(0.1 * 3e-3)
    # communication-bound: all transfers, then the last chunk's 2 ms: 12 + 2 - 8 = 6 ms
    assert pipelined_cost(12e-3, 8e-3, 4, 0.1) == pytest.approx(6e-3)


def job_8b(tp_overlap: bool, engine: str = "torchtitan", **kw) -> Job:
    t = TrainingSpec(seq_len=8192, global_batch_seqs=8, tp_overlap=tp_overlap, **kw)
    return Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"), t, 8, engine)


def test_a_tp_all_gather_behind_its_matmul_by_hand():
    # Llama-3-8B, TP 8 on one DGX H100, one sequence of 8192 tokens: the forward all-gather
    # before attention moves 8192 x 4096 bf16 = 64 MiB and feeds the QKV projection, one TP
    # rank's (4096 x (512 + 2 x 128)), priced as cost/compute.py prices the block (one
    # matmul of the summed width); the one before the MLP feeds w1 and w3 (4096 x 1792
    # each). Their seconds by hand, the roofline: max(2 T K N / (peak x achievable),
    # 2 (T K + K N + T N) bytes / HBM) + t0.
    s = Strategy(s_p=1, s_g=1, s_os=1, micro_batch=1, tp=8)
    off, on = (evaluate(job_8b(f), s) for f in (False, True))
    job = job_8b(True)
    gpu, T = job.cluster.gpu, 8192
    rate = gpu.peak_flop_per_s("bf16") * gpu.achievable_fraction
    t0 = gpu.kernel_overhead_us * 1e-6

    def mm(k, n):
        return max(2 * T * k * n / rate,
                   2 * (T * k + k * n + T * n) / (gpu.hbm_gbyte_per_s * 1e9)) + t0

    qkv = mm(4096, 768)
    fc1 = 2 * mm(4096, 1792)
    c = job.topology.collective_time("all_gather", 8, 1, 8192 * 4096 * 2)
    sigma = gpu.comm_compute_slowdown
    want = sum(max(m + sigma * c, c + m / 8) - m for m in (qkv, fc1))
    ag = {(e.phase, e.op): e for e in on.schedule if e.group == "TP"}
    assert ag["forward", "all_gather"].unit_time_s[1] == pytest.approx(want, rel=1e-12)
    # exposed, the same entry costs its two calls whole
    ag_off = {(e.phase, e.op): e for e in off.schedule if e.group == "TP"}
    assert ag_off["forward", "all_gather"].unit_time_s[1] == pytest.approx(2 * c, rel=1e-12)
    # one rank per data-parallel group: nothing else overlaps, so the step gains exactly
    # what the TP entries lose
    assert off.step_s - on.step_s == pytest.approx(off.time.tp_comm_s - on.time.tp_comm_s,
                                                   rel=1e-9)
    assert on.time.tp_comm_s < off.time.tp_comm_s


def test_the_embedding_head_and_loss_collectives_stay_exposed():
    s = Strategy(s_p=1, s_g=1, s_os=1, micro_batch=1, tp=8)
    off, on = (evaluate(job_8b(f), s) for f in (False, True))
    for a, b in zip((e for e in off.schedule if e.group == "TP"),
                    (e for e in on.schedule if e.group == "TP"), strict=True):
        assert (a.unit_time_s[0], a.unit_time_s[2]) == (b.unit_time_s[0], b.unit_time_s[2])
        if a.op == "all_reduce":
            assert a.time_s == b.time_s


def test_tp_overlap_is_off_unless_asked_and_left_out_of_the_plan_file():
    t = TrainingSpec()
    assert t.tp_overlap is False and "tp_overlap" not in t.model_dump()
    assert TrainingSpec(tp_overlap=True).model_dump()["tp_overlap"] is True


def test_a_bad_tp_overlap_value_is_one_line():
    assert_user_error(*run_cli(["compare", "--model", "llama-7b", "--gpus", "8",
                                "--tp-overlap", "sometimes"]), "--tp-overlap", "sometimes")


# ----- Megatron: its values against Megatron-LM's text --------------------------------------
# megatron/core/distributed/distributed_data_parallel_config.py at f2e5db4 (r0.8.0):
#     overlap_grad_reduce: bool = False
#     """If true, overlap grad all-reduce / reduce-scatter with backward compute."""
#     bucket_size: Optional[int] = None
#     """... If unspecified, MCore uses a default value of max(40000000, 1000000 * dp_size)"""
# megatron/core/optimizer/optimizer_config.py at f2e5db4:
#     overlap_param_gather: bool = False
#     """If true, overlap param all-gather with forward compute in distributed optimizer."""
# megatron/training/arguments.py at f2e5db4:
#     if args.overlap_param_gather:
#         assert args.use_distributed_optimizer, ...
#         assert args.overlap_grad_reduce, ...
#     if args.tp_comm_overlap:
#         assert args.sequence_parallel == True, ...
MEGATRON = {"overlap_grad_reduce": False, "overlap_param_gather": False,
            "bucket_size": lambda dp: max(40000000, 1000000 * dp)}


def test_megatron_overlaps_are_its_opt_in_flags():
    ex = PROFILES["megatron"].execution
    assert ex.sync_overlap is MEGATRON["overlap_grad_reduce"]
    assert ex.update_overlap is MEGATRON["overlap_param_gather"]
    for dp in (8, 48, 1024):
        assert ex.reduce_elements(dp) == MEGATRON["bucket_size"](dp)
    assert ex.overlap_flags.split() == ["--overlap-grad-reduce", "--overlap-param-gather"]
    on = ex.overlapped()
    assert on.sync_overlap and on.update_overlap and on.reduce_bucket == ex.reduce_bucket
    assert ex.source("overlap_flags")


def mlm(dp_overlap: bool, gpus=96, batch=192, **kw) -> Job:
    t = TrainingSpec(seq_len=4096, global_batch_seqs=batch, dp_overlap=dp_overlap, **kw)
    return Job.create(load_model("llama-7b"), load_cluster("dgx-h100-ndr"), t, gpus,
                      "megatron")


def test_overlap_param_gather_hides_all_but_the_first_bucket_behind_the_forward():
    # one micro-batch of 4 sequences: its forward is far longer than the update's gather,
    # so only the first bucket (one call) stays exposed, and the forward is slowed by sigma
    # per second of the rest
    s = Strategy(s_p=1, s_g=1, s_os=48, micro_batch=2, tp=2)
    off, on = evaluate(mlm(False), s), evaluate(mlm(True), s)
    gather = [e for e in on.schedule if e.phase == "update" and e.op == "all_gather"]
    assert len(gather) == 1 and gather[0].calls_per_step > 1
    u, first = gather[0].time_s, gather[0].time_s / gather[0].calls_per_step
    rest = sum(e.time_s for e in on.schedule if e.phase == "update") - u
    assert on.time.exposed_update_s == pytest.approx(first + rest, rel=1e-12)
    assert off.time.exposed_update_s == pytest.approx(u + rest, rel=1e-12)
    slowed = mlm(True).cluster.gpu.comm_compute_slowdown * (u - first)
    assert on.time.contention_s >= slowed - 1e-12
    # overlap-grad-reduce: the reduce-scatter no longer runs whole after backward
    assert on.time.exposed_backward_s < off.time.exposed_backward_s


def test_dp_overlap_needs_an_engine_with_the_switch():
    t = TrainingSpec(seq_len=4096, global_batch_seqs=64, dp_overlap=True)
    with pytest.raises(AmspUserError, match="dp_overlap: .* drop dp_overlap"):
        Job.create(load_model("llama-7b"), load_cluster("dgx-h100-ndr"), t, 64, "fsdp2")


def test_exports_carry_the_overlaps():
    from amsp_planner.exports import megatron, torchtitan

    s = Strategy(s_p=1, s_g=1, s_os=48, micro_batch=1, tp=2)
    job = mlm(True, tp_overlap=True)
    r = megatron.export(job, s)
    assert "--tp-comm-overlap" in r.text
    assert "--overlap-grad-reduce" in r.text and "--overlap-param-gather" in r.text
    got = megatron.check(r.text, 96, 192)
    assert got["tp_overlap"] and got["dp_overlap"]
    bad = r.text.replace("    --use-distributed-optimizer \\\n", "")
    with pytest.raises(ValueError, match="--overlap-param-gather: needs"):
        megatron.check(bad, 96, 192)
    assert "--tp-comm-overlap" not in megatron.export(mlm(True), s).text
    tt = torchtitan.export(job_8b(True), Strategy(s_p=1, s_g=1, s_os=1, micro_batch=1, tp=8))
    assert "--compile.enable-async-tensor-parallel" in tt.text and "--compile.enable" in tt.text
    doc = torchtitan.check(tt.text, 8)
    assert doc["tp_flags"]["enable_async_tensor_parallel"] is True
    plain = torchtitan.export(job_8b(False), Strategy(s_p=1, s_g=1, s_os=1, micro_batch=1, tp=8))
    assert "--compile.no-enable-async-tensor-parallel" in plain.text



@pytest.mark.parametrize("model,cluster,engine,limit_frac", [
    ("llama3-8b", "dgx-h100-ndr", "torchtitan", 0.3),
    ("llama-7b", "dgx-a100-hdr", "amsp", 0.3),
    ("llama-13b", "a800-hdr", "megatron", 0.5),
    ("mistral-7b", "dgx-h100-ndr", "fsdp2", 0.08),  # nothing fits: both say so
])
def test_ilp_equals_brute_force_with_tp_overlap(model, cluster, engine, limit_frac):
    # the ILP's tables read the same (overlapped) TP entries as the exact evaluation
    from test_solver import check_against_brute_force, make_job

    job = make_job(model, cluster, 16, 2, 2048, engine=engine, layers=3, tp_overlap=True)
    ddp = evaluate(job, Strategy(), float("inf")).memory.total
    got = check_against_brute_force(job, ddp * limit_frac, tp=None)
    assert (got is None) == (model == "mistral-7b")


def test_backward_reduce_scatters_hide_only_on_megatron():
    # torchtitan: the reduce-scatter's input is the sum of the wq, wk, wv (w1, w3) input
    # gradients, which inductor's micro_pipeline_tp does not fuse: both calls exposed whole.
    # Megatron (TE bulk overlap beside the wgrad GEMM): max(m + sigma c, c) - m per call.
    from amsp_planner.cost.tp_overlap import block_call_costs, linear_seconds

    s = Strategy(s_p=1, s_g=1, s_os=1, micro_batch=1, tp=8)
    tt = {(e.phase, e.op): e for e in evaluate(job_8b(True), s).schedule if e.group == "TP"}
    c = job_8b(True).topology.collective_time("reduce_scatter", 8, 1, 8192 * 4096 * 2)
    assert tt["backward", "reduce_scatter"].unit_time_s[1] == pytest.approx(2 * c, rel=1e-12)
    job = job_8b(True, engine="megatron")
    mm, sigma = linear_seconds(job, 1, 8), job.cluster.gpu.comm_compute_slowdown
    want = sum(max(m + sigma * c, c) - m for m in (mm["qkv"], mm["fc1"]))
    assert block_call_costs(job, 1, 8, "backward", "reduce_scatter", c) == pytest.approx(want)
    assert want < 2 * c
