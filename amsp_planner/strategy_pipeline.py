"""Pipeline parallelism's rules on a strategy (``pp=``, ``vpp=``, ``pp.sched=``).

A pipeline of P stages splits the N GPUs into P stages of N/P consecutive GPUs (Megatron's
rank order tp-dp-pp: megatron/core/parallel_state.py, ``RankGenerator(order='tp-cp-ep-dp-pp')``),
each holding a contiguous run of blocks; inside a stage the tensor- and data-parallel rules are
those of a job of N/P GPUs. The schedules:

- ``1f1b`` (PipeDream-flush; Megatron's ``forward_backward_pipelining_without_interleaving``,
  torchtitan's ``Schedule1F1B``): bubble (P-1)/m of the micro-batch work, the first stage
  holding min(P, m) micro-batches' activations;
- ``interleaved-1f1b`` (Megatron's ``--num-layers-per-virtual-pipeline-stage``, torchtitan's
  ``ScheduleInterleaved1F1B``): V model chunks per rank, bubble (P-1)/(V m), m a multiple of P
  (Megatron asserts it: ``num_microbatches % pipeline_parallel_size == 0``);
- ``gpipe`` (torchtitan's ``ScheduleGPipe``): the bubble of 1F1B, every micro-batch's
  activations held at once.

Narayanan et al. 2021 (arXiv 2104.04473) sec. 2.2.1-2.2.2.
"""

from __future__ import annotations

PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")


def schedule_of(pp: int, vpp: int, sched: str | None) -> str:
    """The schedule a strategy runs: its ``pp.sched``, else 1f1b (interleaved with vpp > 1)."""
    if sched is not None:
        return sched
    return "interleaved-1f1b" if vpp > 1 else "1f1b"


def check_pp(pp: int, vpp: int, sched: str | None, num_gpus: int, gpus_per_node: int) -> None:
    """Raise ValueError (one line with the fix) unless the pipeline fits N GPUs, R per node."""
    if pp == 1:
        if vpp > 1 or sched is not None:
            raise ValueError(f"vpp={vpp}/pp.sched without pipeline stages: give pp= (at least 2) "
                             "or drop vpp and pp.sched")
        return
    if num_gpus % pp:
        raise ValueError(f"pp={pp} does not divide the {num_gpus} GPUs: use a divisor of "
                         f"{num_gpus}")
    stage, r = num_gpus // pp, gpus_per_node
    if not (stage % r == 0 or r % stage == 0):
        raise ValueError(f"pp={pp} makes stages of {stage} GPUs, neither whole {r}-GPU nodes "
                         "nor a divisor of one: use pp= a divisor of the node count")
    s = schedule_of(pp, vpp, sched)
    if (s == "interleaved-1f1b") != (vpp > 1):
        raise ValueError(f"pp.sched={s} with vpp={vpp}: the interleaved schedule needs vpp >= 2 "
                         "and the others vpp=1")


CHUNK_SPLITS = ("even", "megatron", "any")
"""How an engine splits L blocks into P x V model chunks (``chunk_split``): ``even`` L/(P V)
each; ``megatron`` also Megatron-Core's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split, the embedding and the loss each in a block's place, so
(L + 2)/(P V) per chunk with one block fewer in the first and the last
(megatron/training/arguments.py, transformer_block.py); ``any`` torchtitan's
generate_split_points (torchtitan/parallelisms/pipelining_utils.py at 9dec370): floor(L/(P V))
in the first chunk, one more in the middle ones while the remainder lasts, the rest in the last.
With each, the busiest rank holds ceil(L / P) blocks (``stage_blocks``)."""


def chunk_split(engine_family: str) -> str:
    """The chunk split an engine's pipeline runs (``CHUNK_SPLITS``): Megatron-Core's family
    ``megatron``, torchtitan ``any``, the rest ``even``."""
    return {"megatron": "megatron", "torchtitan": "any"}.get(engine_family, "even")


def splits_into(num_layers: int, chunks: int, split: str = "even") -> bool:
    """Whether `split` (``CHUNK_SPLITS``) places `num_layers` blocks in `chunks` model chunks."""
    if split == "any":
        return chunks <= num_layers
    return num_layers % chunks == 0 or (split == "megatron" and (num_layers + 2) % chunks == 0
                                        and (num_layers + 2) // chunks >= 2)


def check_pp_job(pp: int, vpp: int, num_layers: int, n_micro: int, sched: str,
                 split: str = "even") -> None:
    """The job-level rules: at least one block per (virtual) stage; the model chunks of an
    interleaved schedule as the engine splits them (``split``, ``CHUNK_SPLITS``); the
    interleaved schedule needs a micro-batch count that is a multiple of the stages
    (Megatron's assertion)."""
    if pp * vpp > num_layers:
        raise ValueError(f"pp={pp} x vpp={vpp} = {pp * vpp} stages for {num_layers} blocks: "
                         f"each (virtual) stage needs a block: use pp x vpp <= {num_layers}")
    if vpp > 1 and not splits_into(num_layers, pp * vpp, split):
        extra = (f" or of {num_layers + 2} (the embedding and the loss in a block's place)"
                 if split == "megatron" else "")
        raise ValueError(f"vpp={vpp}: the {num_layers} blocks do not split evenly into pp x vpp "
                         f"= {pp * vpp} model chunks: use pp x vpp a divisor of {num_layers}"
                         f"{extra}")
    if sched == "interleaved-1f1b" and n_micro % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches a multiple of pp={pp} "
                         f"(got {n_micro}): change mb= or the global batch")


def stage_blocks(num_layers: int, pp: int) -> int:
    """Blocks of the busiest stage: ceil(L / P) (uneven splits give the remainder to others,
    as Megatron's --decoder-first/last-pipeline-num-layers and torchtitan's split do)."""
    return -(-num_layers // pp)


def in_flight(pp: int, vpp: int, n_micro: int, sched: str) -> float:
    """Micro-batches of a full stage's activations the first stage holds at its peak: 1F1B
    min(P, m); interleaved P (1 + (P-1)/(P V)) (Narayanan et al. 2021, sec. 2.2.2; Korthikanti
    et al. 2022, arXiv 2205.05198, sec. 4.2.3), at most m; GPipe every micro-batch, m."""
    if sched == "gpipe":
        return float(n_micro)
    if sched == "interleaved-1f1b":
        return min(float(n_micro), pp * (1 + (pp - 1) / (pp * vpp)))
    return float(min(pp, n_micro))


def bubble_fraction(pp: int, vpp: int, n_micro: int) -> float:
    """Idle time of a stage over its work: (P-1)/(V m) (Narayanan et al. 2021, sec. 2.2)."""
    return (pp - 1) / (vpp * n_micro)
