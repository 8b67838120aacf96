"""FP8 training (amsp_planner/cost/fp8.py): the published speed-ups, the engines' rules for which
matmuls run in FP8, cast and all-gather bytes by hand (docs/fp8.md)."""

import math

import pytest

from amsp_planner.cost import fp8, fp8_bytes, fp8_casts
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import load_model
from amsp_planner.specs.cluster import GpuSpec, gpu_presets


def _gpu(name):
    return GpuSpec(**gpu_presets()[name])


H100 = "H100-SXM5-80GB"


# ----- the published grid: lookups, interpolation, clamping ---------------------------------
@pytest.mark.parametrize("m,k,n,published", [
    # torchao docs/static/fp8-rowwise-perf.png (fdddb2cfa), H100, rowwise
    (4096, 8192, 16384, 1.07), (16384, 4096, 8192, 1.20), (1024, 1024, 1024, 0.42),
    (32768, 32768, 32768, 1.52), (8192, 2048, 4096, 0.82)])
def test_rowwise_grid_points_are_the_published_cells(m, k, n, published):
    # H100 GPUs read it (the H200 SXM its own measured grid: tests/test_fp8_grid_h200.py)
    for gpu in (H100, "H100-SXM5-96GB-500W"):
        s = fp8.linear_speedup(_gpu(gpu), "rowwise", m, k, n)
        assert s.how == "table" and s.value == pytest.approx(published)


def test_grid_interpolates_in_log2_and_clamps_outside():
    g = fp8._grid(_gpu(H100), "rowwise", "torchao")
    # halfway between M = 4096 and 8192 in log2, K = N = 4096: cells 0.84 and 1.00
    v, clamped = fp8.grid_speedup(g, 4096 * math.sqrt(2), 4096, 4096)
    assert v == pytest.approx((0.84 + 1.00) / 2) and not clamped
    # halfway in K and N at M = 16384: K 4096/8192 x N 8192/16384 -> 1.20, 1.26, 1.33, 1.39
    v, _ = fp8.grid_speedup(g, 16384, 4096 * math.sqrt(2), 8192 * math.sqrt(2))
    assert v == pytest.approx((1.20 + 1.26 + 1.33 + 1.39) / 4)
    # beyond the grid: the edge value, flagged
    s = fp8.linear_speedup(_gpu(H100), "rowwise", 131072, 4096, 14336)
    edge, _ = fp8.grid_speedup(g, 32768, 4096, 14336)
    assert s.value == pytest.approx(edge) and s.how == "table, clamped to its edge"


# ----- the roofline against published figures it was not fitted to -------------------------
@pytest.mark.parametrize("m,k,n,published", [
    # torchao/float8/README.md at e2dad4a66, "Performance", examples 1 and 2 (H100, tensorwise)
    (1024, 2048, 1024, 0.80), (4096, 8192, 16384, 1.39)])
def test_tensorwise_h100_roofline_matches_torchao_examples(m, k, n, published):
    s = fp8.linear_speedup(_gpu(H100), "tensorwise", m, k, n)
    assert s.how == "roofline"
    assert s.value == pytest.approx(published, rel=0.05)


# TE docs/examples/gemm_profiling/gemm_profiling.rst: H200 NVL, 5B config (h 4096, f 16384,
# M = 31 x 512), the 12 GEMMs of a layer in autocast mode (casts included)
H200_NVL = GpuSpec(name="H200 NVL", arch="hopper", memory_gib=141,
                   peak_bf16_tflop_per_s=835,  # data sheet: 1,671 TFLOP/s with sparsity
                   hbm_gbyte_per_s=0.6 * 4800,  # the presets' 60 % of the data sheet's 4.8 TB/s
                   # the rate TE's own bf16 arm reached: 19.2 TFLOP per layer in 32.014 ms
                   achievable_fraction=0.72, kernel_overhead_us=10)
TE_SHAPES = [(4096, 12288), (4096, 4096), (4096, 16384), (16384, 4096)]


@pytest.mark.parametrize("recipe,bf16_ms,fp8_ms", [("tensorwise", 32.014, 20.285),
                                                   ("delayed", 32.014, 18.978)])
def test_te_h200_layer_speedup(recipe, bf16_ms, fp8_ms):
    m = 31 * 512
    flops = 3 * 2 * m * sum(k * n for k, n in TE_SHAPES)
    assert flops / (bf16_ms * 1e-3) / 835e12 == pytest.approx(0.72, abs=0.01)
    bf16 = sum(fp8.roofline_linear_s(H200_NVL, m, k, n, None) for k, n in TE_SHAPES)
    r = fp8.RECIPE[recipe]
    low = sum(fp8.roofline_linear_s(H200_NVL, m, k, n, r, "te") for k, n in TE_SHAPES)
    assert bf16 / low == pytest.approx(bf16_ms / fp8_ms, rel=0.06)


def test_published_points_are_consistent():
    """The yaml's TE per-shape rows sum to its per-layer Fprop figure (B300, 2.879 ms)."""
    pts = [p for p in fp8.fp8_data()["points"]
           if p["gpu"] == "B300" and p["recipe"] == "tensorwise"
           and p["measures"] == "gemm_with_quantize"]
    assert sum(p["fp8_ms"] for p in pts) == pytest.approx(2.879, abs=0.002)
    assert sum(p["bf16_ms"] for p in pts) == pytest.approx(4.196, abs=0.002)


# ----- which matmuls run in FP8 -------------------------------------------------------------
def test_torchtitan_rule_llama3_8b():
    m = load_model("llama3-8b")
    every = fp8.fp8_matmuls(m, "rowwise", "torchtitan")
    assert [x.name for x in every.block] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    assert all(x.fp8 for x in every.block) and not every.head_fp8 and not every.embedding_fp8
    # auto_filter_small_kn: wk and wv are (K, N) = (4096, 1024): N <= 2048 (rowwise) and
    # K <= 4096 and N <= 1024 (tensorwise) keep them bf16
    for recipe in ("rowwise", "tensorwise"):
        f = fp8.fp8_matmuls(m, recipe, "torchtitan", auto_filter=True)
        assert {x.name for x in f.block if not x.fp8} == {"wk", "wv"}
    assert every.fp8_params_per_block == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336


def test_megatron_rule_fused_linears_and_first_last_layers():
    m = load_model("llama3-8b")
    f = fp8.fp8_matmuls(m, "delayed", "megatron", first_last_bf16=(1, 1))
    assert [(x.name, x.k, x.n) for x in f.block] == [
        ("linear_qkv", 4096, 4096 + 2 * 1024), ("linear_proj", 4096, 4096),
        ("linear_fc1", 4096, 2 * 14336), ("linear_fc2", 14336, 4096)]
    assert f.bf16_layers == 2 and all(x.fp8 for x in f.block)
    tp = fp8.fp8_matmuls(m, "tensorwise", "megatron", tp=8)
    assert tp.block[0].n == (4096 + 2 * 1024) // 8


@pytest.mark.parametrize("recipe,engine,arch", [
    ("rowwise", "amsp", None), ("tensorwise", "deepspeed", None),
    ("tensorwise", "internevo", None),
    ("rowwise", "megatron", None), ("blockwise", "torchtitan", None),
    ("mxfp8", "torchtitan", "hopper"), ("fp4", "torchtitan", None)])
def test_unsupported_combinations_are_user_errors(recipe, engine, arch):
    with pytest.raises(AmspUserError):
        fp8.recipe_for(recipe, engine, arch)


# ----- bytes by hand --------------------------------------------------------------------------
def test_cast_bytes_by_hand():
    e = 1024 * 4096
    t, r, b, mx = (fp8.RECIPE[x] for x in ("tensorwise", "rowwise", "blockwise", "mxfp8"))
    # torchao tensorwise: amax read 2e, two casts each read 2e write 1e, two fp32 scales
    assert fp8_casts.cast_bytes(t, 1024, 4096, "torchao") == 2 * e + 2 * 3 * e + 2 * 4
    # torchao rowwise: no amax pass; scales per row: 1024 + 4096 fp32
    assert fp8_casts.cast_bytes(r, 1024, 4096, "torchao") == 6 * e + (1024 + 4096) * 4
    # TE blockwise weight 256 x 256: fused cast-transpose (read 2e, write 2 x 1e); 2 x 2 blocks
    # of 128 x 128 per layout, fp32
    assert fp8_casts.cast_bytes(b, 256, 256, "te", weight=True) == 4 * 256 * 256 + 2 * 4 * 4
    # TE mxfp8 64 x 64: 64 rows x 2 blocks of 32 per layout, one E8M0 byte each
    assert fp8_casts.cast_bytes(mx, 64, 64, "te") == 4 * 64 * 64 + 2 * 128
    assert fp8_casts.linear_cast_bytes(t, 8, 16, 32, "torchao") == sum(
        8 * x + 8 for x in (8 * 16, 16 * 32, 8 * 32))


def test_compiled_cast_bytes_follow_torchaos_kernel_list():
    """torchao/testing/training/roofline_utils.py (0598012), fusion modelling on, per element:
    tensorwise activation [0 (amax fused), 2 + 2 x 1]; weight [2, 0, 2 + 1, 2 + 1];
    rowwise activation [1 + 2, 2 + 1]; weight [2 + 1, 2 x 2, 2 + 1]; plus the scales."""
    e = 1024 * 4096
    t, r = fp8.RECIPE["tensorwise"], fp8.RECIPE["rowwise"]
    assert fp8_casts.cast_bytes(t, 1024, 4096, "torchao", compiled=True) == 4 * e + 2 * 4
    assert fp8_casts.cast_bytes(t, 1024, 4096, "torchao", weight=True, compiled=True) \
        == 8 * e + 2 * 4
    assert fp8_casts.cast_bytes(r, 1024, 4096, "torchao", compiled=True) \
        == 6 * e + (1024 + 4096) * 4
    assert fp8_casts.cast_bytes(r, 1024, 4096, "torchao", weight=True, compiled=True) \
        == 10 * e + (1024 + 4096) * 4
    # Transformer Engine's kernels are its own, compiled or not
    assert fp8_casts.cast_bytes(t, 64, 64, "te", compiled=True) \
        == fp8_casts.cast_bytes(t, 64, 64, "te")


def test_fp8_all_gather_bytes_by_hand():
    m = load_model("llama3-8b")
    f = fp8.fp8_matmuls(m, "tensorwise", "torchtitan")
    lin, norms = f.fp8_params_per_block, 2 * 4096
    g = fp8_bytes.fp8_all_gather("tensorwise", "torchtitan", lin, norms, fp8_linears=7)
    assert g.fp8 and g.gather_bytes == 218_103_808 + 2 * 8192
    assert g.amax_allreduce_bytes == 28 and g.amax_allreduces == 0
    slow = fp8_bytes.fp8_all_gather("tensorwise", "torchtitan", lin, norms, 7, precompute=False)
    assert slow.amax_allreduces == 7
    # rowwise and MX gather in bf16 (torchao asserts tensorwise for the FP8 all-gather)
    for recipe in ("rowwise",):
        bf = fp8_bytes.fp8_all_gather(recipe, "torchtitan", lin, norms, 7)
        assert not bf.fp8 and bf.gather_bytes == 2 * (lin + norms)
    mg = fp8_bytes.fp8_all_gather("mxfp8", "megatron", 1 << 20, 0, 1)
    assert mg.gather_bytes == (1 << 20) * (1 + 1 / 32)


def test_memory_of_fp8_copies():
    # torchao keeps the bf16 input (save_for_backward(input_hp, weight_hp_t)); TE the FP8
    # column-wise input and its scale
    assert fp8_bytes.saved_input_bytes("rowwise", "torchtitan", 8192, 4096) == 2 * 8192 * 4096
    assert fp8_bytes.saved_input_bytes("tensorwise", "megatron", 8192, 4096) == 8192 * 4096 + 4
    assert fp8_bytes.weight_copy_bytes("tensorwise", "torchtitan", 1000) == 0
    assert fp8_bytes.weight_copy_bytes("delayed", "megatron", 1000) == 2000


def test_tp_wire_bytes():
    # torchao tensorwise: FP8 sequence-parallel all-gathers, bf16 reduce-scatters
    assert fp8_bytes.fp8_tp_wire("tensorwise", "torchtitan") == fp8_bytes.Fp8TpWire(1, 2, 1)
    assert fp8_bytes.fp8_tp_wire("rowwise", "torchtitan") == fp8_bytes.Fp8TpWire(2, 2, 0)
    # TE delayed scaling (layernorm_linear.py / base.py at v1.8): the norm output and the
    # output gradient gathered in FP8 (uint8), no amax all-reduce per gather (amax history)
    assert fp8_bytes.fp8_tp_wire("delayed", "megatron") == fp8_bytes.Fp8TpWire(1, 2, 0)
    assert fp8_bytes.fp8_tp_wire("delayed", "nemo@24.07") == fp8_bytes.Fp8TpWire(1, 2, 0)
    # TE current scaling (v2.9): FP8 gathers too, each quantizer's amax reduced over the TP
    # group first (_customize_quantizers_float8_current_scaling: with_amax_reduction)
    assert fp8_bytes.fp8_tp_wire("tensorwise", "megatron") == fp8_bytes.Fp8TpWire(1, 2, 1)
    assert fp8_bytes.fp8_tp_wire("tensorwise", "megatron-bridge@0.3.0") == \
        fp8_bytes.Fp8TpWire(1, 2, 1)
    assert fp8_bytes.fp8_tp_wire("blockwise", "megatron") == fp8_bytes.Fp8TpWire(2, 2, 0)


def test_te_current_scaling_casts_by_hand():
    """Transformer Engine, current scaling (tensorwise): the amax is a separate read of the
    operand (2 B/element) except where TE's kernel that produced it took the amax of its own
    output (normalization.cpp FUSED_NORM_AMAX_FP8 for linear_qkv and linear_fc1's input,
    activation.cpp FUSED_ACTIVATION_AMAX_FP8 for linear_fc2's input and, in the backward,
    linear_fc1's output gradient). Per element otherwise: the fused cast-transpose reads 2
    and writes 2 x 1; two 4-byte scales per operand."""
    from amsp_planner.cost.fp8 import RECIPE
    from amsp_planner.cost.fp8_casts import te_linear_cast_bytes

    cs, dl = RECIPE["tensorwise"], RECIPE["delayed"]
    m, k, n = 1024, 256, 512
    plain = lambda r, c: 4 * r * c + 8  # noqa: E731  cast-transpose + scales
    amax = lambda r, c: 2 * r * c  # noqa: E731
    w = plain(k, n) + amax(k, n)  # weights always take their own amax pass
    # no tensor parallelism
    assert te_linear_cast_bytes(cs, m, k, n, "linear_qkv", 1) == (
        plain(m, k) + plain(m, n) + amax(m, n) + w)          # norm-fed input, dy from attention
    assert te_linear_cast_bytes(cs, m, k, n, "linear_fc1", 1) == plain(m, k) + plain(m, n) + w
    assert te_linear_cast_bytes(cs, m, k, n, "linear_fc2", 1) == (
        plain(m, k) + plain(m, n) + amax(m, n) + w)          # activation-fed input
    assert te_linear_cast_bytes(cs, m, k, n, "linear_proj", 1) == (
        plain(m, k) + amax(m, k) + plain(m, n) + amax(m, n) + w)
    # delayed scaling: never an amax pass, whatever the producer
    assert te_linear_cast_bytes(dl, m, k, n, "linear_proj", 1) == (
        plain(m, k) + plain(m, n) + plain(k, n))
    # sequence parallel, tp 4: the gathered operand cast on m/4 rows (its amax read there too
    # unless fused), then the FP8 transpose on all rows (read 1 + write 1)
    tp = 4
    assert te_linear_cast_bytes(cs, m, k, n, "linear_fc1", tp) == (
        3 * m * k // tp + 2 * m * k + plain(m, n) + w)
    assert te_linear_cast_bytes(cs, m, k, n, "linear_fc2", tp) == (
        plain(m, k) + 5 * m * n // tp + 2 * m * n + w)      # dy from the residual: amax read


def test_tensorwise_tp_casts_each_gathered_input_once_on_its_shard():
    """torchao's Float8 TP classes (float8_tensor_parallel.py): the input of wq/wk/wv is cast
    once, on its sequence shard, before the FP8 all-gather; wo's output gradient likewise."""
    from amsp_planner.cost.fp8 import RECIPE
    from amsp_planner.cost.fp8_casts import tp_cast_bytes

    r = RECIPE["tensorwise"]
    m, k, n, tp = 1024, 512, 256, 4
    # by hand, bytes per element: amax read 2, cast read 2 + write 1, on m/tp rows; the
    # transposed FP8 layout of the gathered tensor read 1 + write 1 on all m rows; an
    # ordinary tensorwise operand: amax 2 + two casts of (2 + 1) = 8, plus 2 x 4 B of scales
    x_shard = 5 * m * k // tp + 2 * m * k        # 655,360 + 1,048,576
    dy = 8 * m * n + 8                           # 2,097,160
    w = 8 * k * n + 8                            # 1,048,584
    assert tp_cast_bytes(r, m, k, n, "wq", tp) == x_shard + dy + w
    assert tp_cast_bytes(r, m, k, n, "wk", tp) == 2 * m * k + dy + w  # shares wq's cast
    x = 8 * m * k + 8
    assert tp_cast_bytes(r, m, k, n, "wo", tp) == x + 5 * m * n // tp + 2 * m * n + w



def test_te_delayed_sequence_parallel_casts_on_the_shard_by_hand():
    """Transformer Engine v1.7-v1.9, sequence parallel, delayed scaling (layernorm_linear.py:
    the norm writes FP8 on the rank's rows, then gather_along_first_dim; base.py
    grad_output_preprocess "FP8 case with gather": cast_to_fp8, gather, fp8_transpose): the
    gathered operand is cast on 1/tp of the rows. Small job: h = 128, MHA, SwiGLU f = 256,
    TP 4 on H100 (HBM 2,010 GB/s: presets/gpus.yaml), one micro-batch of 128 tokens."""
    from amsp_testlib import small_model

    from amsp_planner.cost.fp8 import (
        RECIPE,
        block_linear_speedup,
        fp8_matmuls,
        linear_speedup,
        roofline_linear_s,
    )
    from amsp_planner.cost.fp8_casts import te_linear_cast_bytes
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_cluster

    def make_job(batch=1, **t):  # one micro-batch a step: no weight-cast sharing
        spec = TrainingSpec(seq_len=128, global_batch_seqs=batch, precision="fp8",
                            fp8_recipe="delayed", **t)
        return Job.create(small_model(), load_cluster("dgx-h100-ndr"), spec, 4, "megatron")

    r, m, tp = RECIPE["delayed"], 128, 4
    # linear_qkv (k 128, n 3 x 128 / 4 = 96): the norm output cast on 32 of the 128 rows
    # (read 2 + write 1 B), its FP8 transpose after the gather on all 128 (read 1 + write 1);
    # an ordinary TE operand: fused cast-transpose read 2 + write 2 x 1, no amax, 2 x 4 B scales
    x_shard = 3 * 32 * 128 + 2 * 128 * 128       # 12,288 + 32,768 = 45,056
    dy = w = 4 * 128 * 96 + 8                     # 49,160 each
    assert te_linear_cast_bytes(r, m, 128, 96, "linear_qkv", tp) == x_shard + dy + w == 143_376
    # linear_proj (k 32, n 128): its output gradient (128 x 128) cast on 32 rows, gathered
    x, w = 4 * 128 * 32 + 8, 4 * 32 * 128 + 8     # 16,392 each
    assert te_linear_cast_bytes(r, m, 32, 128, "linear_proj", tp) == x + 45_056 + w
    # all rows cast (the roofline's linear_cast_bytes): 4 x 128 x 128 + 8 = 65,544 for the
    # gathered operand, so the shard saves 20,488 B = 10.19 ns a linear on this job's H100
    job = make_job()
    gpu = job.cluster.gpu
    lin = {x.name: x for x in fp8_matmuls(job.model, "delayed", "megatron", tp).block}
    for name, (k, n) in {"linear_qkv": (128, 96), "linear_proj": (32, 128)}.items():
        assert (lin[name].k, lin[name].n) == (k, n)
        bf16 = roofline_linear_s(gpu, m, k, n, None)
        old = linear_speedup(gpu, "delayed", m, k, n, "megatron")
        assert old.how == "roofline"  # no Hopper grid for TE's delayed recipe
        new = block_linear_speedup(job, "delayed", m, lin[name], tp)
        assert bf16 / old.value - bf16 / new == pytest.approx(20_488 / 2010e9, rel=1e-9)
    # without sequence parallelism every rank holds all rows: cast on all of them
    nosp = make_job(sequence_parallel=False)
    assert block_linear_speedup(nosp, "delayed", m, lin["linear_qkv"], tp) == \
        linear_speedup(gpu, "delayed", m, 128, 96, "megatron").value
    # 8 sequences a step on one data-parallel rank (TP 4 of 4 GPUs): 8 micro-batches share one
    # FP8 copy of each weight (Megatron-Core's set_is_first_microbatch): 7/8 of linear_qkv's
    # weight cast, 49,160 B, leaves the micro-batch
    eight = make_job(batch=8, sequence_parallel=False)
    bf16 = roofline_linear_s(gpu, m, 128, 96, None)
    one = block_linear_speedup(nosp, "delayed", m, lin["linear_qkv"], tp)
    shared = block_linear_speedup(eight, "delayed", m, lin["linear_qkv"], tp)
    assert bf16 / one - bf16 / shared == pytest.approx(7 / 8 * 49_160 / 2010e9, rel=1e-9)


def test_tensorwise_tp_all_gathers_move_one_byte_per_element():
    """The blocks' sequence-parallel all-gathers carry FP8 under torchao's tensorwise TP (each
    after a 4-byte amax all-reduce); the head's all-gather and every reduce-scatter stay bf16."""
    from amsp_planner.cost.job import Job
    from amsp_planner.cost.tp_schedule import tp_entries
    from amsp_planner.specs import TrainingSpec, load_cluster, load_model

    def entries(precision, recipe=None):
        t = TrainingSpec(seq_len=4096, global_batch_seqs=8, precision=precision,
                         fp8_recipe=recipe)
        job = Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"), t, 8,
                         "torchtitan")
        return {(e.phase, e.op): e for e in tp_entries(job, 2, 1, False, 4)}

    bf16, fp8, row = entries("bf16"), entries("fp8", "tensorwise"), entries("fp8", "rowwise")
    el, layers, n_micro = 4096 * 4096, 32, 4  # b*s*h elements per call; L; micro-batches
    fwd = fp8[("forward", "all_gather")]
    # forward: 2 per block at 1 B + the head's at 2 B, per micro-batch
    assert fwd.full_bytes_per_step == n_micro * (2 * layers * el + 2 * el) and fwd.dtype == "fp8"
    assert bf16[("forward", "all_gather")].full_bytes_per_step == n_micro * (2 * layers + 1) * 2 * el
    # backward: 2 per block at 1 B, the embedding's transposed reduce-scatter at 2 B
    assert fp8[("backward", "all_gather")].full_bytes_per_step == \
        n_micro * (2 * layers * el + 2 * el)
    for key in (("forward", "reduce_scatter"), ("backward", "reduce_scatter")):
        assert fp8[key].full_bytes_per_step == bf16[key].full_bytes_per_step
    # one 4-byte amax all-reduce per FP8 all-gather: 2 forward and 2 backward per block
    def amax(es):
        return {e.phase: e.calls_per_step for e in es if e.op == "all_reduce"
                and e.full_bytes_per_step == 4 * e.calls_per_step}

    t = TrainingSpec(seq_len=4096, global_batch_seqs=8, precision="fp8", fp8_recipe="tensorwise")
    job = Job.create(load_model("llama3-8b"), load_cluster("dgx-h100-ndr"), t, 8, "torchtitan")
    assert amax(tp_entries(job, 2, 1, False, 4)) == {"forward": n_micro * 2 * layers,
                                                     "backward": n_micro * 2 * layers}
    # rowwise gathers bf16 (torchtitan uses the bf16 TP classes for it)
    assert row[("forward", "all_gather")].full_bytes_per_step == \
        bf16[("forward", "all_gather")].full_bytes_per_step
