"""Mixture-of-experts training under torchrun (gloo): expert parallelism e = 2 and 4 with the
expert class sharded by its own triple, fp32 parity with the single-process reference, the
token all-to-alls against values derived by hand (and the plan's schedule), checkpoints
resharded across EP degrees (issue #26, part 4).

Two launches carry every check: 4 processes on one node, and 8 processes as 2 nodes of 4 (two
torchrun agents on loopback, so the EP groups that span nodes are real).

The model (tests/data/tiny-moe-shared.yaml): L = 3 (layer 0 dense, layers 1-2 MoE: M = 2),
h = 64, E = 8 routed experts of width 32 (3 h f_e = 6144 elements each), top-2, a shared
expert; sequences of S = 32, fp32, one sequence per micro-batch. The preset ``tiny-moe`` (four
MoE layers, no shared expert) runs once for parity and the plan's bytes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from amsp_planner.cost.job import Job  # noqa: E402
from amsp_planner.errors import AmspUserError  # noqa: E402
from amsp_planner.specs.loader import load_cluster, load_model  # noqa: E402
from amsp_planner.specs.training import TrainingSpec  # noqa: E402

from .mp import run_worker  # noqa: E402

SPEC = str(Path(__file__).resolve().parents[1] / "data" / "tiny-moe-shared.yaml")
STEPS = 3
M_LAYERS, H, S, K, E, EXPERT = 2, 64, 32, 2, 8, 6144
RUNS_4 = {
    "e2": "ep=2,p=4,g=4,os=4,ep.p=2,ep.g=2,ep.os=2,mb=1",
    "e4": "ep=4,p=2,g=4,os=4,ep.p=1,ep.g=1,ep.os=1,mb=1",
    # an expert triple unlike the dense one, the EP group strided, every block recomputed
    "e2_span_ckpt": "ep=2,ep.span,p=1,g=2,os=4,ep.p=1,ep.g=1,ep.os=2,mb=1,ckpt",
    # the first 2 blocks checkpointed: the dense layer and one MoE layer recomputed
    "e2_ckpt2": "ep=2,p=2,g=2,os=4,ep.p=2,ep.g=2,ep.os=2,mb=1,ckpt=2",
    # no expert tokens: the expert units on the dense triple at e = 1, no all-to-all
    "zero3": "zero3",
    # only the MoE MLPs recomputed (ckpt=moe): both MoE layers' all-to-alls again, the dense
    # layer and the attention parts not
    "e2_ckpt_moe": "ep=2,p=2,g=2,os=4,ep.p=2,ep.g=2,ep.os=2,mb=1,ckpt=moe",
}
TOPK_4 = {"e2_topk": "ep=2,p=4,g=4,os=4,ep.p=2,ep.g=2,ep.os=2,mb=1"}
IMBALANCE = 1.25
CAPACITY_4 = {"e2_topk_c125": "ep=2,p=4,g=4,os=4,ep.p=2,ep.g=2,ep.os=2,mb=1"}
"""A plan with --expert-imbalance 1.25: capacity factor 1.25, 10 slots per expert and sequence,
all-to-alls 1.25 times as large."""
PRESET_4 = {"preset_e4": "ep=4,p=4,g=4,os=4,ep.p=1,ep.g=1,ep.os=1,mb=1"}
BF16_4 = {"bf16_e2": "ep=2,p=2,g=4,os=4,ep.p=1,ep.g=2,ep.os=2,mb=1"}
"""bf16 parameters and activations: the all-to-alls carry 2-byte elements."""
RUNS_8 = {
    "e4": "ep=4,p=8,g=8,os=8,ep.p=2,ep.g=2,ep.os=2,mb=1",
    # the expert update gather's permuted copy (ep.p < ep.g < ep.os)
    "e2_span": "ep=2,ep.span,p=4,g=4,os=8,ep.p=1,ep.g=2,ep.os=4,mb=1",
    "e4_span": "ep=4,ep.span,p=8,g=8,os=8,ep.p=2,ep.g=2,ep.os=2,mb=1",
    # the expert gradient's staging copy (1 < ep.p < ep.g), EDP ranks 2 per node
    "e2_stage": "ep=2,p=8,g=8,os=8,ep.p=2,ep.g=4,ep.os=4,mb=1",
}


def _job(world: int, model: str = SPEC, imbalance: float = 1.0) -> Job:
    t = TrainingSpec(seq_len=S, global_batch_seqs=2 * world, precision="fp32",
                     expert_imbalance=imbalance)
    return Job.create(load_model(model), load_cluster("cpu-local"), t, world)


def _run(name, strategy, **kw):
    return {"name": name, "strategy": strategy, "steps": STEPS, "model": SPEC, **kw}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe4")
    ck = str(tmp / "ck")
    runs = [_run(n, s) for n, s in RUNS_4.items()]
    runs += [_run(n, s, gate="topk") for n, s in TOPK_4.items()]
    runs += [_run(n, s, gate="topk", expert_imbalance=IMBALANCE) for n, s in CAPACITY_4.items()]
    runs += [_run(n, s, steps=2, precision="bf16") for n, s in BF16_4.items()]
    runs += [_run(n, s, model="tiny-moe") for n, s in PRESET_4.items()]
    # saved at e = 2 after step 2, resumed at e = 4 for step 3
    runs += [_run("ck_e2", RUNS_4["e2"], steps=2, checkpoint_dir=ck, checkpoint_every=2),
             _run("ck_e4", RUNS_4["e4"], checkpoint_dir=ck, resume=True)]
    return run_worker(tmp, runs, nproc=4, timeout=240)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """On an emulated cluster of 2 nodes where this host allows it (root: network namespaces,
    amsp_planner/emulate.py), else on loopback. On the emulated cluster the EP group that spans
    the nodes also runs 1 step after a warm-up, so the wire bytes of 2 steps are its 3-step
    run's less that."""
    from amsp_planner import emulate

    tmp = tmp_path_factory.mktemp("moe8")
    emu = emulate.probe() is None
    runs = [_run(n, s) for n, s in RUNS_8.items()]
    if emu:
        span = RUNS_8["e2_span"]
        runs = [_run("warm", span, steps=1)] + [dict(r, link_bytes=True) for r in runs]
        runs.append(_run("e2_span_1", span, steps=1, link_bytes=True))
    return run_worker(tmp, runs, nproc=4, nnodes=2, timeout=300, emulate=emu)


_REF: dict = {}


def reference(world: int, gate: str = "balanced", model: str = SPEC, imbalance: float = 1.0):
    from amsp_planner.runtime.reference import reference_run

    key = (world, gate, model, imbalance)
    if key not in _REF:
        _REF[key] = reference_run(_job(world, model, imbalance), STEPS, gate=gate)
    return _REF[key]


def check_parity(rep: dict, world: int, gate: str = "balanced", first: int = 0,
                 model: str = SPEC, imbalance: float = 1.0) -> None:
    """Loss per step within 1e-5 and final parameters within the dense parity tests'
    tolerance of the single-process reference."""
    ref_loss, ref_params = reference(world, gate, model, imbalance)
    assert len(rep["loss"]) == STEPS - first
    for a, b in zip(rep["loss"], ref_loss[first:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (rep["strategy"], rep["loss"], ref_loss)
    for got, want in zip(rep["_pt"]["master"], ref_params, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


def _rows(rep: dict) -> dict:
    return {(e["phase"], e["op"], e["group"]): e["measured"] for e in rep["schedule"]
            if e["measured"] is not None}


def check_all_to_all(rep: dict, e: int, stride: int, per_node: int, recompute: int,
                     dtype_bytes: int = 4, capacity_factor: float = 1.0) -> None:
    """Per MoE layer and micro-batch, dispatch and combine of b S k h values each (fp32, or
    bf16), in forward and (reversed) in backward, and in the recomputed forward of the
    `recompute` checkpointed MoE layers; ring bytes in-node (k-1)/m, across nodes (g-1)/g of
    the full size."""
    n_micro = rep["n_micro"]
    per_call = round(1 * S * K * H * dtype_bytes * capacity_factor)
    rows = _rows(rep)
    layers = {"forward": M_LAYERS, "backward": M_LAYERS, "recompute": recompute}
    phases = [ph for ph, n in layers.items() if n]
    got = {ph for ph, op, g in rows if g == "EP"}
    assert got == set(phases), (rep["strategy"], got)
    nodes = e // per_node
    for ph in phases:
        m = rows[ph, "all_to_all", "EP"]
        calls = 2 * layers[ph] * n_micro
        assert (m["calls_per_step"], m["full_bytes_per_step"]) == (calls, calls * per_call), ph
        assert (m["group_size"], m["stride"], m["members_per_node"]) == (e, stride, per_node)
        full = calls * per_call
        assert math.isclose(m["intra_bytes_per_rank_per_step"], (per_node - 1) / e * full)
        assert math.isclose(m["inter_bytes_per_rank_per_step"], (nodes - 1) / nodes * full)


def check_expert_gathers(rep: dict, e: int, ep_p: int) -> None:
    """The expert units (E/e experts of each MoE layer) gathered over EP_P per micro-batch in
    forward and backward: E/e x 6144 fp32 elements each (already a multiple of N/e x 256)."""
    rows = _rows(rep)
    if ep_p == 1:
        assert not any(g == "EP_P" for _, _, g in rows)
        return
    calls = M_LAYERS * rep["n_micro"]
    for ph in ("forward", "backward"):
        m = rows[ph, "all_gather", "EP_P"]
        assert m["calls_per_step"] == calls
        assert m["full_bytes_per_step"] == calls * (E // e) * EXPERT * 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RUNS_4))
def test_parity_4(four, name):
    check_parity(four[name], 4)


@pytest.mark.multiprocess
def test_parity_preset(four):
    check_parity(four["preset_e4"], 4, model="tiny-moe")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(TOPK_4))
def test_parity_topk_4(four, name):
    check_parity(four[name], 4, gate="topk")
    assert four[name]["loss"] != four["e2"]["loss"]  # the router's choice did run


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,e,stride,ep_p,recompute", [
    ("e2", 2, 1, 2, 0), ("e4", 4, 1, 1, 0), ("e2_span_ckpt", 2, 2, 1, 2),
    ("e2_ckpt2", 2, 1, 2, 1), ("e2_topk", 2, 1, 2, 0), ("e2_ckpt_moe", 2, 1, 2, 2)])
def test_all_to_alls_and_expert_gathers_4(four, name, e, stride, ep_p, recompute):
    rep = four[name]
    check_all_to_all(rep, e, stride, e, recompute)
    check_expert_gathers(rep, e, ep_p)


@pytest.mark.multiprocess
def test_capacity_factor(four):
    """Capacity factor 1.25 (the plan's --expert-imbalance): parity with the reference routing
    alike, all-to-alls of 1.25 b S k h values, fewer tokens dropped than at 1.0."""
    rep = four["e2_topk_c125"]
    check_parity(rep, 4, gate="topk", imbalance=IMBALANCE)
    check_all_to_all(rep, 2, 1, 2, 0, capacity_factor=IMBALANCE)
    assert rep["loss"] != four["e2_topk"]["loss"]


@pytest.mark.multiprocess
def test_bf16_all_to_alls(four):
    rep = four["bf16_e2"]
    check_all_to_all(rep, 2, 1, 2, 0, dtype_bytes=2)
    assert all(math.isfinite(x) for x in rep["loss"])


@pytest.mark.multiprocess
def test_no_expert_tokens_is_e1(four):
    """Without expert tokens the expert units run on the dense triple at e = 1: gathered over
    all 4 ranks (all 8 experts each), no all-to-all."""
    rows = _rows(four["zero3"])
    assert not any(g == "EP" for _, _, g in rows)
    check_expert_gathers(four["zero3"], 1, 4)
    assert rows["forward", "all_gather", "EP_P"]["group_size"] == 4


@pytest.mark.multiprocess
def test_checkpoint_reshards_across_ep(four):
    """Saved at e = 2 after step 2, resumed at e = 4: step 3 and the final parameters as the
    uninterrupted reference's."""
    assert four["ck_e4"]["start_step"] == 2
    check_parity(four["ck_e4"], 4, first=2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RUNS_8))
def test_parity_8_two_nodes(eight, name):
    check_parity(eight[name], 8)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,e,stride,per_node", [
    ("e4", 4, 1, 4), ("e2_span", 2, 4, 1), ("e4_span", 4, 2, 2)])
def test_all_to_alls_8_two_nodes(eight, name, e, stride, per_node):
    check_all_to_all(eight[name], e, stride, per_node, 0)


@pytest.mark.multiprocess
def test_cross_node_bytes_on_the_wire(eight):
    """The emulated cluster's uplink carries, per step, the cross-node bytes the runtime counts
    (every entry's ring-convention inter-node bytes x 4 ranks per node; for this strategy the
    spanning EP group's all-to-alls are about half of them), plus TCP/IP overhead: within
    [1, 1.10) of it, as the dense runs' (tests/test_emulate.py)."""
    if "link_bytes" not in eight["e2_span"]:
        pytest.skip("no emulated cluster here (needs root for network namespaces)")
    rep = eight["e2_span"]
    wire = (rep["link_bytes"]["tx"] - eight["e2_span_1"]["link_bytes"]["tx"]) / (STEPS - 1)
    inter = {e["group"] + e["phase"] + e["op"]: 4 * e["measured"]["inter_bytes_per_rank_per_step"]
             for e in rep["schedule"] if e["measured"] is not None}
    logical = sum(inter.values())
    a2a = sum(v for k, v in inter.items() if k.startswith("EP") and k.endswith("all_to_all"))
    assert a2a > 0.4 * logical, (a2a, logical)
    assert logical <= wire < 1.10 * logical, (wire, logical)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,name", [(4, n) for n in {**RUNS_4, **TOPK_4, **BF16_4,
                                                           **PRESET_4, **CAPACITY_4}]
                         + [(8, n) for n in RUNS_8])
def test_measured_equals_plan(four, eight, world, name):
    """Every schedule entry, the all-to-alls and the expert class's included: calls and bytes
    per step equal to the plan's (cost/moe_schedule.py), group sizes, strides and in-node /
    cross-node bytes too; the runtime's own tensors equal the memory model's terms, the
    expert class's and the all-to-all buffers included (cost/memory.py)."""
    from .test_sharded_training import check_accounting, check_memory

    rep = (four if world == 4 else eight)[name]
    check_accounting(rep)
    check_memory(rep)
    assert rep["verdict"]["ok"], rep["verdict"]["line"]


# ----- without a launch ------------------------------------------------------------------------
def test_balanced_gate_fills_every_expert_exactly():
    from amsp_planner.runtime import moe

    probs = torch.rand(3, S, E).softmax(-1)
    idx = moe.route(probs, K, "balanced")
    _, kept = moe._slots(idx, E, moe.capacity(load_model(SPEC), S))
    assert kept.all()
    counts = torch.nn.functional.one_hot(idx.reshape(3, -1), E).sum(1)
    assert (counts == S * K // E).all()
    assert (idx[..., 0] != idx[..., 1]).all()


def test_topk_capacity_drops_overflow():
    """Every token prefers experts 0 and 1: each keeps only its first C = S k / E = 8."""
    from amsp_planner.runtime import moe

    logits = torch.zeros(1, S, E)
    logits[..., 0], logits[..., 1] = 2.0, 1.0
    idx = moe.route(logits.softmax(-1), K, "topk")
    slot, kept = moe._slots(idx, E, 8)
    assert kept.sum() == 16 and kept[0, :8].all() and not kept[0, 8:].any()
    assert len(set(slot[kept].tolist())) == 16


def test_param_counts_per_unit():
    from amsp_planner.runtime import model as M

    m = load_model(SPEC)
    specs = M.unit_param_specs(m)  # asserts the counts equal ModelSpec.unit_params()
    experts = [math.prod(dict(u).get("experts", (0,))) for u in specs]
    assert experts == m.unit_expert_params() == [0, 0, E * EXPERT, E * EXPERT, 0]


def test_train_refuses_uneven_routing_before_launch(tmp_path):
    """E = 8 does not divide S k = 30 x 2: one line, exit 2, no rank started."""
    from .mp import amsp, make_plan, one_error_line

    plan = make_plan(tmp_path, "p.json", 4, model=SPEC,
                     strategy="ep=2,p=4,g=4,os=4,ep.p=2,ep.g=2,ep.os=2,mb=1", seq=30)
    r = amsp("train", plan, "--steps", 1, cwd=tmp_path, timeout=60)
    one_error_line(r, "seq_len 30 x experts_per_token 2 is not a multiple of num_experts 8")


def test_capacity_refused_in_one_line():
    from amsp_planner.runtime import moe

    with pytest.raises(AmspUserError, match="seq_len 30 x experts_per_token 2 is not a multiple"):
        moe.capacity(load_model(SPEC), 30)
    with pytest.raises(AmspUserError, match="expert_imbalance 1.1 x 8 tokens per expert per "
                                            "sequence is not a whole number of slots"):
        moe.capacity(load_model(SPEC), S, 1.1)
    assert moe.capacity(load_model(SPEC), S, 1.25) == 10


def test_gate_option_reaches_the_ranks(tmp_path):
    """amsp train --gate: a choice of the two (else exit 2 before anything runs), handed to
    every rank's RunConfig."""
    from amsp_planner.runtime.worker import run_config

    from .mp import amsp

    assert run_config({"steps": 1, "gate": "topk"}).gate == "topk"
    assert run_config({"steps": 1}).gate == "balanced"
    r = amsp("train", tmp_path / "none.json", "--gate", "sinkhorn", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "'sinkhorn' is not one of 'balanced', 'topk'" in r.stderr


@pytest.mark.parametrize("gate", ["balanced", "topk"])
def test_checkpointing_keeps_the_moe_gradients(gate):
    """The first K, every block, op-level and MoE-MLP checkpointing of MoE blocks recompute exactly
    what forward computed (the routing included): the same gradients as without."""
    from amsp_planner.runtime import model as M
    from amsp_planner.runtime.moe import Routing

    spec = load_model(SPEC)
    ref = M.ReferenceModel(spec, 0, torch.float32, Routing(gate))
    tok = torch.randint(0, spec.vocab_size, (2, S + 1), generator=torch.Generator().manual_seed(0))
    units = [M.views(f, s) for f, s in zip(ref.flats, ref.specs, strict=True)]

    def grads(ckpt):
        ref.zero_grad()
        x = M.embed(tok[:, :-1], units[0])
        for p, mode in zip(units[1:-1], M.block_modes(ckpt, spec.num_layers), strict=True):
            x = M.run_block(x, p, spec, mode, routing=Routing(gate))
        M.head_loss(x, units[-1], units[0]["tok_emb"], tok[:, 1:]).backward()
        return [f.grad.clone() for f in ref.flats]

    plain = grads(False)
    assert plain[2].abs().sum() > 0
    for ckpt in (2, True, "op", "moe"):
        for a, b in zip(grads(ckpt), plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
