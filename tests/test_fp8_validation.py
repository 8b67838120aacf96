"""Published FP8 rows in validation.yaml: paired with the bf16 row of the same source and job,
their published speed-ups as the sources print them, and bad pairings refused by name."""

from __future__ import annotations

import copy

import pytest
from test_dgxc_rows import README as DGXC  # the dgxc READMEs' tables, typed there

from amsp_planner.validation import check_rows, fp8_pairs, load_rows, predict_rows


@pytest.fixture(scope="module")
def doc():
    return load_rows()


@pytest.fixture(scope="module")
def pairs(doc):
    return {p.fp8.id: p for p in fp8_pairs(predict_rows(doc))}


# (FP8 row, bf16 row, FP8 / bf16 throughput as the source prints it)
PUBLISHED = [
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3
    ("tt-h100-l3-8b-8-fp8", "tt-h100-l3-8b-8-compile", 8532 / 6667),
    ("tt-h100-l3-8b-128-fp8", "tt-h100-l3-8b-128-compile", 8380 / 6514),
    # torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP column
    ("tt-h100-l3-70b-tp8-fp8", "tt-h100-l3-70b-tp8", 809.8 / 597.3),
    ("tt-h100-l3-70b-tp8-fp8row", "tt-h100-l3-70b-tp8", 599.6 / 597.3),
    ("tt-h100-l3-8b-tp8-fp8", "tt-h100-l3-8b-tp8", 5078.1 / 4378),
    ("tt-h100-l3-8b-tp8-fp8row", "tt-h100-l3-8b-tp8", 3708.5 / 4378),
    # the same file, async TP column (tp_overlap), against the bf16 async TP row
    ("tt-h100-l3-70b-tp8-fp8-async", "tt-h100-l3-70b-tp8-async", 942.4 / 652.4),
    ("tt-h100-l3-70b-tp8-fp8row-async", "tt-h100-l3-70b-tp8-async", 624.8 / 652.4),
    ("tt-h100-l3-8b-tp8-fp8-async", "tt-h100-l3-8b-tp8-async", 5570.1 / 4809.4),
    ("tt-h100-l3-8b-tp8-fp8row-async", "tt-h100-l3-8b-tp8-async", 3914.9 / 4809.4),
    # torchao/float8/README.md Llama-3-8B table: bf16 6150, tensorwise + FP8 all-gather
    # 7689.5, rowwise 6768
    ("torchao-h100-l3-8b-fp8", "torchao-h100-l3-8b-bf16", 7689.5 / 6150),
    ("torchao-h100-l3-8b-fp8row", "torchao-h100-l3-8b-bf16", 6768 / 6150),
    # allenai/OLMo-core README.md at 984eb263f: BF16 and BF16/FP8 TPS per device
    ("olmocore-h100-1b-fp8", "olmocore-h100-1b-bf16", 51000 / 44000),
    ("olmocore-h100-7b-fp8", "olmocore-h100-7b-bf16", 13000 / 10000),
    ("olmocore-h100-13b-fp8", "olmocore-h100-13b-bf16", 5500 / 4600),
    # AWS blog "Efficient Pre-training of Llama 3-like model architectures using torchtitan
    # on Amazon SageMaker": compile 7,166; FP8 linears 8,624; with FP8 all-gathers 8,950
    ("aws-tt-p5-l3-8b-32-fp8", "aws-tt-p5-l3-8b-32-compile", 8624 / 7166),
    ("aws-tt-p5-l3-8b-32-fp8ag", "aws-tt-p5-l3-8b-32-compile", 8950 / 7166),
    # the same README at 3a4034597: OLMo2-1B 55,000 / 65,000, Llama3-8B 9,500 / 12,500
    ("olmocore2501-h100-1b-fp8", "olmocore2501-h100-1b-bf16", 65000 / 55000),
    ("olmocore2501-h100-l3-8b-fp8", "olmocore2501-h100-l3-8b-bf16", 12500 / 9500),
    # PyTorch blog "Supercharging Training using float8 and FSDP2", Table 3 (512 H100)
    ("ibm-f8-h100-l3-70b-512-fp8", "ibm-f8-h100-l3-70b-512-bf16", 1448 / 960),
    ("ibm-f8-h100-l31-405b-tp4-512-fp8", "ibm-f8-h100-l31-405b-tp4-512-bf16", 217 / 152),
    # mosaicml/llm-foundry scripts/train/benchmarking/README.md at b2a43a1, "H100 80GB FP8"
    # against "H100 80GB BF16" (Throughput T/s/GPU), the same micro-batch and accumulation
    ("mpt-h100-3b-s32768-8-fp8", "mpt-h100-3b-s32768-8", 5856 / 5873),
    ("mpt-h100-3b-s8192-8-fp8", "mpt-h100-3b-s8192-8", 19146 / 16578),
    ("mpt-h100-3b-s512-8-fp8", "mpt-h100-3b-s512-8", 36527 / 27965),
    ("mpt-h100-1b-s32768-8-fp8", "mpt-h100-1b-s32768-8", 12580 / 12025),
    ("mpt-h100-1b-s512-8-fp8", "mpt-h100-1b-s512-8", 70315 / 52275),
    # NVIDIA/dgxc-benchmarking at 8f5cbb37 (NeMo 24.12), "Throughput in tokens per second",
    # FP8 table over BF16 table, the same GPU count
    *((f"dgxc2502-{k}-{g}-fp8", f"dgxc2502-{k}-{g}", f / b)
      for k, (_, cols) in DGXC.items() for g, (_, b, f) in cols.items()),
]


@pytest.mark.parametrize("fp8,bf16,speedup", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_each_fp8_row_is_paired_with_its_sources_bf16_row(pairs, fp8, bf16, speedup):
    p = pairs[fp8]
    assert p.bf16.id == bf16 and p.fp8.precision == "fp8" and p.bf16.precision == "bf16"
    assert p.published == pytest.approx(speedup)
    assert p.fp8.strategy == p.bf16.strategy  # the same job, only the precision differs
    assert p.points == pytest.approx(100 * (p.predicted - speedup))


def test_the_fp8_rows_name_their_recipe(pairs):
    recipes = {k: p.fp8.recipe for k, p in pairs.items()}
    assert recipes["torchao-h100-l3-8b-fp8row"] == "rowwise"
    assert recipes["tt-h100-l3-8b-8-fp8"] == "tensorwise"
    assert recipes["mpt-h100-1b-s512-8-fp8"] == "delayed"  # Transformer Engine's default
    assert set(pairs) == {p[0] for p in PUBLISHED}


def test_the_405b_float8_rows_have_no_bf16_row_of_their_job(doc, pairs):
    """torchtitan docs/performance.md (9515a140, 3faaa1a): the 405B "None" row (109, first
    published as 118) ran the toml before 9515a140, compile = false; the Float8 rows the
    commit's toml, compile on with FP8 FSDP all-gathers. Not one job, so not paired."""
    rows = {r["id"]: r for r in doc["rows"]}
    bf16 = rows["tt-h100-l31-405b-tp8"]
    assert bf16["value"] == 109 and not bf16["training"].get("compile", False)
    for rid, value in (("tt-h100-l31-405b-tp8-fp8", 177), ("tt-h100-l31-405b-tp8-fp8-async", 185)):
        r = rows[rid]
        assert r["value"] == value and "bf16_row" not in r and rid not in pairs
        assert r["training"]["compile"] and r["training"]["fp8_all_gather"] == "on"


@pytest.mark.parametrize("change,says", [
    (lambda r: r.update(bf16_row="no-such-row"), "'no-such-row' is not a bf16 row"),
    (lambda r: r.update(bf16_row="tt-h100-l3-8b-8-compile"), "differs in 'gpus'"),
    (lambda r: r["training"].update(precision="bf16"), "is for an FP8 row"),
])
def test_a_bad_bf16_row_is_named(doc, change, says):
    bad = copy.deepcopy(doc)
    row = next(r for r in bad["rows"] if r["id"] == "tt-h100-l3-8b-128-fp8")
    change(row)
    with pytest.raises(ValueError, match=f"row tt-h100-l3-8b-128-fp8: .*{says}"):
        check_rows(bad)


def test_composers_transformer_engine_layers_recast_every_micro_batch():
    """llm-foundry's FP8 rows (Composer's amp_fp8 over FSDP1, ``te.Linear`` layers): nothing
    sets TE's ``is_first_microbatch``, so each micro-batch casts every weight again, and FSDP1
    gathers the parameters in their own dtype; Megatron-Core shares one cast per step and
    gathers FP8 with --fp8-param-gather. Small job: 4 GPUs, one 128-token micro-batch, 1 or 8
    a step, delayed scaling on an H100."""
    from amsp_testlib import small_model

    from amsp_planner.cost.fp8 import block_linear_speedup, fp8_all_gather_supported, fp8_matmuls
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_cluster

    def speedup(engine, batch):
        spec = TrainingSpec(seq_len=128, global_batch_seqs=4 * batch, precision="fp8",
                            fp8_recipe="delayed", sequence_parallel=False)
        job = Job.create(small_model(), load_cluster("dgx-h100-ndr"), spec, 4, engine)
        qkv = fp8_matmuls(job.model, "delayed", engine).block[0]
        return block_linear_speedup(job, "delayed", 128, qkv, 1)

    assert speedup("fsdp", 8) == speedup("fsdp", 1)
    assert speedup("megatron", 8) > speedup("megatron", 1)
    assert speedup("fsdp", 1) == speedup("megatron", 1)  # the same TE kernels otherwise
    assert not fp8_all_gather_supported("delayed", "fsdp")
    assert fp8_all_gather_supported("delayed", "megatron")


# FP8-LM (arXiv 2310.18313), system-performance table: (row, samples/s, GPUs, GPU Mem. GB)
FP8LM = [("fp8lm-gpt7b-32-bf16", 159.2, 32, 69.6), ("fp8lm-gpt7b-32-fp8", 224.5, 32, 77.3),
         ("fp8lm-gpt13b-32-bf16", 79.3, 32, 68.2), ("fp8lm-gpt13b-32-fp8", 111.7, 32, 76.4),
         ("fp8lm-gpt175b-128-bf16", 22.4, 128, 66.1), ("fp8lm-gpt175b-128-fp8", 28.7, 128, 69.6)]


@pytest.mark.parametrize("rid,samples,gpus,mem", FP8LM, ids=[r[0] for r in FP8LM])
def test_the_fp8_lm_rows_are_the_tables_figures(doc, rid, samples, gpus, mem):
    """Tokens/s/GPU are the table's samples/s x 2,048 tokens / GPUs; each peak is the table's
    GPU memory, in a row of its own where the throughput is out of scope (7B, 13B)."""
    rows = {r["id"]: r for r in doc["rows"]}
    row = rows[rid]
    assert (row["gpus"], row["seq_len"]) == (gpus, 2048)
    assert row["value"] == pytest.approx(samples * 2048 / gpus, abs=0.05)
    peak = rows.get(rid + "-mem", row)
    assert peak.get("memory_gib", peak["value"]) == mem
    assert peak["memory_kind"] == "device"
    if rid.endswith("-fp8"):
        assert row["training"]["fp8_recipe"] == "delayed"
