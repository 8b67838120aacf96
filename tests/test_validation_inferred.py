"""Rows whose source tuned micro batch and checkpointing without publishing them (the IBM /
PyTorch float8 + FSDP2 blog, Table 3) take the fastest setting that fits under this model
[inf]; if the model changes its mind, the rows' strategy is stale and this test says so."""

from __future__ import annotations

import pytest

from amsp_planner.cost.evaluate import evaluate
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import parse_strategy_or_baseline
from amsp_planner.validation import load_rows, row_job

ROWS = ["ibm-f8-h100-l3-70b-512-bf16", "ibm-f8-h100-l3-70b-512-fp8",
        "ibm-f8-h100-l31-405b-tp4-512-bf16", "ibm-f8-h100-l31-405b-tp4-512-fp8"]


def _tokens_per_s(row: dict, models: dict, mb: int, ckpt: str) -> float | None:
    base = ",".join(p for p in row["strategy"].split(",")
                    if not p.startswith(("mb=", "ckpt")))
    dp = row["gpus"] // parse_strategy_or_baseline(base + ",mb=1", row["gpus"], 8).tp
    trial = {**row, "strategy": f"{base},mb={mb}" + (f",{ckpt}" if ckpt else ""),
             "global_batch_seqs": dp * mb}
    try:
        job, s = row_job(trial, models)
    except AmspUserError:
        return None
    ev = evaluate(job, s)
    return ev.batch_tokens / ev.step_s if ev.fits else None


@pytest.mark.parametrize("rid", ROWS)
def test_the_row_is_the_fastest_fitting_setting(rid):
    doc = load_rows()
    row = next(r for r in doc["rows"] if r["id"] == rid)
    models = doc.get("models", {})
    options = {(mb, ck): _tokens_per_s(row, models, mb, ck)
               for mb in (1, 2, 3, 4, 6, 8) for ck in ("ckpt", "ckpt=op", "")}
    best = max((v, k) for k, v in options.items() if v is not None)[1]
    parts = row["strategy"].split(",")
    mb = int(next(p for p in parts if p.startswith("mb="))[3:])
    ck = next((p for p in parts if p.startswith("ckpt")), "")
    assert (mb, ck) == best
    tp = parse_strategy_or_baseline(row["strategy"], row["gpus"], 8).tp
    assert row["global_batch_seqs"] == row["gpus"] // tp * mb   # one micro-batch per step [inf]
