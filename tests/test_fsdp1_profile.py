"""The FSDP1 profile (engines.PROFILES['fsdp']) against torch 2.13's own FSDP1 code and defaults,
and the step-time difference it makes, derived by hand."""

from __future__ import annotations

import inspect

import pytest

from amsp_planner.engines import ENGINES, PRICED_ONLY, PROFILES
from amsp_planner.validation import pricing_engine

torch = pytest.importorskip("torch")


def test_fsdp1_defaults_are_torchs():
    """FullyShardedDataParallel's signature: backward_prefetch BACKWARD_PRE, limit_all_gathers
    on, forward_prefetch off; the profile says BACKWARD_PRE ('pre')."""
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel

    sig = inspect.signature(FullyShardedDataParallel.__init__).parameters
    assert sig["backward_prefetch"].default is BackwardPrefetch.BACKWARD_PRE
    assert sig["limit_all_gathers"].default is True
    assert sig["forward_prefetch"].default is False
    assert PROFILES["fsdp"].execution.backward_prefetch == "pre"


def test_fsdp1_gathers_into_the_flat_parameter_fsdp2_copies_out():
    """FSDP1 all-gathers into the padded unsharded FlatParameter (no copy after it); FSDP2
    copies the gathered buffer out to each parameter (split_with_sizes_copy)."""
    from torch.distributed.fsdp import _flat_param
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    src = inspect.getsource(_flat_param.FlatParamHandle._all_gather_flat_param)
    assert "all_gather_single(\n                padded_unsharded_flat_param" in src
    assert "copy" not in src.split('"""')[-1]  # nothing copied after the gather
    out = inspect.getsource(_fsdp_collectives.foreach_all_gather_copy_out)
    assert "split_with_sizes_copy" in out
    assert PROFILES["fsdp"].execution.gather_copy_out is False
    assert PROFILES["fsdp2"].execution.gather_copy_out is True


def test_fsdp_rows_priced_with_fsdp1_profile_not_offered_by_engine():
    assert "fsdp" in PRICED_ONLY and "fsdp" not in ENGINES
    assert pricing_engine("fsdp") == ("fsdp", "")
    assert pricing_engine("fairscale")[0] == "fsdp2"


def _collective_order(mode):
    """The collectives torch's FSDP1 issues in one backward of three wrapped linear layers
    (a fake process group of 2 ranks on CPU), as ('AG' | 'RS', elements of the unit)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    log = []
    ag, rs = dist.all_gather, dist.reduce_scatter_single

    def ag2(lst, inp, *a, **k):
        log.append(("AG", inp.numel() * 2))  # the rank's shard of 2
        return ag(lst, inp, *a, **k)

    def rs2(out, inp, *a, **k):
        log.append(("RS", inp.numel()))
        return rs(out, inp, *a, **k)

    dist.all_gather, dist.reduce_scatter_single = ag2, rs2
    try:
        torch.manual_seed(0)
        cpu = torch.device("cpu")
        blocks = [FSDP(nn.Linear(4 * (i + 1), 4 * (i + 2)), device_id=cpu, backward_prefetch=mode)
                  for i in range(3)]
        model = FSDP(nn.Sequential(*blocks), device_id=cpu, backward_prefetch=mode)
        for _ in range(2):  # the second step runs with the recorded execution order
            log.clear()
            out = model(torch.randn(2, 4)).sum()
            del log[:3]  # the forward's three all-gathers
            out.backward()
    finally:
        dist.all_gather, dist.reduce_scatter_single = ag, rs
    return log


def test_backward_post_issues_collectives_in_backward_pre_order():
    """BACKWARD_POST issues the next all-gather from the post-backward hook, before the unit's
    reduce-scatter; BACKWARD_PRE from the pre-backward hook: on the process group's one NCCL
    stream both come out in the same order, each next all-gather ahead of the current
    reduce-scatter (the step model's m_i = b_(i-1) + r_(i+1), both modes priced alike);
    without prefetch the next all-gather waits behind the reduce-scatter."""
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already up in this worker")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        u3, u2, u1 = 16 * 12 + 16, 12 * 8 + 12, 8 * 4 + 8  # weight + bias of each layer
        pre = _collective_order(BackwardPrefetch.BACKWARD_PRE)
        post = _collective_order(BackwardPrefetch.BACKWARD_POST)
        none = _collective_order(None)
    finally:
        dist.destroy_process_group()
    want = [("AG", u3), ("AG", u2), ("RS", u3), ("AG", u1), ("RS", u2), ("RS", u1)]
    assert pre == want
    assert post == want
    assert none == [("AG", u3), ("RS", u3), ("AG", u2), ("RS", u2), ("AG", u1), ("RS", u1)]


def test_fsdp1_step_is_fsdp2_less_the_copy_out_by_hand():
    """llama-7b (6,738,415,616 parameters) FULL_SHARD on one DGX A100 node, one micro-batch of
    4: FSDP2 copies each gathered unit out twice (forward and backward gathers), read + write
    of 2 bytes per parameter at the A100 80GB's 1,223 GB/s (presets/gpus.yaml), on the compute
    stream, which FSDP1 does not run. The job is compute-bound, so its step is that much
    shorter, but for the embedding's copies (32,000 x 4,096 = 131,072,000 parameters): the
    embedding computes nothing, its copies hide under the gather (forward) and reduction
    (backward) in flight beside them. 4 x 2 x (6,738,415,616 - 131,072,000) / 1.223e12 =
    43.22 ms."""
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.cost.job import Job
    from amsp_planner.specs import TrainingSpec, load_cluster, load_model
    from amsp_planner.strategy import parse_strategy_or_baseline

    model, cluster = load_model("llama-7b"), load_cluster("dgx-a100-hdr")
    t = TrainingSpec(seq_len=2048, global_batch_seqs=32)
    steps = {}
    for eng in ("fsdp", "fsdp2"):
        job = Job.create(model, cluster, t, 8, engine=eng)
        steps[eng] = evaluate(job, parse_strategy_or_baseline("zero3,mb=4", 8, 8)).step_s
    assert steps["fsdp2"] - steps["fsdp"] == pytest.approx(
        4 * 2 * (6_738_415_616 - 131_072_000) / 1.223e12, rel=0.002)
