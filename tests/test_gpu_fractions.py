"""bench/fit_gpu_fractions.py: the Grand Teton H100's achievable_fraction in presets/gpus.yaml
is the script's output (fitted on its single-node bf16 rows), and the fit is reproducible."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from amsp_planner.specs.cluster import gpu_presets

ROOT = Path(__file__).resolve().parent.parent


def test_grand_teton_fraction_is_the_fit_scripts_output():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_gpu_fractions.py"),
                          "--arch", "hopper-500w"], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    first = out.splitlines()[0]
    gt = gpu_presets()["H100-SXM5-96GB-500W"]
    assert first == (f"hopper-500w: achievable_fraction {gt['achievable_fraction']:.2f}, "
                     f"attention_fraction {gt['attention_fraction']:.2f}")
    # the fit subset is the 500 W part's single-node bf16 rows; the rest (which grows as rows
    # are collected) is held out
    assert "fit subset (bf16, <= 8 GPUs): 11 rows" in out and "held out: " in out
