"""The emulated multi-node cluster: network namespaces joined by rate-limited veths.

    python -m pytest tests/test_emulate.py -q      # needs root (ip netns add); skips otherwise
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from amsp_planner import emulate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


@pytest.fixture(scope="module")
def can_emulate():
    reason = emulate.probe()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")


def _ours() -> list[str]:
    return [n for n in emulate._netns_names() if n.startswith(f"amsp-{os.getpid()}-")]


def test_comes_up_and_goes_down_cleanly(can_emulate):
    with emulate.emulated_cluster(nodes=2, rate_mbit=200) as emu:
        assert sorted(_ours()) == emu.namespaces and len(emu.namespaces) == 2
        assert emu.master_addr.startswith("10.213.")
        # The two nodes reach each other over the link, and only through it.
        r = subprocess.run(["ip", "-n", emu.namespaces[1], "route", "get", emu.addrs[0]],
                           capture_output=True, text=True, check=True)
        assert f"dev {emulate.LINK}" in r.stdout
        r = subprocess.run(["ip", "netns", "exec", emu.namespaces[0], "tc", "qdisc", "show",
                            "dev", emulate.LINK], capture_output=True, text=True, check=True)
        assert "tbf" in r.stdout and "200Mbit" in r.stdout
        c = emu.link_counters()
        assert len(c) == 2 and all(v >= 0 for d in c for v in d.values())
    assert _ours() == []


def test_teardown_on_exception_and_bridge_for_three_nodes(can_emulate):
    with pytest.raises(RuntimeError, match="boom"), \
            emulate.emulated_cluster(nodes=3, rate_mbit=100) as emu:
        assert emu.bridge is not None and len(_ours()) == 4
        probe = f"import socket; socket.create_connection(('{emu.addrs[0]}', 9), 2)"
        r = subprocess.run(["ip", "netns", "exec", emu.namespaces[2], "python3", "-c", probe],
                           capture_output=True, text=True)
        # Port 9 is closed: refused (reachable over the bridge), not a timeout.
        assert "Connection refused" in r.stderr
        raise RuntimeError("boom")
    assert _ours() == []


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch (the runtime extra) is not installed")
def test_all_reduce_across_nodes_matches_the_link_counters(can_emulate, tmp_path):
    size, calls = 4 * 2**20, 3
    env = {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    with emulate.emulated_cluster(nodes=2, rate_mbit=800) as emu:
        before = emu.link_counters()
        res = emu.run_torchrun(1, [str(HERE / "_emu_allreduce.py"), str(tmp_path), str(size),
                                   str(calls)], env=env, timeout=90)
        after = emu.link_counters()
    assert _ours() == []
    for rc, _, err in res:
        assert rc == 0, err[-3000:]
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Ring all-reduce over 2 ranks: each sends 2 (m-1)/m * size = size per call (logical).
    expected = calls * size
    for rec, b, a in zip(recs, before, after, strict=True):
        assert rec["sum"] == 2.0 ** (calls + 1)
        # The wire carries the payload plus TCP/IP headers and ACKs: a few percent more.
        assert expected <= rec["tx"] <= 1.10 * expected, rec
        assert expected <= rec["rx"] <= 1.10 * expected, rec
        # Seen from outside, over the whole job (rendezvous and warm-up included): more.
        assert a["tx"] - b["tx"] >= rec["tx"] and a["rx"] - b["rx"] >= rec["rx"]


def test_sigterm_tears_down(can_emulate):
    import signal
    import sys
    import time

    code = ("import sys, time\n"
            "from amsp_planner.emulate import emulated_cluster\n"
            "with emulated_cluster(nodes=2, rate_mbit=100) as emu:\n"
            "    print(' '.join(emu.namespaces), flush=True)\n"
            "    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    names = p.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(emulate._netns_names())
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert not set(names) & set(emulate._netns_names())


@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch (the runtime extra) is not installed")
def test_fidelity_benchmark_runs_end_to_end(can_emulate, tmp_path):
    # bench/fidelity.py, shortened: calibrate, plan, train two members of the set plus the
    # planner's choice, compare. The numbers of a run this short are noise; what must hold is
    # the pipeline, and the measured bytes: a stride-R replica all-reduce (AMSP os=R) puts its
    # logical cross-node bytes on the link, plus TCP/IP overhead.
    import sys

    out = tmp_path / "fidelity.json"
    p = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fidelity.py"), "--steps", "2", "--rounds", "1",
         "--only", "zero1", "--only", "amsp os=R", "--seconds-per-point", "0.02",
         "--passes", "1", "--max-size", "64K", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert _ours() == []
    d = json.loads(out.read_text())
    rows = {r["name"]: r for r in d["rows"]}
    assert list(rows) == ["zero1", "amsp os=R", "planner"]
    for r in rows.values():
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert f"| {r['name']} |" in p.stdout
    amsp = rows["amsp os=R"]
    assert 1.0 <= amsp["wire_tx_bytes_per_node_step"] / amsp["logical_inter_bytes_per_node_step"] < 1.10
    assert "measured" in d["calibrated_spec"] and -1 <= d["summary"]["spearman"] <= 1


def test_fidelity_summary_pools_one_strategy_measured_twice():
    # The planner's choice is the set's "amsp os=R" (same sharding and micro-batch; the plan
    # writes its accumulation): one strategy, so its two rows' samples are pooled, and the
    # choice is compared with the other strategies, not with its own second measurement.
    import importlib.util

    spec = importlib.util.spec_from_file_location("fidelity", REPO / "bench" / "fidelity.py")
    fid = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fid)

    def row(name, same, samples, pred):
        import statistics
        m = statistics.median(samples)
        return {"name": name, "same_as": same, "samples_s": samples, "measured_s": m,
                "predicted_s": pred, "error": (pred - m) / m}

    rows = [row("zero1", "p=1,g=1,os=8,mb=1", [0.70, 0.71, 0.72], 0.72),
            row("amsp os=R", "p=1,g=1,os=4,mb=1", [0.47, 0.48, 0.49], 0.53),
            row("planner", "p=1,g=1,os=4,mb=1", [0.50, 0.51, 0.52], 0.53)]
    s = fid._summary(rows)
    assert s["planner_vs_fastest"] == 0.0  # its own group is the fastest
    assert s["fastest_measured"] == "amsp os=R = planner"
    assert s["planner_same_as"] == ["amsp os=R"]
    assert s["planner_measured_s"] == 0.495  # median of the six pooled samples
    # a different, faster strategy still counts against the choice
    rows.append(row("hsdp", "p=4,g=4,os=4,mb=1", [0.45, 0.45, 0.45], 0.6))
    s = fid._summary(rows)
    assert abs(s["planner_vs_fastest"] - (0.495 / 0.45 - 1)) < 1e-12
