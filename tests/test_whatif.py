"""amsp whatif: sweep points equal `amsp plan`, monotone in bandwidth and memory, plots, errors."""

from __future__ import annotations

import csv
import json
import math

import pytest
from amsp_testlib import assert_user_error, run_cli

from amsp_planner import whatif as w
from amsp_planner.specs import load_cluster

GIB = 1024**3
RTOL = 1e-6
"""The ILP's optimum is exact to this (tests/test_solver.py compares it with brute force)."""


def sweep(**kw) -> w.Sweep:
    kw.setdefault("models", ("llama-7b",))
    kw.setdefault("gpus", (64,))
    kw.setdefault("global_batches", ("4M",))
    return w.Sweep(**kw)


def plan_json(argv: list[str], tmp_path) -> dict:
    code, out, err = run_cli(["plan", *argv, "--json", "-o", str(tmp_path / "plan.json")])
    assert code == 0, err
    return json.loads(out)


def assert_row_equals_plan(row: w.Row, doc: dict) -> None:
    pred = doc["predictions"]
    assert row.status == "ok", row.reason
    assert row.strategy == pred["strategy"]
    assert row.step_s == pred["time"]["step_s"]
    assert row.compute_s == pred["time"]["compute_s"]
    assert row.exposed_comm_s == pred["time"]["exposed_comm_s"]
    assert row.tokens_per_s == pred["tokens_per_s"]
    assert row.mfu == pred["mfu"]
    assert row.memory_gib * GIB == pytest.approx(pred["memory"]["total"], rel=1e-12)
    fitting = {n: b for n, b in doc["baselines"].items() if b["fits"]}
    best = min(fitting, key=lambda n: (fitting[n]["step_s"], fitting[n]["memory_bytes"]))
    assert row.baseline == best
    assert row.baseline_tokens_per_s == fitting[best]["tokens_per_s"]
    assert row.baseline_mfu == fitting[best]["mfu"]


# ----- a point is `amsp plan` -----------------------------------------------------------------
def test_sweep_points_equal_amsp_plan(tmp_path):
    s = sweep(models=("llama-13b",), gpus=(64, 256), clusters=("a800-hdr",),
              sets=(("node_gbit_per_s", (200, 1600)), ("gpu.memory_gib", (40,))),
              global_batches=("8M",), memory_limits_gib=(36.0,))
    rows = w.run(s, workers=2)  # through the process pool
    assert [r.point.index for r in rows] == list(range(4))
    # a800-hdr has 4 NICs per node: 1600 Gb/s per node is 400 Gb/s per NIC
    for r in rows:
        nic = r.point.get("set:node_gbit_per_s") / 4
        doc = plan_json(["--model", "llama-13b", "--gpus", str(r.point.get("gpus")),
                         "--cluster", "a800-hdr", "--set", f"nic_gbit_per_s={nic}",
                         "--set", "gpu.memory_gib=40", "--global-batch", "8M",
                         "--memory-limit", "36"], tmp_path)
        assert doc["inputs"]["cluster"]["nic_gbit_per_s"] == nic
        if r.reason.startswith("kept no slower"):
            # the monotone sweep (amsp_planner/monotone.py): faster than amsp plan's choice,
            # which is inside the band of the fastest
            assert r.tokens_per_s > doc["predictions"]["tokens_per_s"]
            assert r.point.get("set:node_gbit_per_s") == 1600
            continue
        assert_row_equals_plan(r, doc)


def test_cli_json_rows_equal_amsp_plan(tmp_path):
    code, out, err = run_cli(["whatif", "--model", "llama-7b", "--gpus", "32,128",
                              "--gpu-type", "h100", "--seq-len", "2048",
                              "--global-batch-seqs", "1024", "--json", "-"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["format"] == "amsp-whatif" and doc["varying"] == ["gpus"]
    assert [r["gpus"] for r in doc["rows"]] == [32, 128]
    # the H100 preset's GPU, field by field, on the default cluster
    h100 = load_cluster("dgx-h100-ndr").gpu.model_dump()
    sets = [a for k, v in h100.items() for a in ("--set", f"gpu.{k}={v}")]
    for r in doc["rows"]:
        p = plan_json(["--model", "llama-7b", "--gpus", str(r["gpus"]), *sets,
                       "--seq-len", "2048", "--global-batch-seqs", "1024"], tmp_path)
        assert r["strategy"] == p["predictions"]["strategy"]
        assert r["tokens_per_s"] == p["predictions"]["tokens_per_s"]
        assert r["mfu"] == p["predictions"]["mfu"]


# ----- monotonicity -----------------------------------------------------------------------------
def _along(rows, axis):
    """{other axes: [(value of axis, row), ...]} sorted by the axis value."""
    out = {}
    for r in rows:
        key = tuple((k, v) for k, v in r.point.values if k != axis)
        out.setdefault(key, []).append((r.point.get(axis), r))
    return {k: sorted(v, key=lambda t: t[0]) for k, v in out.items()}


FASTEST = w.SolveOptions(tie_band=0.0, headroom=0.0, quantization="on")
"""The fastest candidate at every point: the optimum, whose monotonicity these tests check (the
planner's default rule trades speed inside the band for other goods, docs/planner.md)."""


def test_more_inter_node_bandwidth_never_lowers_tokens_per_s():
    s = sweep(models=("llama-7b", "llama-30b"), gpus=(32, 256, 2048), global_batches=("8M",),
              options=FASTEST,
              sets=(("node_gbit_per_s", (50, 100, 200, 400, 800, 3200)),))
    rows = w.run(s, workers=2)
    assert all(r.ok for r in rows), [r.reason for r in rows if not r.ok]
    lines = _along(rows, "set:node_gbit_per_s")
    assert len(lines) == 6
    for line in lines.values():
        tps = [r.tokens_per_s for _, r in line]
        for a, b in zip(tps, tps[1:], strict=False):
            assert b >= a * (1 - RTOL), tps
        # and the network matters somewhere: the sweep is not flat
    assert any(line[-1][1].tokens_per_s > line[0][1].tokens_per_s * 1.001
               for line in lines.values())


def test_more_oversubscription_never_raises_tokens_per_s():
    s = sweep(models=("llama-13b",), gpus=(512,), options=FASTEST,
              sets=(("oversubscription", (1, 2, 4, 8)), ("nodes_per_leaf", (4,))))
    rows = w.run(s, workers=1)
    tps = [r.tokens_per_s for r in rows]
    assert all(b <= a * (1 + RTOL) for a, b in zip(tps, tps[1:], strict=False)), tps


def test_more_memory_never_makes_a_point_infeasible():
    limits = (8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 80.0)
    s = sweep(models=("llama-13b", "llama-30b"), gpus=(16, 64), memory_limits_gib=limits)
    rows = w.run(s, workers=2)
    lines = _along(rows, "memory_limit_gib")
    seen_infeasible = False
    for line in lines.values():
        status = [r.status for _, r in line]
        assert set(status) <= {"ok", "infeasible"}
        seen_infeasible |= "infeasible" in status
        first_ok = status.index("ok") if "ok" in status else len(status)
        assert all(st == "ok" for st in status[first_ok:]), status
        ok = [r for _, r in line if r.ok]
        for a, b in zip(ok, ok[1:], strict=False):
            assert b.tokens_per_s >= a.tokens_per_s * (1 - RTOL)
        for lim, r in line:
            if r.ok:
                assert r.memory_gib <= lim * (1 + 1e-9)
    assert seen_infeasible  # the sweep crosses the feasibility boundary


# ----- the planner's own rule, monotone too (amsp_planner/monotone.py) ----------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

AXES = {"nic_gbit_per_s": (25, 50, 100, 200, 400, 800), "intra_gbyte_per_s": (50, 150, 300, 600),
        "memory_limit_gib": (16.0, 24.0, 40.0, 80.0)}


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({
    "model": st.sampled_from(["llama-7b", "llama-13b", "llama3-8b", "tiny"]),
    "cluster": st.sampled_from(["dgx-a100-hdr", "dgx-h100-ndr", "eth-100g", "v100-ib"]),
    "gpus": st.sampled_from([8, 16, 32, 64, 128]),
    "seq_len": st.sampled_from([1024, 2048, 4096]),
    "axis": st.sampled_from(sorted(AXES)),
    "picks": st.lists(st.integers(0, 5), min_size=3, max_size=4, unique=True),
    "band": st.sampled_from([None, 0.05, 0.13, 0.25]),
}))
def test_the_default_rule_never_gets_slower_with_more_bandwidth_or_memory(p):
    """The planner's rule (ties broken for other goods inside the band), not only the fastest
    candidate: along NIC bandwidth, NVLink bandwidth and memory, tokens/s never drop and a
    point that fits keeps fitting."""
    values = tuple(sorted(AXES[p["axis"]][i % len(AXES[p["axis"]])] for i in set(p["picks"])))
    opts = w.SolveOptions(tie_band=p["band"])
    kw = dict(models=(p["model"],), clusters=(p["cluster"],), gpus=(p["gpus"],),
              seq_lens=(p["seq_len"],), global_batches=(p["gpus"] * 4,), options=opts)
    if p["axis"] == "memory_limit_gib":
        s = w.Sweep(memory_limits_gib=values, **kw)
    else:
        s = w.Sweep(sets=((p["axis"], values),), **kw)
    rows = w.run(s, workers=1)
    axis = "memory_limit_gib" if p["axis"] == "memory_limit_gib" else f"set:{p['axis']}"
    for line in _along(rows, axis).values():
        status = [r.status for _, r in line]
        assert "invalid" not in status, [r.reason for _, r in line]
        if "ok" in status:
            assert all(st == "ok" for st in status[status.index("ok"):]), status
        tps = [r.tokens_per_s for _, r in line if r.ok]
        assert all(b >= a * (1 - RTOL) for a, b in zip(tps, tps[1:], strict=False)), (
            tps, [r.strategy for _, r in line])


def test_whatif_llama_7b_on_64_gpus_over_nic_bandwidth_is_non_decreasing():
    """The sweep of the issue: 274,551 tokens/s at 100 Gb/s, 260,682 at 200 and 264,963 at
    400 under the absolute band before the relative band and monotone sweeps."""
    for band in ([], ["--tie-band", "0.13"]):
        code, out, err = run_cli(["whatif", "--model", "llama-7b", "--gpus", "64", "--set",
                                  "nic_gbit_per_s=100,200,400", "--json", "-", *band])
        assert code == 0, err
        rows = json.loads(out)["rows"]
        tps = [r["tokens_per_s"] for r in rows]
        assert len(tps) == 3 and tps[0] <= tps[1] <= tps[2], tps


# ----- rows that are not plans ------------------------------------------------------------------
def test_bad_points_are_rows_not_crashes():
    # 1,024 sequences: 4,096 GPUs run them with tensor parallelism (tp=4: 1,024 data-parallel
    # ranks), 32,768 cannot (at most tp=8 in a node: 4,096 ranks)
    s = sweep(models=("llama-65b",), gpus=(8, 64, 4096, 32768), global_batches=("4M",))
    rows = w.run(s, workers=1)
    by_gpus = {r.point.get("gpus"): r for r in rows}
    assert by_gpus[8].status == "infeasible"
    assert "least memory any strategy needs" in by_gpus[8].reason
    assert by_gpus[32768].status == "invalid"
    assert "not a multiple of 32768 GPUs" in by_gpus[32768].reason
    assert by_gpus[64].status == "ok"
    assert by_gpus[4096].status == "ok" and by_gpus[4096].strategy.startswith("tp=")
    code, out, err = run_cli(["whatif", "-m", "llama-65b", "-n", "8,32768", "--global-batch", "4M"])
    assert code == 0, err
    assert "infeasible [1]" in out and "invalid [2]" in out
    assert "[1] nothing fits" in out and "[2] global batch" in out


def test_cost_and_cluster_side_by_side(tmp_path):
    path = tmp_path / "cmp.csv"
    code, out, err = run_cli(["whatif", "-m", "llama-7b", "-n", "64,512",
                              "--compare-clusters", "dgx-a100-hdr,aws-p4d",
                              "--gpu-hour-price", "2.0,1.5", "--csv", str(path)])
    assert code == 0, err
    assert "clusters side by side" in out and "vs dgx-a100-hdr" in out
    rows = list(csv.DictReader(path.open()))
    assert [(r["cluster"], r["gpus"]) for r in rows] == [
        ("dgx-a100-hdr", "64"), ("dgx-a100-hdr", "512"), ("aws-p4d", "64"), ("aws-p4d", "512")]
    for r in rows:
        price = 2.0 if r["cluster"] == "dgx-a100-hdr" else 1.5
        want = price * int(r["gpus"]) / 3600 / float(r["tokens_per_s"]) * 1e9
        assert math.isclose(float(r["usd_per_btok"]), want, rel_tol=1e-12)
        assert f"${want:,.2f}" in out


# ----- the plot ---------------------------------------------------------------------------------
def test_plot_is_a_real_png(tmp_path):
    from PIL import Image

    path = tmp_path / "scaling.png"
    code, out, err = run_cli(["whatif", "-m", "llama-7b,llama-13b", "-n", "64,256,1024",
                              "--global-batch", "8M", "--set", "node_gbit_per_s=100,800",
                              "--plot", str(path)])
    assert code == 0, err
    assert f"wrote {path}" in out
    img = Image.open(path)
    assert img.format == "PNG" and img.size == (1200, 900)
    px = img.convert("RGB")
    colors = px.getcolors(maxcolors=1 << 20)
    non_white = sum(n for n, c in colors if c != (255, 255, 255))
    assert non_white > 0.03 * img.size[0] * img.size[1]       # not blank
    assert len(colors) > 50                                   # lines, text, markers
    # line colours of four series (C0..C3) are drawn
    tab = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    present = {c for n, c in colors if n > 50}
    assert all(c in present for c in tab), tab


# ----- bad input: one line, exit code 2 ---------------------------------------------------------
@pytest.mark.parametrize("argv, needles", [
    (["--set", "nic_gbit=100"], ["--set nic_gbit", "no such cluster field", "node_gbit_per_s"]),
    (["--set", "nic_gbit_per_s=100,-5"],
     ["--set nic_gbit_per_s=-5", "greater than or equal to 0.000001"]),
    (["--set", "gpu.memory=40"], ["--set gpu.memory", "no such GPU field"]),
    (["--set", "node_gbit_per_s=fast"], ["node_gbit_per_s=fast", "positive number"]),
    (["--set", "gpus_per_node=8,8"], ["given twice"]),
    (["--set", "oversubscription"], ["KEY=VALUE"]),
    (["--gpus", "64,x"], ["--gpus 'x'", "positive integers"]),
    (["--gpu-type", "b200"], ["--gpu-type 'b200'", "H100"]),
    (["--x-axis", "seq_len"], ["--x-axis seq_len", "not a swept axis"]),
    (["--plot", "/nonexistent/dir/x.png"], ["--plot", "does not exist"]),
])
def test_bad_input_is_one_line_exit_2(argv, needles):
    base = ["whatif", "--model", "llama-7b", "--gpus", "64"]
    if "--gpus" in argv:
        base = base[:3]
    code, out, err = run_cli(base + argv)
    assert_user_error(code, out, err, *needles)


def test_whatif_imports_neither_torch_nor_matplotlib_without_plot():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])  # this checkout's package, not another install
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import sys; from amsp_planner.cli.main import main\n"
            "try: main(['whatif', '-m', 'tiny', '-n', '8', '--seq-len', '256', '--json', '-'])\n"
            "except SystemExit as e: assert not e.code, e.code\n"
            "bad = [m for m in ('torch', 'matplotlib') if m in sys.modules]\n"
            "sys.stderr.write(f'heavy: {bad}')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env, cwd=root)
    assert p.returncode == 0, p.stderr
    assert '"format": "amsp-whatif"' in p.stdout
    assert p.stderr.strip().endswith("heavy: []"), p.stderr


def test_rows_do_not_depend_on_the_number_of_workers():
    s = sweep(models=("llama-7b", "tiny"), gpus=(8, 64, 512), seq_lens=(1024, 2048),
              global_batches=(1024,))
    serial = [r.to_dict() for r in w.run(s, workers=1)]
    parallel = [r.to_dict() for r in w.run(s, workers=2)]
    assert serial == parallel
    assert [r["index"] for r in serial] == list(range(len(s)))
    assert len({r["strategy"] for r in serial}) > 1


def test_plot_draws_no_plan_points_off_the_mfu_scale_and_one_line_without_legend():
    from amsp_planner import whatif as w
    from amsp_planner.report.plots import sweep_figure

    # 16384 GPUs cannot split a 1024-sequence batch, even with tp=8: that point has no plan
    sweep = w.Sweep(models=("llama-7b",), gpus=(64, 1024, 16384))
    rows = w.run(sweep, 1)
    assert [r.ok for r in rows] == [True, True, False]
    fig = sweep_figure(rows, "gpus", [], "llama-7b")
    ax_mfu = fig.axes[0]
    assert ax_mfu.get_legend() is None  # a single line: the title names it
    for line in ax_mfu.get_lines():
        xs, ys = line.get_xdata(), line.get_ydata()
        for x, y in zip(xs, ys, strict=True):
            if x == 16384 and y == y:  # not NaN: only at the top edge, never at MFU 0
                assert line.get_transform() != ax_mfu.transData and y == 1.0
    from amsp_planner.report.plots import relative_sharding

    ok = [relative_sharding(r) for r in rows if r.ok]  # p=N,g=N,os=N at 64 and at 1024
    changes = 1 + sum(a != b for a, b in zip(ok, ok[1:], strict=False))
    assert len([t for t in ax_mfu.texts if len(t.get_text()) <= 2]) == changes
