"""`amsp explain`'s sensitivity: the value of each assumption at which the choice flips, checked
by re-planning with `amsp plan --set` / `--memory-limit` just below and above it."""

from __future__ import annotations

import json

import pytest
from amsp_testlib import run_cli

# A job whose choice moves with the inter-node bandwidth: llama-7b on 4 DGX A100 nodes with a
# small batch (one sequence per GPU), so communication is a large part of the step. At HDR
# (200 Gbit/s per NIC) the rule takes ZeRO-3 (one process group, least memory, inside the band
# of the fastest); below about 9 GB/s per NIC full sharding with hpZ is faster beyond the band.
JOB = ["--model", "llama-7b", "--gpus", "32", "--seq-len", "2048", "--global-batch-seqs", "32"]


def replan(*extra: str) -> str:
    code, out, err = run_cli(["plan", *JOB, *extra, "--json", "-o", "-"])
    assert code == 0, err
    return json.loads(out)["decision"]["strategy"]


@pytest.fixture(scope="module")
def explained(tmp_path_factory):
    path = tmp_path_factory.mktemp("sens") / "plan.json"
    code, _, err = run_cli(["plan", *JOB, "-o", str(path)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(path), "--json", "--workers", "2"])
    assert code == 0, err
    assert err.startswith("sensitivity: 8 searches")  # progress goes to stderr
    assert len(err.splitlines()) == 1 + 8 and "inter-node bandwidth, below: changes" in err
    facts = json.loads(out)
    return path, facts, {a["name"]: a for a in facts["sensitivity"]["assumptions"]}


def test_bandwidth_flips_where_explain_says(explained):
    _, facts, sens = explained
    chosen = facts["strategy"].rsplit(",ga=", 1)[0]
    bw = sens["inter_node_bandwidth"]
    assert bw["value"] == pytest.approx(25.0)  # HDR: 200 Gbit/s = 25 GB/s per NIC
    sides = [side for side in ("below", "above") if bw[side]]
    assert sides, bw  # this job's choice moves with the bandwidth
    for side in sides:
        f = bw[side]
        gbyte = f["value"]
        # explain's bracket is 1% wide around the flip
        assert f["holds_at"] / f["changes_at"] == pytest.approx(1, abs=0.0101)
        lower = replan("--set", f"nic_gbit_per_s={0.97 * gbyte * 8}")
        upper = replan("--set", f"nic_gbit_per_s={1.03 * gbyte * 8}")
        assert lower != upper, (side, gbyte)
        kept, changed = (upper, lower) if side == "below" else (lower, upper)
        assert kept == chosen, (side, gbyte, kept)
        assert changed == f["becomes"], (side, gbyte, changed)
        assert (gbyte < 25) if side == "below" else (gbyte > 25)


def test_memory_limit_flip_is_checked_by_replanning(explained):
    _, facts, sens = explained
    chosen = facts["strategy"].rsplit(",ga=", 1)[0]
    mem = sens["memory_limit"]
    assert mem["value"] == pytest.approx(80.0)
    f = mem["below"]
    assert f is not None
    # the choice cannot survive a limit below its own memory
    from amsp_planner.plan import load_plan

    need = load_plan(explained[0]).evaluation.memory.total / 2**30
    assert f["holds_at"] >= need
    assert replan("--memory-limit", str(1.03 * f["value"])) == chosen
    # at the bracket's lower end the choice is what explain says it becomes (with partial
    # checkpointing K keeps growing as the limit falls, so only the sharding is compared; a
    # few % lower may already be past a second change)
    assert f["holds_at"] / f["changes_at"] == pytest.approx(1, abs=0.0101)
    lower = replan("--memory-limit", str(f["changes_at"]))
    assert lower != chosen and f["becomes"] != chosen
    assert lower.split(",ckpt=")[0] == f["becomes"].split(",ckpt=")[0]
    # more memory than it needs: nothing moves (up to 4x, 320 GiB)
    assert mem["above"] is None and mem["high"] == pytest.approx(320.0)


def test_capped_and_unchanged_assumptions_are_reported_as_such(explained):
    _, facts, sens = explained
    eff = sens["compute_efficiency"]  # A100 matmul fraction 0.72: can grow only to 1
    assert eff["value"] == pytest.approx(0.72)
    assert eff["high"] == pytest.approx(1.0) and eff["high_is_cap"]
    slow = sens["comm_compute_slowdown"]
    assert slow["value"] == pytest.approx(0.16) and slow["low"] == pytest.approx(0.04)
    lines = facts["lines"]
    start = next(i for i, line in enumerate(lines) if line.startswith("sensitivity"))
    body = lines[start + 1:start + 5]
    assert [line.split()[0] for line in body] == ["comm/compute", "inter-node", "compute",
                                                  "memory"]
    assert "(its maximum)" in body[2]
    assert f"below {sens['inter_node_bandwidth']['below']['value']:.3g} it becomes" in body[1]


def test_equivalent_candidates_are_inside_the_band(explained):
    path, facts, _ = explained
    from amsp_planner.cost.evaluate import evaluate
    from amsp_planner.plan import load_plan
    from amsp_planner.solver.space import validated_band
    from amsp_planner.strategy import Strategy

    eq = facts["equivalent"]
    p = load_plan(path)
    band = validated_band(p.job)  # the job's relative band, the plan's tie band
    assert eq["band"] == band == p.doc["inputs"]["search"]["preference"]["band"]
    names = [c["name"] for c in eq["candidates"]]
    assert "runner-up 1" in names and "ddp" not in names  # ddp does not fit in 80 GiB
    for c in eq["candidates"]:
        e = evaluate(p.job, Strategy.parse(c["strategy"]), p.memory_limit)
        assert e.fits and abs(e.step_s / p.evaluation.step_s - 1) <= band
        assert c["strategy"] != facts["strategy"].rsplit(",ga=", 1)[0]
    # and every fitting baseline inside the band is listed, by name or as a runner-up
    listed = {c["strategy"] for c in eq["candidates"]}
    for name, b in p.doc["baselines"].items():
        if b["fits"] and abs(b["step_s"] / p.evaluation.step_s - 1) <= band:
            s = Strategy.parse(b["strategy"])
            chosen = facts["strategy"].rsplit(",ga=", 1)[0]
            assert str(s.with_(grad_accum=None)) in listed | {chosen}, name


def test_sequential_search_matches_the_process_pool(explained):
    from amsp_planner.plan import load_plan
    from amsp_planner.report.explain import ASSUMPTIONS, search_side, solve_options

    path, facts, sens = explained
    p = load_plan(path)
    a = next(a for a in ASSUMPTIONS if a.key == "inter_node_bandwidth")
    chosen = facts["strategy"].rsplit(",ga=", 1)[0]
    side = next(s for s in ("below", "above") if sens["inter_node_bandwidth"][s])
    found, solves = search_side(p.job, p.memory_limit, a, side, chosen, solve_options(p.doc))
    held, flip, becomes = found
    assert becomes == sens["inter_node_bandwidth"][side]["becomes"]
    assert 25 * flip == pytest.approx(sens["inter_node_bandwidth"][side]["changes_at"])
    assert solves <= 2 + 7  # scan 2x, 4x; 7 halvings of a 2x bracket reach 1%


def test_no_sensitivity_and_given_strategy_plans(tmp_path):
    path = tmp_path / "given.json"
    code, _, err = run_cli(["plan", *JOB, "--strategy", "zero3", "-o", str(path)])
    assert code == 0, err
    code, out, err = run_cli(["explain", str(path), "--no-sensitivity", "--json"])
    assert code == 0 and err == ""
    facts = json.loads(out)
    assert "sensitivity" not in facts and "equivalent" not in facts
    code, out, err = run_cli(["explain", str(path)])
    assert code == 0
    assert "sensitivity: skipped: the plan evaluates the given strategy zero3" in out


def test_scan_stops_at_a_fields_bound_and_zero_assumptions_are_not_scaled():
    from amsp_testlib import make_job

    from amsp_planner.cost.job import Job
    from amsp_planner.report.explain import ASSUMPTIONS, _side_factors, scaled_job, sensitivity
    from amsp_planner.specs import load_cluster

    a = {a.key: a for a in ASSUMPTIONS}
    job = make_job(8)
    fast = Job.create(job.model, load_cluster("dgx-a100-hdr", {"nic_gbit_per_s": 40000}),
                      job.training, 8)
    # nic_gbit_per_s may be at most 100000: 2.5x, not 4x
    assert _side_factors(fast, a["inter_node_bandwidth"], "above") == [2.0, 2.5]
    assert _side_factors(job, a["inter_node_bandwidth"], "below") == [0.5, 0.25]
    # A100 matmul 0.72 and attention 0.45 scale together; 0.72 reaches 1 first
    j2, _ = scaled_job(job, 1.0, a["compute_efficiency"], 1 / 0.72)
    assert j2.cluster.gpu.achievable_fraction == pytest.approx(1.0)
    assert j2.cluster.gpu.attention_fraction == pytest.approx(0.45 / 0.72)
    # measured inter-node tables scale with the NIC speed, intra-node ones do not
    data = job.cluster.model_dump(mode="json")
    pts = [{"size_bytes": 1 << 20, "busbw_gbyte_per_s": 10.0}]
    data["measured"] = [{"op": "all_gather", "scope": "inter", "points": pts},
                        {"op": "all_gather", "scope": "intra", "points": pts}]
    from amsp_planner.specs.cluster import ClusterSpec

    measured = Job.create(job.model, ClusterSpec.model_validate(data), job.training, 8)
    j3, _ = scaled_job(measured, 1.0, a["inter_node_bandwidth"], 0.5)
    assert j3.cluster.nic_gbit_per_s == 100
    assert [t.points[0].busbw_gbyte_per_s for t in j3.cluster.measured] == [5.0, 10.0]
    # the CPU processes have no comm/compute slowdown: reported, not scanned
    cpu = make_job(4, cluster="cpu-local")
    from amsp_planner.solver import solve

    chosen = str(solve(cpu, runners_up=0).best.strategy.with_(grad_accum=None))
    s = sensitivity(cpu, cpu.cluster.memory_bytes, chosen, {}, workers=1)
    slow = next(x for x in s["assumptions"] if x["name"] == "comm_compute_slowdown")
    assert slow["value"] == 0 and "cannot change" in slow["note"]
    assert s["workers"] == 1 and s["solves"] > 0
