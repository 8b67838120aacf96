"""Optimizer offload to host memory (cost/offload.py): the bytes it moves off the GPU, the
seconds it adds, derived by hand for Llama-3-8B on one DGX H200 node, and where it is refused."""

from __future__ import annotations

import pytest

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import Strategy

GIB = 2**30
ZERO3 = Strategy(s_p=8, s_g=8, s_os=8, micro_batch=1, ckpt=True)


def job(offload="cpu", engine="deepspeed", cluster="dgx-h200-ndr", model="llama3-8b"):
    t = TrainingSpec(seq_len=8192, global_batch_seqs=8, activation_profile="fused",
                     optimizer_offload=offload)
    return Job.create(load_model(model), load_cluster(cluster), t, 8, engine=engine)


def test_states_leave_the_gpu_by_hand():
    on, off = evaluate(job("none"), ZERO3).memory, evaluate(job(), ZERO3).memory
    # Llama-3-8B: 8,030,261,248 parameters; a rank's shard of 1/8 is ~1.004e9 elements
    shard = job().tp_phi(1) / 8
    assert shard == pytest.approx(8_030_261_248 / 8, rel=1e-4)
    # on the GPU: 2 (bf16 params) + 2 (bf16 grad shard) + 12 (fp32 master, m, v) bytes
    assert on.params == off.params == pytest.approx(2 * shard)
    assert on.grads == pytest.approx(2 * shard) and on.optimizer == pytest.approx(12 * shard)
    # offloaded: the master, both moments and the grad shard are in host memory
    assert off.grads == 0 and off.optimizer == 0
    assert (on.model_states - off.model_states) / GIB == pytest.approx(14 * 1.00378e9 / GIB,
                                                                       rel=1e-3)
    # ZeRO-1 (gradients not sharded): its full gradients stay on the GPU
    z1 = evaluate(job(), Strategy(s_p=1, s_g=1, s_os=8, micro_batch=1,
                                  ckpt=True)).memory
    assert z1.grads == pytest.approx(2 * job().tp_phi(1)) and z1.optimizer == 0


def test_step_seconds_by_hand():
    # 8 ranks x 1.00378e9 elements x (28 Adam + 4 + 2 conversion) bytes over
    # 614.4 GB/s x 0.26 of host memory, then 2 bytes per element over 55 GB/s of PCIe
    host = 8 * 1.00378e9 * 34 / (614.4e9 * 0.26)
    link = 1.00378e9 * 2 / 55e9
    assert (host, link) == (pytest.approx(1.7090, abs=1e-3), pytest.approx(0.0365, abs=1e-3))
    on, off = evaluate(job("none"), ZERO3), evaluate(job(), ZERO3)
    assert off.time.optimizer_s == pytest.approx(host + link, rel=1e-3)
    assert on.time.optimizer_s < 0.02  # on the GPU: HBM-bound, ~10 ms
    # the rest of the step is unchanged (gradient copies overlap the backward)
    assert off.step_s - off.time.optimizer_s == pytest.approx(
        on.step_s - on.time.optimizer_s, rel=1e-9)


def test_gradient_copies_fit_under_the_backward():
    from amsp_planner.cost.offload import grad_copy_s

    j = job()
    ev = evaluate(j, ZERO3)
    # 6 bytes per element device -> host: ~0.11 s, well under the backward's compute
    assert grad_copy_s(j, j.tp_phi(1) / 8) == pytest.approx(1.00378e9 * 6 / 55e9, rel=1e-3)
    assert grad_copy_s(j, j.tp_phi(1) / 8) < ev.time.compute_s / 3


@pytest.mark.parametrize("kw,needle", [
    ({"engine": "amsp"}, "use --engine deepspeed"),
    ({"engine": "fsdp2"}, "use --engine deepspeed"),
    ({"cluster": "aws-p5"}, "host_link_gbyte_per_s"),
])
def test_refused_in_one_line(kw, needle):
    with pytest.raises(AmspUserError) as e:
        job(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bundled_runtime_refuses():
    from amsp_planner.runtime.support import check_tp

    with pytest.raises(AmspUserError, match="bundled runtime keeps the optimizer on the GPU"):
        check_tp(ZERO3, job())


def test_export_writes_deepspeeds_own_offload_config():
    from amsp_planner.exports import deepspeed as ds

    zero = ds.config_dict(job(), ZERO3)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" not in ds.config_dict(job("none"), ZERO3)["zero_optimization"]
    zc = pytest.importorskip("deepspeed.runtime.zero.config")
    cfg = zc.DeepSpeedZeroConfig(**zero)
    assert cfg.offload_optimizer.device == "cpu" and cfg.offload_optimizer.pin_memory
    # one sub-group of up to 1e9 elements: the copy to the GPU follows its CPU step
    assert cfg.sub_group_size == 1_000_000_000


def test_plan_files_unchanged_without_offload():
    t = TrainingSpec(seq_len=8192, global_batch_seqs=8)
    assert "optimizer_offload" not in t.model_dump()
    assert TrainingSpec(seq_len=8192, global_batch_seqs=8,
                        optimizer_offload="cpu").model_dump()["optimizer_offload"] == "cpu"


def test_no_stage_0_with_offload():
    # DeepSpeed offloads through its ZeRO optimizers only: the search keeps stages 1-3
    from amsp_planner.engines import PROFILES

    t = job().training
    triples = PROFILES["deepspeed"].triples(8, 8, t)
    assert (1, 1, 1) not in triples and (8, 8, 8) in triples
    assert (1, 1, 1) in PROFILES["deepspeed"].triples(8, 8, job("none").training)


@pytest.mark.parametrize("model,cluster,nodes,frac,objective", [
    ("llama3-8b", "dgx-h200-ndr", 1, 0.3, "time"),
    ("llama-7b", "dgx-a100-hdr", 2, 0.15, "time"),
    ("tiny", "dgx-h100-ndr", 1, 0.5, "comm"),
    ("llama3-8b", "dgx-a100-hdr", 4, 0.1, "time"),
])
def test_ilp_equals_brute_force_with_offload(model, cluster, nodes, frac, objective):
    # the ILP's memory and optimizer tables take the offload as evaluate does
    from test_solver import check_against_brute_force, make_job

    j = make_job(model, cluster, 8 * nodes, 1, 2048, engine="deepspeed", layers=2,
                 optimizer_offload="cpu")
    ddp = evaluate(j, Strategy(s_os=8 * nodes), float("inf")).memory.total
    check_against_brute_force(j, ddp * frac, True, objective)
