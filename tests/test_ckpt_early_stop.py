"""Full checkpointing under torch's non-reentrant checkpoint stops recomputing once the block's
saved tensors are back (EngineProfile.ckpt_early_stop): measured on CPU with torch, the
block's last linear is not rerun; the model's recompute by hand; the engines that do it."""

from __future__ import annotations

from pathlib import Path

import pytest
from amsp_testlib import small_model

from amsp_planner.cost.compute import _matmul, _rates, recompute_s
from amsp_planner.cost.job import Job
from amsp_planner.cost.tp_schedule import tp_recompute_s
from amsp_planner.engines import PROFILES
from amsp_planner.specs import TrainingSpec, load_cluster

RUNTIME = Path(__file__).resolve().parent.parent / "amsp_planner" / "runtime"


def _linears_rerun(use_reentrant: bool) -> int:
    """Linear layers a GELU block's checkpointed backward runs forward again."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, h=32):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
            x = x + self.o(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    block = Block()
    calls = []
    for name in ("qkv", "o", "fc1", "fc2"):
        getattr(block, name).register_forward_hook(lambda m, i, o, n=name: calls.append(n))
    x = torch.randn(2, 8, 32, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=use_reentrant)
    calls.clear()  # the first forward
    y.sum().backward()
    return calls


def test_measured_the_last_linear_is_not_rerun():
    pytest.importorskip("torch")
    # a module's forward hook fires after its forward: fc2 stopped before it ran
    assert _linears_rerun(False) == ["qkv", "o", "fc1"]
    assert _linears_rerun(True) == ["qkv", "o", "fc1", "fc2"]


def test_the_engines_that_stop_early():
    # the bundled runtime checkpoints non-reentrantly (runtime/model.py, runtime/tp.py)
    code = "".join(p.read_text() for p in RUNTIME.glob("*.py"))
    assert "use_reentrant=False" in code and "use_reentrant=True" not in code
    assert PROFILES["amsp"].ckpt_early_stop and PROFILES["fsdp2"].ckpt_early_stop
    assert PROFILES["fsdp"].ckpt_early_stop  # torch >= 2.1; fsdp@1.13.1 and @2.0.0 not
    assert not PROFILES["fsdp@1.13.1"].ckpt_early_stop
    # torchtitan passes early_stop=False since 25413d224 (2025-08-29); v0.1.0 did not
    assert not PROFILES["torchtitan"].ckpt_early_stop
    assert PROFILES["torchtitan@0.1.0"].ckpt_early_stop
    for reentrant in ("megatron", "deepspeed", "internevo"):
        assert not PROFILES[reentrant].ckpt_early_stop


def _job(engine: str, **t) -> Job:
    spec = TrainingSpec(seq_len=128, global_batch_seqs=8, **t)
    return Job.create(small_model(), load_cluster("dgx-h100-ndr"), spec, 4, engine)


def test_recompute_by_hand():
    # small_model: 2 blocks, SwiGLU f = 256; one micro-batch of 2 sequences of 128 tokens per
    # GPU (8 sequences on 4 GPUs: 1 micro-batch of 2). Early stop spares each checkpointed
    # block the down projection w2 (K = f = 256, N = h = 128) of the 256 tokens.
    stop, full = _job("torchtitan@0.1.0"), _job("torchtitan")
    w2 = _matmul(_rates(stop), 256, 256, 128)
    assert recompute_s(full, 2, True) - recompute_s(stop, 2, True) == pytest.approx(2 * w2)
    # the first K of L blocks: the same per checkpointed block
    assert recompute_s(full, 2, 1) - recompute_s(stop, 2, 1) == pytest.approx(w2)
    # op-level keeps the matmul outputs: no difference
    assert recompute_s(full, 2, "op") == pytest.approx(recompute_s(stop, 2, "op"))


def test_tensor_parallel_recompute_skips_the_last_reduce_scatter():
    # TP 2 with sequence parallelism, not overlapped: a block's forward moves 2 all-gathers and
    # 2 reduce-scatters of b*s*h elements; stopping early leaves one reduce-scatter out
    stop, full = _job("torchtitan@0.1.0"), _job("torchtitan")
    elems = 2 * 128 * 128
    rs = stop.topology.collective_time("reduce_scatter", 2, 1, elems * 2)
    assert tp_recompute_s(full, 2, True, 2) - tp_recompute_s(stop, 2, True, 2) == \
        pytest.approx(rs)
    amsp = _job("amsp")  # no early stop under TP (above): the recompute counts both
    assert tp_recompute_s(amsp, 2, True, 2) == pytest.approx(tp_recompute_s(full, 2, True, 2))


def test_the_priced_schedule_reruns_what_the_recompute_counts():
    # the step's TP entries (what the step time and the runtime's bytes use) must leave the
    # same reduce-scatter out: 2 blocks, tp=2 over 4 GPUs, 8 sequences of 128 at mb=2 -> 2
    # data-parallel ranks x 2 micro-batches; recomputed, per step: 2 all-gathers per block and
    # micro-batch, and 2 reduce-scatters (1 when the checkpoint stops early)
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.strategy import Strategy

    s = Strategy(s_p=2, s_g=2, s_os=2, ckpt=True, tp=2, micro_batch=2)
    # the bundled runtime turns the early stop off under TP (runtime/tp.py run_block; its
    # bytes measured in tests/runtime/test_sharded_training.py, tp2_zero3_ckpt1): both rerun
    for engine, rs_per_block in (("torchtitan@0.1.0", 1), ("torchtitan", 2), ("amsp", 2)):
        e = evaluate(_job(engine), s)
        rec = {x.op: x for x in e.schedule if x.phase == "recompute"}
        assert rec["all_gather"].calls_per_step == 2 * 2 * 2
        assert rec["reduce_scatter"].calls_per_step == rs_per_block * 2 * 2
        assert rec["reduce_scatter"].full_bytes_per_step == \
            rs_per_block * 2 * 2 * 2 * 128 * 128 * 2  # b*s*h bf16 elements each


def test_an_engine_switch_names_the_early_stop_where_the_plan_checkpoints():
    from amsp_planner.exports.common import translate
    from amsp_planner.strategy import Strategy

    job = _job("amsp")
    for ckpt, named in ((True, True), (False, False), ("op", False)):
        s = Strategy(s_p=4, s_g=4, s_os=4, micro_batch=2, ckpt=ckpt is True,
                     ckpt_op=ckpt == "op")
        diffs = " ".join(translate(job, s, "deepspeed", None)[3])
        assert ("ckpt_early_stop on -> off" in diffs) is named, (ckpt, diffs)
