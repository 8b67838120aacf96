"""Per-GPU peak memory of published runs, predicted by the memory model, as a markdown table.

    python bench/memory_rows.py

Rows (bf16, data parallelism only; docs/memory.md):
- torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Llama-3.1-8B, FSDP on 8 and on 128
  H100 (96 GB HBM2e), seq 8192, local batch 2, op-level selective checkpointing, eager: 82.4 and
  67.0 GiB (max across ranks, steady);
- ml-engineering insights/when-to-upgrade-gpus: DeepSpeed ZeRO-2 on 8x H200, Llama-3.1-8B,
  seq 8192, micro-batch 1, no checkpointing, peak max_memory_reserved 99 GiB (eager) and 80 GiB
  with Liger's fused kernels (the fused profile);
- torchao float8 README, BF16 row: Llama-3-8B, FSDP2 on 8 H100, local batch 1, seq 8192,
  per-op selective checkpointing, torch.compile (fused profile): 47.65 GB.

The selective rows show the predictions without and with full checkpointing, which must bracket
the published figure, and with the planner's op-level checkpointing (matmul and attention
outputs kept): torchtitan's and torchao's policies also recompute every second matmul, so they
keep less than that. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

from amsp_planner.cost.job import Job
from amsp_planner.cost.memory import memory
from amsp_planner.specs import TrainingSpec, load_cluster, load_model
from amsp_planner.strategy import baseline, ckpt_fields

GIB = 1024**3


@dataclass(frozen=True)
class Row:
    source: str
    gpus: int
    cluster: str
    memory_gib: float
    strategy: str
    micro_batch: int
    profile: str
    ac: str
    """'none', 'full' or 'selective' (bracketed by none and full)."""
    published_gib: float


ROWS = (
    Row("torchtitan 8B FSDP, 8 H100, eager", 8, "dgx-h100-ndr", 96, "zero3", 2, "eager",
        "selective", 82.4),
    Row("torchtitan 8B FSDP, 128 H100, eager", 128, "dgx-h100-ndr", 96, "zero3", 2, "eager",
        "selective", 67.0),
    Row("DeepSpeed ZeRO-2 8B, 8 H200", 8, "dgx-h200-ndr", 141, "zero2", 1, "eager", "none",
        99.0),
    Row("DeepSpeed ZeRO-2 8B, 8 H200, Liger", 8, "dgx-h200-ndr", 141, "zero2", 1, "fused",
        "none", 80.0),
    Row("torchao BF16 8B FSDP2, 8 H100, compile", 8, "dgx-h100-ndr", 80, "zero3", 1, "fused",
        "selective", 47.65),
)


def predict(row: Row, ckpt: bool | str) -> float:
    """Predicted per-GPU total (GiB) of the row's job with no, full or op-level ('op')
    checkpointing."""
    cluster = load_cluster(row.cluster, {"gpu.memory_gib": row.memory_gib})
    t = TrainingSpec(seq_len=8192, global_batch_seqs=row.gpus * row.micro_batch,
                     micro_batch=row.micro_batch, activation_profile=row.profile)
    job = Job.create(load_model("llama3-8b"), cluster, t, row.gpus)
    s = baseline(row.strategy, row.gpus, cluster.gpus_per_node).with_(
        micro_batch=row.micro_batch, **ckpt_fields(ckpt))
    return memory(job, s).total / GIB


def table() -> list[dict]:
    out = []
    for r in ROWS:
        none, full = predict(r, False), predict(r, True)
        d = {"source": r.source, "published_gib": r.published_gib, "no_ac_gib": round(none, 1),
             "full_ac_gib": round(full, 1), "gpu_gib": r.memory_gib}
        if r.ac == "selective":
            d["brackets"] = full <= r.published_gib <= none
            d["op_ac_gib"] = round(predict(r, "op"), 1)
        else:
            pred = full if r.ac == "full" else none
            d["error"] = round((pred - r.published_gib) / r.published_gib, 3)
            d["fit_agrees"] = (pred <= r.memory_gib) == (r.published_gib <= r.memory_gib)
        out.append(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    rows = table()
    if ap.parse_args().json:
        print(json.dumps(rows, indent=2))
        return
    print("| run | published GiB | predicted no AC | predicted full AC | predicted op-level AC "
          "| error / bracket |")
    print("| --- | --- | --- | --- | --- | --- |")
    for d in rows:
        verdict = (f"{d['error']:+.1%}" if "error" in d
                   else ("brackets it" if d["brackets"] else "does not bracket it"))
        print(f"| {d['source']} | {d['published_gib']} | {d['no_ac_gib']} | "
              f"{d['full_ac_gib']} | {d.get('op_ac_gib', '')} | {verdict} |")
    errs = [abs(d["error"]) for d in rows if "error" in d]
    print(f"\nmedian |error| over rows with an expressible checkpointing: "
          f"{statistics.median(errs):.1%}")


if __name__ == "__main__":
    main()
