"""--tp and --ep: a bad degree is one line naming the option, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, option", [
    (["--model", "llama-7b", "--tp", "x"], "--tp x"),
    (["--model", "llama-7b", "--tp", "0"], "--tp 0"),
    (["--model", "qwen3-30b-a3b", "--ep", "-4"], "--ep -4"),
    (["--model", "qwen3-30b-a3b", "--ep", "eight"], "--ep eight"),
])
def test_bad_degree_is_one_line_naming_the_option(tmp_path, args, option):
    r = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", "plan", "--gpus", "8",
                        *args, "-o", str(tmp_path / "p.json")], capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}: use auto or")
    assert not (tmp_path / "p.json").exists()
