"""Cost model: public figures (DESIGN.md 4), hand-derived schedules, oracles and properties."""

from __future__ import annotations

from collections import Counter

import pytest
from amsp_testlib import make_job, small_model
from hypothesis import given, settings
from hypothesis import strategies as st

from amsp_planner.cost.activations import saved_bytes_per_token
from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.memory import memory, model_state_bytes
from amsp_planner.cost.schedule import build_schedule
from amsp_planner.cost.step_time import pipeline
from amsp_planner.specs import load_model
from amsp_planner.strategy import Strategy, baseline, factor_options
from amsp_planner.topology import BUS_FACTOR

GB = 1e9


def entries(sched):
    """{(phase, op, group): entry}; each kind appears once."""
    keys = [(e.phase, e.op, e.group) for e in sched]
    assert len(keys) == len(set(keys)), keys
    return {(e.phase, e.op, e.group): e for e in sched}


def shape(e):
    """The hand-checkable fields of an entry."""
    return (e.group_size, e.stride, e.members_per_node, e.dtype, e.calls_per_step,
            e.full_bytes_per_step, e.intra_bytes_per_rank_per_step, e.inter_bytes_per_rank_per_step)


def leaving_node(sched, r):
    """Bytes leaving one node per step = R x inter-node bytes per rank (DESIGN.md 3a)."""
    return r * sum(e.inter_bytes_per_rank_per_step for e in sched)


# ===== DESIGN.md 4: ZeRO paper memory table ====================================================
def test_zero_paper_model_state_memory():
    # ZeRO (arXiv 1910.02054) figure 1: Psi = 7.5B, N_d = 64, K = 12.
    phi, n, r = 7.5e9, 64, 8
    got = {name: sum(model_state_bytes(phi, baseline(name, n, r)).values()) / GB
           for name in ("ddp", "zero1", "zero2", "zero3")}
    assert got["ddp"] == pytest.approx(120, abs=0.05)  # (2 + 2 + 12) * 7.5
    assert got["zero1"] == pytest.approx(31.4, abs=0.05)  # P_os
    assert got["zero2"] == pytest.approx(16.6, abs=0.05)  # P_os+g
    assert got["zero3"] == pytest.approx(1.88, abs=0.005)  # P_os+g+p


def test_zero3_memory_of_a_real_job_is_sixteen_bytes_over_n():
    job = make_job(64, load_model("llama-7b"), seq_len=4096, batch_seqs=1024)
    states = memory(job, baseline("zero3", 64, 8)).model_states
    # 16 B/param over 64 GPUs of 6.74e9 published parameters; padding adds < 0.2%.
    assert states == pytest.approx(16 * 6.74e9 / 64, rel=0.002)


# ===== DESIGN.md 4: ZeRO++ bytes leaving a node ================================================
@pytest.fixture(scope="module")
def llama7b_1024():
    return make_job(1024, load_model("llama-7b"), seq_len=4096, batch_seqs=1024)  # n_micro = 1


def test_zero3_sends_about_3b_out_of_each_node(llama7b_1024):
    job = llama7b_1024
    n, r, b = job.num_nodes, job.gpus_per_node, 2 * job.phi
    out = leaving_node(build_schedule(job, baseline("zero3", 1024, r)), r)
    # fwd all-gather B + bwd all-gather B + grad reduce-scatter B, each (n-1)/n-scaled, plus the
    # 8-byte fp32 metrics all-reduce (2 (n-1)/n * 8 bytes per node).
    assert out == pytest.approx(3 * (n - 1) / n * b + 2 * (n - 1) / n * 8, rel=1e-12)
    assert 2.95 < out / b <= 3.0


def test_zeropp_sends_about_0_75b_out_of_each_node(llama7b_1024):
    job = llama7b_1024
    n, r, phi = job.num_nodes, job.gpus_per_node, job.phi
    b = 2 * phi
    zpp = leaving_node(build_schedule(job, baseline("zeropp", 1024, r)), r)
    z3 = leaving_node(build_schedule(job, baseline("zero3", 1024, r)), r)
    # qwZ forward: INT8 = 0.5B, plus one fp32 scale per 256-element block (4*Phi/256);
    # hpZ backward: in-node only (0); qgZ hop 2: INT4 = 0.25B plus its scales (4*Phi/256).
    payload = 0.5 * b + 0.25 * b
    scales = 2 * 4 * phi / 256
    assert zpp == pytest.approx((n - 1) / n * (payload + scales) + 2 * (n - 1) / n * 8, rel=1e-12)
    assert zpp / b == pytest.approx(0.75, rel=0.03)
    assert z3 / zpp == pytest.approx(4.0, rel=0.03)  # "4x less cross-node traffic"


def test_zeropp_hops_are_in_node_then_across_nodes(llama7b_1024):
    job = llama7b_1024
    e = entries(build_schedule(job, baseline("zeropp", 1024, 8)))
    assert e["backward", "all_gather", "hpZ"].inter_bytes_per_rank_per_step == 0
    assert e["backward", "all_to_all", "G_intra"].inter_bytes_per_rank_per_step == 0
    hop2 = e["backward", "all_to_all", "G_inter"]
    assert (hop2.group_size, hop2.stride, hop2.members_per_node) == (128, 8, 1)
    assert hop2.intra_bytes_per_rank_per_step == 0
    assert ("backward", "reduce_scatter", "G") not in e  # qgZ replaces it


def test_quantization_kernels_read_what_the_runtime_quantizes(llama7b_1024):
    # The runtime's qwZ quantizes the rank's own shard (Phi/s_P elements) and dequantizes the
    # gathered whole (Phi); qgZ quantizes the whole gradient it sends and dequantizes what it
    # receives (2 Phi per hop, 2 Phi/s0 on the cross-node hop). One 16-bit element = 2 bytes of
    # kernel input at quant_gbyte_per_s.
    from amsp_planner.cost.job import Job

    job = llama7b_1024
    gpu = job.cluster.gpu
    slow = Job.create(job.model, job.cluster.model_copy(update={"gpu": gpu.model_copy(
        update={"quant_gbyte_per_s": 1.0})}), job.training, job.num_gpus)
    s = baseline("zeropp", 1024, 8)
    fast_e, slow_e = entries(build_schedule(job, s)), entries(build_schedule(slow, s))
    phi, rate_slow, rate_fast = job.phi, 1e9, gpu.quant_gbyte_per_s * 1e9

    def kernel_s(key):  # kernel seconds x rate / 2 B: the 16-bit elements the kernels touch
        assert slow_e[key].time_s == fast_e[key].time_s  # kernels are not collective time
        return slow_e[key].kernel_s * rate_slow / 2, fast_e[key].kernel_s * rate_fast / 2

    assert kernel_s(("forward", "all_gather", "P")) == pytest.approx((phi / 1024 + phi,) * 2)
    assert kernel_s(("backward", "all_to_all", "G_intra")) == pytest.approx((2 * phi,) * 2)
    assert kernel_s(("backward", "all_to_all", "G_inter")) == pytest.approx((2 * phi / 8,) * 2)
    # the bf16 secondary copy has no quantizer, only its copy-out at the HBM rate
    hpz = ("backward", "all_gather", "hpZ")
    assert slow_e[hpz].kernel_s == fast_e[hpz].kernel_s == pytest.approx(
        2 * 2 * phi / job.cluster.gpu.hbm_gbyte_per_s / 1e9)


# ===== DESIGN.md 3a: ring-byte formula and its checks ==========================================
def ring_total(job, s, n_micro):
    """DESIGN.md 3a, per rank per step, without the 8-byte metrics all-reduce."""
    n, b = job.num_gpus, 2 * job.phi
    k, r, q = s.s_os // s.s_g, n // s.s_os, s.s_os // s.s_p
    bwd = (s.hpz - 1) / s.hpz if s.hpz > 1 else (s.s_p - 1) / s.s_p
    return (n_micro * (s.s_p - 1) / s.s_p * b + n_micro * bwd * b
            + n_micro * (s.s_g - 1) / s.s_g * b + (k - 1) / k * b / s.s_g
            + 2 * (r - 1) / r * b / s.s_os + (q - 1) / q * b / s.s_p)


def metrics_bytes(n):
    return 2 * (n - 1) / n * 8 if n > 1 else 0


@st.composite
def nested_factors(draw, n, r=8):
    """(s_P, s_G, s_OS, h_z): a valid point of the AMSP space for N = n GPUs, R = r."""
    opts = factor_options(n, r)
    sp = draw(st.sampled_from(opts))
    sg = draw(st.sampled_from([x for x in opts if x % sp == 0]))
    so = draw(st.sampled_from([x for x in opts if x % sg == 0]))
    hpz = draw(st.sampled_from([1] + [h for h in (2, 4, 8) if h < sp and sp % h == 0]))
    return sp, sg, so, hpz


@st.composite
def job_and_strategy(draw):
    n = 8 * draw(st.sampled_from([1, 2, 4, 8]))
    sp, sg, so, hpz = draw(nested_factors(n))
    mb = draw(st.sampled_from([1, 2]))
    n_micro = draw(st.sampled_from([1, 2, 3]))
    job = make_job(n, batch_seqs=n * mb * n_micro)
    return job, Strategy(s_p=sp, s_g=sg, s_os=so, hpz=hpz, micro_batch=mb), n_micro


@settings(max_examples=120, deadline=None)
@given(job_and_strategy())
def test_ring_bytes_follow_the_design_formula(case):
    job, s, n_micro = case
    sched = build_schedule(job, s)
    total = sum(e.bytes_per_rank_per_step for e in sched)
    assert total == pytest.approx(ring_total(job, s, n_micro) + metrics_bytes(job.num_gpus),
                                  rel=1e-12, abs=1e-6)
    for e in sched:  # each entry: intra + inter = nccl-tests bus factor x full bytes
        assert e.bytes_per_rank_per_step == pytest.approx(
            BUS_FACTOR[e.op](e.group_size) * e.full_bytes_per_step, rel=1e-12)


@pytest.mark.parametrize("n", [8, 16, 64])
def test_design_checks_zero3_zero1_ddp_amsp(n):
    job = make_job(n, batch_seqs=n)  # n_micro = 1
    b = 2 * job.phi

    def total(name_or_s):
        s = baseline(name_or_s, n, 8) if isinstance(name_or_s, str) else name_or_s
        sched = build_schedule(job, s)
        return sum(e.bytes_per_rank_per_step for e in sched) - metrics_bytes(n), sched

    assert total("zero3")[0] == pytest.approx(3 * (n - 1) / n * b)
    assert total("zero1")[0] == pytest.approx(2 * (n - 1) / n * b)
    assert total("ddp")[0] == pytest.approx(2 * (n - 1) / n * b)
    # AMSP (1, 1, R): only the replica all-reduce, 2(r-1)/r * B/R per rank, leaves the node.
    _, sched = total(Strategy(s_os=8))
    r = n // 8
    inter = sum(e.inter_bytes_per_rank_per_step for e in sched if e.group != "world")
    assert inter == pytest.approx(2 * (r - 1) / r * b / 8)
    assert all(e.inter_bytes_per_rank_per_step == 0 for e in sched
               if e.group not in ("OS_replica", "world"))


# ===== hand-derived schedules ==================================================================
# small_model(): units 65,536 / 164,096 / 164,096 / 65,664 elements.
# On 16 GPUs each unit pads to a multiple of 16 * 256 = 4,096:
#   65,536 -> 65,536 (16 x 4096); 164,096 -> 167,936 (41 x 4096); 65,664 -> 69,632 (17 x 4096)
#   Phi = 65,536 + 2 x 167,936 + 69,632 = 471,040; B = 2 Phi = 942,080 bytes.
# On 32 GPUs the quantum is 8,192:
#   65,536 -> 65,536; 164,096 -> 172,032 (21 x 8192); 65,664 -> 73,728 (9 x 8192)
#   Phi = 65,536 + 2 x 172,032 + 73,728 = 483,328; B = 966,656 bytes.
# Batch = 2 sequences per GPU, micro-batch 1: n_micro = 2; 4 units, so per-micro-batch
# collectives are called 4 x 2 = 8 times per step, once-per-step ones 4 times.


def test_padding_by_hand():
    assert make_job(16).units == (65_536, 167_936, 167_936, 69_632)
    assert make_job(16).phi == 471_040
    assert make_job(32).phi == 483_328


def test_zero3_schedule_on_two_nodes_by_hand():
    job = make_job(16)  # 2 nodes x 8 A100
    e = entries(build_schedule(job, baseline("zero3", 16, 8)))
    assert set(e) == {("forward", "all_gather", "P"), ("backward", "all_gather", "P"),
                      ("backward", "reduce_scatter", "G"), ("update", "all_reduce", "world")}
    # Full bytes: n_micro x B = 2 x 942,080 = 1,884,160. Group of 16 = 8 per node on 2 nodes.
    # Hierarchical split: intra 7/8 x full = 1,648,640; inter (1/2) x full / 8 = 117,760.
    per_mb = (16, 1, 8, "bf16", 8, 1_884_160, 1_648_640, 117_760)
    assert shape(e["forward", "all_gather", "P"]) == per_mb
    assert shape(e["backward", "all_gather", "P"]) == per_mb
    assert shape(e["backward", "reduce_scatter", "G"]) == per_mb
    # [loss, grad-norm^2] fp32 all-reduce: 8 bytes; intra 2 x 7/8 x 8 = 14, inter 2 x 1/2 x 8/8 = 1.
    assert shape(e["update", "all_reduce", "world"]) == (16, 1, 8, "fp32", 1, 8, 14, 1)


def test_mics_schedule_groups_of_two_nodes_by_hand():
    job = make_job(32)  # 4 nodes; MiCS p = 2R = 16: two groups of two nodes, replicated twice
    s = baseline("mics", 32, 8)
    assert (s.s_p, s.s_g, s.s_os) == (16, 16, 16)
    e = entries(build_schedule(job, s))
    # Per micro-batch, inside the 16-GPU group: full = 2 x B = 1,933,312;
    # intra 7/8 x full = 1,691,648; inter (1/2) x full / 8 = 120,832.
    per_mb = (16, 1, 8, "bf16", 8, 1_933_312, 1_691_648, 120_832)
    assert shape(e["forward", "all_gather", "P"]) == per_mb
    assert shape(e["backward", "all_gather", "P"]) == per_mb
    assert shape(e["backward", "reduce_scatter", "G"]) == per_mb
    # Once per step: all-reduce of the 1/16 shard (Phi/16 x 2 B = 60,416 B) over the 2 replicas,
    # rank i and i+16, one per node: all of it crosses nodes, 2 x 1/2 x 60,416 = 60,416.
    assert shape(e["grad_sync", "all_reduce", "OS_replica"]) == (
        2, 16, 1, "bf16", 4, 60_416, 0, 60_416)
    assert ("grad_sync", "reduce_scatter", "OS_shard") not in e
    assert ("update", "all_gather", "P_update") not in e


def test_amsp_point_p_lt_g_lt_os_by_hand():
    job = make_job(32)  # 4 nodes of 8; Phi = 483,328, B = 966,656
    s = Strategy(s_p=2, s_g=8, s_os=16)
    e = entries(build_schedule(job, s))
    # 1-2. parameter all-gathers over 2 neighbours (one node): full 2 x B, intra 1/2 of it.
    assert shape(e["forward", "all_gather", "P"]) == (2, 1, 2, "bf16", 8, 1_933_312, 966_656, 0)
    assert shape(e["backward", "all_gather", "P"]) == (2, 1, 2, "bf16", 8, 1_933_312, 966_656, 0)
    # 3. gradient reduce-scatter over the 8 GPUs of the node: 7/8 x 1,933,312 = 1,691,648.
    assert shape(e["backward", "reduce_scatter", "G"]) == (
        8, 1, 8, "bf16", 8, 1_933_312, 1_691_648, 0)
    # 4a. G shard (Phi/8 x 2 B = 120,832) reduce-scattered over the k = 16/8 = 2 ranks of the
    #     OS-group holding the same G shard: ranks i and i+8, on two nodes; 1/2 of it crosses.
    assert shape(e["grad_sync", "reduce_scatter", "OS_shard"]) == (
        2, 8, 1, "bf16", 4, 120_832, 0, 60_416)
    # 4b. OS shard (Phi/16 x 2 B = 60,416) all-reduced over the r = 32/16 = 2 replicas:
    #     2 x 1/2 x 60,416 crosses nodes.
    assert shape(e["grad_sync", "all_reduce", "OS_replica"]) == (
        2, 16, 1, "bf16", 4, 60_416, 0, 60_416)
    # 6. updated shards all-gathered into the P shard (Phi/2 x 2 B = 483,328) over the
    #    q = 16/2 = 8 ranks of the OS-group with the same P index: stride 2, 4 per node on 2
    #    nodes; intra 3/4 x 483,328 = 362,496, inter 1/2 x 483,328 / 4 = 60,416.
    assert shape(e["update", "all_gather", "P_update"]) == (
        8, 2, 4, "bf16", 4, 483_328, 362_496, 60_416)
    # Memory (docstring of cost/memory.py), U = largest unit = 172,032 elements:
    m = memory(job, s)
    assert (m.params, m.grads, m.optimizer, m.hpz) == (483_328, 120_832, 362_496, 0)
    assert m.gather_buffers == 2 * 172_032 * 2  # unit in use + prefetched, bf16
    assert m.grad_buffers == 2 * 172_032 * 2
    # permuted gradient copy (1 < p < g): U x 2 B. The step-6 permuted output reuses a gather
    # buffer idle after backward, so it adds nothing.
    assert m.staging == 172_032 * 2
    # OS-shard slice of the step reduce-scatter (os > g): U/16 x 2 B
    assert m.step_buffer == 172_032 // 16 * 2


def test_schedule_groups_match_their_definitions():
    """Build each group kind's rank sets from DESIGN.md 3a and compare with the entries."""
    n, r = 64, 8
    job = make_job(n)
    for s in (Strategy(s_p=2, s_g=8, s_os=16), Strategy(s_p=4, s_g=16, s_os=64),
              Strategy(s_p=16, s_g=16, s_os=32, hpz=4),
              baseline("zeropp", n, r), Strategy(s_os=8), baseline("zero2", n, r)):
        s0_g = s.mesh("g", r)[0]

        def block(rank, size):
            return range(rank - rank % size, rank - rank % size + size)

        define = {
            "P": lambda i, s=s: list(block(i, s.s_p)),
            "hpZ": lambda i, s=s: list(block(i, s.hpz)),
            "G": lambda i, s=s: list(block(i, s.s_g)),
            "G_intra": lambda i, s0_g=s0_g: list(block(i, s0_g)),
            "G_inter": lambda i, s=s: [j for j in block(i, s.s_g) if j % r == i % r],
            "OS_shard": lambda i, s=s: [j for j in block(i, s.s_os) if j % s.s_g == i % s.s_g],
            "OS_replica": lambda i, s=s: [j for j in range(n) if j % s.s_os == i % s.s_os],
            "P_update": lambda i, s=s: [j for j in block(i, s.s_os) if j % s.s_p == i % s.s_p],
            "world": lambda i: list(range(n)),
        }
        for e in build_schedule(job, s):
            for rank in range(n):
                members = define[e.group](rank)
                assert rank in members
                assert len(members) == e.group_size, (s, e.group)
                steps = {b - a for a, b in zip(members, members[1:], strict=False)}
                assert steps <= {e.stride}, (s, e.group, steps)
                per_node = Counter(m // r for m in members)
                assert max(per_node.values()) == e.members_per_node, (s, e.group)


def test_single_gpu_has_no_collectives():
    job = make_job(1, cluster="dgx-a100-hdr")
    ev = evaluate(job, Strategy())
    assert ev.schedule == ()
    assert ev.time.exposed_comm_s == 0
    assert ev.time.step_s == ev.time.compute_s + ev.time.optimizer_s


def test_optimizer_step_reads_and_writes_32_bytes_per_element_of_the_shard():
    # AdamW per element: fp32 master, exp_avg, exp_avg_sq read and written (24 B), the bf16
    # gradient read (2), the master read again and the bf16 parameter written (4 + 2): 32 B.
    # LLaMA-7B (6.74B parameters) on A100-80GB (1400 GB/s of optimizer traffic).
    job = make_job(64, load_model("llama-7b"), seq_len=4096, batch_seqs=64)
    ddp, zero1 = evaluate(job, Strategy()), evaluate(job, Strategy(s_os=64))
    assert ddp.time.optimizer_s == pytest.approx(6.74e9 * 32 / 1400e9, rel=0.005)
    assert zero1.time.optimizer_s == pytest.approx(ddp.time.optimizer_s / 64, rel=1e-9)
    fp32 = make_job(64, load_model("llama-7b"), seq_len=4096, batch_seqs=64, precision="fp32")
    # fp32: the gradient and the written parameter are 4 bytes each: 36 B per element
    assert evaluate(fp32, Strategy()).time.optimizer_s == pytest.approx(
        ddp.time.optimizer_s * 36 / 32, rel=1e-9)


def test_fp32_gradient_accumulation_doubles_gradient_bytes():
    s = Strategy(s_p=1, s_g=16, s_os=16)
    bf16, fp32 = make_job(16), make_job(16, grad_accum_dtype="fp32")
    e16, e32 = entries(build_schedule(bf16, s)), entries(build_schedule(fp32, s))
    g16, g32 = e16["backward", "reduce_scatter", "G"], e32["backward", "reduce_scatter", "G"]
    assert g32.full_bytes_per_step == 2 * g16.full_bytes_per_step
    assert g32.dtype == "fp32"
    assert memory(fp32, s).grads == 2 * memory(bf16, s).grads == 471_040 / 16 * 4


# ===== activations, compute and the overlap model =============================================
def test_fused_activation_bytes_by_hand():
    job = make_job(8, activation_profile="fused")
    # small_model: h = 128, d_kv = 128, f = 256, a = 4 heads, V = 512, bf16 (2 B).
    # per block: (6h + 2 d_kv + 3f) x 2 + 4a = (768 + 256 + 768) x 2 + 16 = 3,600
    # head: 2h x 2 + 4V = 512 + 2,048 = 2,560
    assert saved_bytes_per_token(job, ckpt=False) == 2 * 3_600 + 2_560
    # checkpointing: each block's input (h x 2 = 256) + one block being recomputed + head
    assert saved_bytes_per_token(job, ckpt=True) == 2 * 256 + 3_600 + 2_560


def _qty(a=0.0, b=0.0, r=0.0, sync=0.0, f=0.0, g=0.0, **per_class):
    """Unit quantities: the same for every class unless `per_class` says otherwise."""
    q = {}
    for c in ("embedding", "block", "head"):
        vals = dict(gather_fwd=a, gather_bwd=b, reduce=r, sync=sync, fwd=f, bwd=g)
        vals.update(per_class.get(c, {}))
        q.update({(k, c): v for k, v in vals.items()})
    return q


def test_pipeline_by_hand():
    # 1 block: units embedding (E), block (B), head (H). Gathers 1 s each, compute: E none,
    # B 2 s forward / 4 s backward, H 1 / 2; reductions 0.5 s, sync 0.25 s; sigma 0.1.
    q = _qty(a=1.0, b=1.0, r=0.5, sync=0.25, embedding=dict(fwd=0.0, bwd=0.0),
             block=dict(fwd=2.0, bwd=4.0), head=dict(fwd=1.0, bwd=2.0))
    p = pipeline(1, q, n_micro=1, sigma=0.1)
    # forward: a_E exposed 1; E: max(1, 0 + 0.1) = 1 (exposed 1); B: max(1, 2 + 0.1) = 2.1
    # (contention 0.1); H: max(0, 1) = 1.
    # last backward: b_H exposed 1; H: m = b_B = 1: max(1, 2.1) = 2.1 (0.1);
    # B: m = b_E + r_H + s_H = 1.75: max(1.75, 4.175) (0.175); E: m = r_B + s_B = 0.75:
    # max(0.75, 0.075) (exposed 0.75); tail r_E + s_E = 0.75.
    assert p.compute == pytest.approx(0 + 2 + 1 + 2 + 4 + 0)
    assert p.exposed_forward == pytest.approx(1 + 1)
    assert p.exposed_backward == pytest.approx(1 + 0.75 + 0.75)
    assert p.contention == pytest.approx(0.1 + 0.1 + 0.175)


def test_one_unit_and_no_slowdown_is_the_old_closed_form():
    # With one unit the old model exposed every collective once: step = n (T + C_micro) + C_s.
    # Zero blocks leave embedding and head; the embedding gets nothing to do.
    q = _qty(head=dict(gather_fwd=0.3, gather_bwd=0.4, reduce=0.2, sync=0.1, fwd=1.0, bwd=2.0))
    for n in (1, 3):
        p = pipeline(0, q, n_micro=n, sigma=0.0)
        total = p.compute + p.exposed_forward + p.exposed_backward + p.contention
        assert total == pytest.approx(n * (1 + 2 + 0.3 + 0.4 + 0.2) + 0.1)


def test_equal_units_give_the_pipeline_closed_form():
    # U equal units, forward only: T + C/U + (U-1)/U max(0, C - T) (the old closed form).
    blocks = 6
    u = blocks + 2
    for c_tot, t_tot in ((0.5, 1.0), (3.0, 2.0), (1.0, 1.0)):
        p = pipeline(blocks, _qty(a=c_tot / u, f=t_tot / u), n_micro=1, sigma=0.0)
        assert p.compute == pytest.approx(t_tot)
        assert p.compute + p.exposed_forward == pytest.approx(
            t_tot + c_tot / u + (u - 1) / u * max(0, c_tot - t_tot))


def _simulate(blocks, q, n_micro, sigma):
    """Event-by-event run of the unit pipeline, written independently of the closed form:
    one communication stream (FIFO) and one compute stream; compute progresses at rate
    1 - sigma while a collective is running. Forward: the gather of unit i+1 is issued when
    unit i starts computing (two gather buffers); backward: the gather of the next unit and
    the reduction (+ sync on the last micro-batch) of the unit just finished are issued when
    a unit starts computing. Returns the step time."""
    seq = ["embedding"] + ["block"] * blocks + ["head"]
    t = 0.0
    for k in range(n_micro):
        for backward in (False, True):
            order = seq[::-1] if backward else seq
            last = backward and k == n_micro - 1
            first = "gather_bwd" if backward else "gather_fwd"
            comm_end = t + q[first, order[0]]  # the first gather, alone
            t = comm_end
            for i, cls in enumerate(order):
                jobs = []
                if i + 1 < len(order):
                    jobs.append(q[first, order[i + 1]])
                if backward and i > 0:
                    jobs.append(q["reduce", order[i - 1]])
                    if last:
                        jobs.append(q["sync", order[i - 1]])
                comm = sum(jobs)
                work = q["bwd" if backward else "fwd", cls]
                # compute at rate 1 - sigma while comm runs, at rate 1 after it
                slow = work / (1 - sigma) if sigma < 1 else float("inf")
                if comm >= slow:
                    end = t + slow
                else:
                    end = t + comm + (work - (1 - sigma) * comm)
                t = max(end, t + comm)
            if backward:
                t += q["reduce", order[-1]] + (q["sync", order[-1]] if last else 0.0)
    return t


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 5), st.integers(1, 3), st.floats(0, 0.6),
       st.lists(st.floats(0, 2), min_size=18, max_size=18))
def test_pipeline_matches_an_event_simulation(blocks, n_micro, sigma, vals):
    it = iter(vals)
    q = {(r, c): next(it) for c in ("embedding", "block", "head")
         for r in ("gather_fwd", "gather_bwd", "reduce", "sync", "fwd", "bwd")}
    p = pipeline(blocks, q, n_micro, sigma)
    total = p.compute + p.exposed_forward + p.exposed_backward + p.contention
    assert total == pytest.approx(_simulate(blocks, q, n_micro, sigma), rel=1e-9, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["zero3", "zeropp", "zero1", "hsdp", "ddp"]), st.sampled_from([1, 2, 8]),
       st.floats(0.01, 1.0))
def test_contention_never_makes_a_strategy_faster(name, seqs, sigma):
    from amsp_planner.cost.job import Job

    base = make_job(64, load_model("llama-7b"), seq_len=2048, batch_seqs=64 * seqs,
                    cluster="dgx-a100-hdr")
    gpu0 = base.cluster.gpu.model_copy(update={"comm_compute_slowdown": 0.0})
    gpu1 = base.cluster.gpu.model_copy(update={"comm_compute_slowdown": sigma})
    jobs = [Job.create(base.model, base.cluster.model_copy(update={"gpu": g}), base.training, 64)
            for g in (gpu0, gpu1)]
    s = baseline(name, 64, 8)
    quiet, loud = (evaluate(j, s) for j in jobs)
    assert loud.step_s >= quiet.step_s
    assert loud.time.contention_s >= quiet.time.contention_s == 0


def test_compute_by_hand_on_cpu_processes():
    # cpu-local: peak 0.05 TFLOP/s at 0.5, no HBM term, no kernel overhead: pure FLOPs.
    # small_model, seq 128, micro-batch 2 -> T = 256 tokens; per token, forward:
    #   block matmuls 2 x (QKV 128 x 384 + out 128 x 128 + MLP 3 x 128 x 256) = 2 x 163,840
    #   attention (causal half of QK^T and PV) 2 s h = 2 x 128 x 128 = 32,768; backward 2.5x
    #   head 2 h V = 131,072 forward, twice that backward; the embedding lookup is free
    job = make_job(16, cluster="cpu-local")
    ev = evaluate(job, Strategy(micro_batch=2))
    rate, t = 0.05e12 * 0.5, 256
    block = 3 * 327_680 + 3.5 * 32_768
    want = t * (2 * block + 3 * 131_072) / rate  # one micro-batch, 2 sequences per GPU
    assert ev.time.compute_s == pytest.approx(want)
    # full checkpointing recomputes each block's forward, not the head's, and (the bundled
    # runtime's non-reentrant checkpoint stops early: tests/test_ckpt_early_stop.py) not the
    # block's last linear, the MLP's down projection 2 x 256 x 128 = 65,536 a token
    ck = evaluate(job, Strategy(micro_batch=2, ckpt=True))
    assert ck.time.compute_s - ev.time.compute_s == pytest.approx(
        t * 2 * (327_680 - 65_536 + 32_768) / rate)
    assert ck.model_flops_per_step == ev.model_flops_per_step
    # the first 1 of the 2 blocks: one block's forward recomputed
    one = evaluate(job, Strategy(micro_batch=2, ckpt_blocks=1))
    assert one.time.compute_s - ev.time.compute_s == pytest.approx(
        t * (327_680 - 65_536 + 32_768) / rate)
    # op-level recomputes only elementwise kernels, which a CPU process does not price
    op = evaluate(job, Strategy(micro_batch=2, ckpt_op=True))
    assert op.time.compute_s == pytest.approx(ev.time.compute_s)


def test_op_level_recomputes_the_elementwise_forward():
    # A100 preset, small_model (h 128, d_kv 128, f 256, SwiGLU, bf16), seq 128, micro-batch 2:
    # per token and block the forward's elementwise kernels move (2 norms 28h + RoPE 6(h + d_kv)
    # + residual adds 6h + SwiGLU 5f) x 2 bytes = 7,168 x 2 = 14,336 bytes at the HBM rate;
    # op-level recomputes them in each of the 2 blocks, nothing else
    job = make_job(16, cluster="dgx-a100-hdr")
    ev = evaluate(job, Strategy(micro_batch=2))
    op = evaluate(job, Strategy(micro_batch=2, ckpt_op=True))
    hbm = job.cluster.gpu.hbm_gbyte_per_s * 1e9
    assert op.time.compute_s - ev.time.compute_s == pytest.approx(2 * 256 * 14_336 / hbm)
    assert op.memory.activations < ev.memory.activations


def test_small_micro_batches_and_fp32_run_below_the_large_matrix_rate():
    # A100 preset: per token, a micro-batch of 1 sequence of 512 tokens costs more than one of
    # 8 (kernel overhead and memory-bound matmuls weigh more on small matrices) ...
    def per_token(mb, precision="bf16"):
        job = make_job(8, load_model("llama-7b"), seq_len=512, batch_seqs=64,
                       precision=precision)
        return evaluate(job, Strategy(micro_batch=mb)).time.compute_s / (64 // 8 * 512)

    assert per_token(1) > 1.03 * per_token(8)
    # ... and fp32 runs on the fp32 peak (19.5 of 312 TFLOP/s): over 10x slower
    assert per_token(8, "fp32") > 10 * per_token(8)


def test_mfu_is_model_flops_over_peak():
    job = make_job(64, load_model("llama-7b"), seq_len=4096, batch_seqs=1024)
    ev = evaluate(job, baseline("zero1", 64, 8))
    m = job.model
    flops = 1024 * 4096 * (6 * m.num_flop_params + 12 * 32 * 4096 * 4096)
    assert ev.mfu == pytest.approx(flops / ev.step_s / (64 * 312e12))


# ===== monotonicity ============================================================================
@st.composite
def valid_strategy(draw, n):
    sp, sg, so, hpz = draw(nested_factors(n))
    return Strategy(s_p=sp, s_g=sg, s_os=so, hpz=hpz, qwz=sp > 1 and draw(st.booleans()),
                    qgz=sg > 1 and draw(st.booleans()), ckpt=draw(st.booleans()))


@st.composite
def strategy_on_nodes(draw):
    n = 8 * draw(st.sampled_from([1, 2, 4, 8]))
    return n, draw(valid_strategy(n))


@settings(max_examples=60, deadline=None)
@given(strategy_on_nodes(), st.floats(1, 10), st.floats(1, 10), st.floats(0.1, 1))
def test_more_bandwidth_is_never_slower(ns, nic_x, nvl_x, lat_x):
    n, s = ns
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_cluster

    t = TrainingSpec(seq_len=128, global_batch_seqs=2 * n)
    slow = Job.create(small_model(), load_cluster("dgx-a100-hdr"), t, n)
    fast = Job.create(small_model(), load_cluster("dgx-a100-hdr", {
        "nic_gbit_per_s": 200 * nic_x, "intra_gbyte_per_s": 300 * nvl_x,
        "inter_latency_us": 6 * lat_x, "intra_latency_us": 3 * lat_x}), t, n)
    assert evaluate(fast, s).step_s <= evaluate(slow, s).step_s * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["ddp", "zero1", "zero2", "zero3", "hsdp", "mics", "zeropp"]),
       st.integers(1, 256), st.integers(1, 8), st.floats(1e6, 1e12))
def test_more_gpus_never_more_model_state_memory(name, nodes, more, phi):
    # Model states of the unpadded model: every named baseline scales with N or stays put.
    n1, n2 = 8 * nodes, 8 * nodes * more
    small = sum(model_state_bytes(phi, baseline(name, n2, 8)).values())
    big = sum(model_state_bytes(phi, baseline(name, n1, 8)).values())
    assert small <= big * (1 + 1e-12)


@pytest.mark.parametrize("model", ["llama-7b", "llama2-70b"])
def test_more_gpus_never_more_memory_with_padding(model):
    """With units padded to a multiple of N, strategies whose OS factor grows with N still shrink;
    replicated ones (DDP, HSDP, MiCS) grow only by the padding itself (DESIGN.md 3a pads every
    unit to a multiple of N for all strategies), under 0.2% here."""
    m = load_model(model)
    prev = {}
    for n in (8, 16, 32, 64, 128, 256, 512, 1024):
        job = make_job(n, m, seq_len=4096, batch_seqs=1024)
        for name in ("ddp", "zero1", "zero2", "zero3", "hsdp", "mics", "zeropp"):
            states = memory(job, baseline(name, n, 8)).model_states
            if name in prev:
                old_states, old_phi = prev[name]
                if name in ("zero1", "zero2", "zero3", "zeropp"):
                    assert states <= old_states, (name, n)
                else:
                    assert states - old_states <= 16 * (job.phi - old_phi), (name, n)
                    assert states <= old_states * 1.002, (name, n)
            prev[name] = (states, job.phi)


def test_bigger_shard_factors_never_more_model_state_memory():
    job = make_job(64)
    opts = factor_options(64, 8)
    for sp in opts:
        for sg in (x for x in opts if x % sp == 0):
            for so in (x for x in opts if x % sg == 0):
                base = memory(job, Strategy(s_p=sp, s_g=sg, s_os=so)).model_states
                if so * 2 in opts and (so * 2) % sg == 0:
                    assert memory(job, Strategy(s_p=sp, s_g=sg, s_os=so * 2)).model_states < base


def test_the_embedding_gather_is_priced_at_its_own_size_and_exposed():
    # Llama-3-8B: embedding 128,256 x 4,096 = 525M parameters, a block 218M: its gather is
    # 2.4x a block's, and with no compute before it (nor in it) it shows in full.
    job = make_job(64, load_model("llama3-8b"), seq_len=8192, batch_seqs=128)
    ev = evaluate(job, baseline("zero3", 64, 8).with_(micro_batch=1))
    fwd = entries(ev.schedule)[("forward", "all_gather", "P")]
    emb, block, head = fwd.unit_time_s
    # (its fixed ring latency is the same as a block's, so the time ratio is a little below)
    assert 2.0 < emb / block <= 525_336_576 / 218_112_000
    assert ev.time.exposed_forward_s >= ev.n_micro * emb
