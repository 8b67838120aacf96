"""Regenerate the figures in docs/exports.md and docs/whatif.md from this checkout's amsp.

    python docs/gen.py            # rewrites the generated blocks and docs/img/whatif-*.png

Each generated block sits between `<!-- gen:NAME -->` and `<!-- /gen:NAME -->`; everything
outside the markers is left as written. Run it after any change to the cost model or the exports.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
EXPORT_CMDS = [
    "amsp plan --model llama-7b --gpus 64 --strategy mics-16,mb=2 -o plan.json",
    "amsp export plan.json --to deepspeed -o ds_config.json",
    "amsp export plan.json --to fsdp2 -o amsp_fsdp2.py",
    "amsp export plan.json --to torchtitan -o amsp_torchtitan.args",
    "amsp plan --model llama-7b --gpus 64 --engine deepspeed -o ds_plan.json",
    "amsp export ds_plan.json --to deepspeed -o ds_config.json",
    "amsp export ds_plan.json --to torchtitan -o amsp_torchtitan.args",
]
WHATIF = ("amsp whatif --model llama-13b,llama2-70b --gpus 64,128,256,512,1024,2048,4096 "
          "--global-batch 16M --set node_gbit_per_s=100,200,400,800 "
          "--plot img/whatif-llama-scaling.png --csv scaling.csv")
TITLES = {"llama-13b": "LLaMA-13B", "llama2-70b": "LLaMA-70B (`llama2-70b`)"}


def amsp(cmd: str, cwd: Path) -> str:
    """Run one `amsp ...` command line in-process in `cwd`; its stdout and stderr."""
    from amsp_planner.cli.main import main

    out = io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                main(shlex.split(cmd)[1:])
            except SystemExit as e:
                if e.code not in (0, None):
                    raise RuntimeError(f"{cmd}: exit {e.code}: {out.getvalue()}") from None
    finally:
        os.chdir(here)
    return out.getvalue()


def exports_block() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        parts = []
        for cmd in EXPORT_CMDS:
            text = amsp(cmd, Path(tmp))
            if cmd.startswith("amsp plan"):
                text = ""  # the plan's own report is docs/planner.md's
            parts.append(f"$ {cmd}\n{text}")
        return "```\n" + "".join(parts) + "```\n"


def _cell(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    base = (f"; {r['baseline']} {r['gain_vs_baseline'] * 100:+.1f}%" if r["baseline"]
            else "; no baseline fits")
    return (f"`{r['strategy']}` {r['mfu'] * 100:.1f}%, {r['tokens_per_s'] / 1e6:.3f}M tok/s, "
            f"{r['memory_gib']:.0f} GiB{base}")


def whatif_block() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = WHATIF.replace("--csv scaling.csv", f"--json {tmp}/sweep.json")
        amsp(cmd, DOCS)
        rows = json.loads(Path(tmp, "sweep.json").read_text())["rows"]
    nets = sorted({r["node_gbit_per_s"] for r in rows})
    out = [f"{len(rows)} points.", ""]
    for model, title in TITLES.items():
        mine = [r for r in rows if r["model"] == model]
        out += [f"#### {title}", "",
                "| GPUs | " + " | ".join(f"{n:g} Gb/s per node" for n in nets) + " |",
                "|---:|" + "---|" * len(nets)]
        for g in sorted({r["gpus"] for r in mine}):
            cells = {r["node_gbit_per_s"]: _cell(r) for r in mine if r["gpus"] == g}
            out.append(f"| {g} | " + " | ".join(cells[n] for n in nets) + " |")
        out.append("")
    return "\n".join(out)


def replace_block(path: Path, name: str, text: str) -> None:
    doc = path.read_text()
    pat = re.compile(rf"(<!-- gen:{name} -->\n).*?(<!-- /gen:{name} -->)", re.S)
    if not pat.search(doc):
        sys.exit(f"{path}: no <!-- gen:{name} --> ... <!-- /gen:{name} --> block")
    path.write_text(pat.sub(lambda m: m.group(1) + text + m.group(2), doc))


if __name__ == "__main__":
    os.environ.pop("COLUMNS", None)  # whole lines, as off a terminal
    replace_block(DOCS / "exports.md", "example", exports_block())
    replace_block(DOCS / "whatif.md", "tables", whatif_block())
    print("regenerated docs/exports.md, docs/whatif.md and docs/img/whatif-llama-scaling.png")
