"""The FSDP2 module applies the plan's activation checkpointing, also to blocks passed as
``apply(model, mesh, blocks=[...])``: checkpoint wrappers on exactly the blocks the plan
checkpoints (every block, the first K, op-level selective), each recomputed in backward (its
forward runs twice), and a loud ValueError where the module cannot apply it.

Runs the generated module with torch on a tiny 4-block model in a one-rank gloo group (one
child process for every case, as tests/test_exports.py does).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from amsp_testlib import make_job

from amsp_planner.exports import fsdp2
from amsp_planner.specs import load_model
from amsp_planner.strategy import parse_strategy_or_baseline

N, R, LAYERS = 64, 8, 4
CASES = {  # plan -> which of the 4 blocks it checkpoints (the planner's "first K" convention)
    "zero3": [False] * 4,
    "zero3,ckpt": [True] * 4,
    "zero3,ckpt=1": [True, False, False, False],
    "p=16,g=16,os=16,ckpt=3": [True, True, True, False],
    "zero3,ckpt=op": [True] * 4,
    "tp=2,p=32,g=32,os=32,mb=1,ckpt=2": [True, True, False, False],
}

_CHILD = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from amsp_planner.exports import fsdp2
    from amsp_planner.exports.fsdp2_check import _Tiny
    texts = json.load(sys.stdin)
    out = {"cases": [fsdp2.check_with_torch(t, layers=4, given_blocks=True)
                     for t in texts["cases"]]}
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    def refusal(text, blocks, strict):
        model = _Tiny(4)
        try:  # strict=True also checks the mesh: the plan's check runs first
            fsdp2.load_module(text).checkpoint_blocks(model, blocks(model), strict=strict)
            return "applied"
        except ValueError as e:
            return str(e) + (" (model unchanged)" if type(model.layers[0]) is torch.nn.Linear
                             else "")
    out["foreign"] = refusal(texts["every"], lambda m: [m.layers[0], torch.nn.Linear(16, 16)],
                             False)
    out["too_few"] = refusal(texts["first12"], lambda m: list(m.layers), True)
    out["too_few_loose"] = refusal(texts["first12"], lambda m: list(m.layers), False)
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
""")


def test_fsdp2_checkpoints_exactly_the_plans_blocks_when_given():
    pytest.importorskip("torch")
    job = make_job(N, model=load_model("llama-7b"), seq_len=4096, batch_seqs=1024)

    def export(text: str) -> str:
        r = fsdp2.export(job, parse_strategy_or_baseline(text, N, R))
        assert r.exact, text
        return r.text

    texts = {"cases": [export(t) for t in CASES], "every": export("zero3,ckpt"),
             "first12": export("zero3,ckpt=12")}
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(texts), text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (text, want), res in zip(CASES.items(), got["cases"], strict=True):
        assert res["checkpointed"] == want, text
        # a checkpointed block's forward runs again in backward, the others' once
        assert res["forward_calls"] == [2 if c else 1 for c in want], text
        assert res["selective"] == [c and text.endswith("ckpt=op") for c in want], text
        assert res["all_dtensor"] and res["grads"], text
    assert "blocks[1] (Linear) is not a submodule of the model" in got["foreign"]
    assert got["foreign"].endswith("(model unchanged)")
    assert "checkpoints the first 12 blocks" in got["too_few"] and "has 4" in got["too_few"]
    assert got["too_few_loose"] == "applied"
