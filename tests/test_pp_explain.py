"""`amsp explain` of a --pp plan re-solves the search the plan ran (the pipeline enumeration at
its degree), not the data-parallel ILP: its runners-up and other tensor-parallel degrees keep the
plan's pipeline degree, and the sensitivity scans are skipped with the reason."""

import json
import subprocess
import sys

from amsp_planner.strategy import Strategy


def amsp(*args):
    return subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", *args],
                          capture_output=True, text=True, timeout=300)


def test_explain_of_a_pipeline_plan_keeps_its_degree(tmp_path):
    out = tmp_path / "pp.json"
    r = amsp("plan", "--model", "tiny", "--gpus", "8", "--cluster", "cpu-local", "--seq-len",
             "128", "--global-batch-seqs", "32", "--pp", "2", "-o", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert Strategy.parse(plan["decision"]["strategy"]).pp == 2
    r = amsp("explain", "--json", str(out))
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    runners = [c for c in facts["equivalent"]["candidates"] if c["name"].startswith("runner-up")]
    assert runners, facts["equivalent"]
    assert all(Strategy.parse(c["strategy"]).pp == 2 for c in runners)
    others = [o for o in facts["tensor_parallel"]["others"] if o["strategy"]]
    assert others and all(Strategy.parse(o["strategy"]).pp == 2 for o in others)
    assert "--pp 2" in facts["sensitivity"]["skipped"]
