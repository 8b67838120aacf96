"""Context parallelism of degree C (``cp=C`` in the strategy string; docs/cost-model.md).

Each sequence of s tokens is split over C ranks along its tokens, s/C on each, and attention
runs over the whole sequence through the engine's exchange (``KINDS``):

- ``ring`` (torchtitan, FSDP2: PyTorch's ``context_parallel``,
  torch/distributed/tensor/experimental/_attention.py, with torchtitan's default rotate method
  ``allgather`` (``--experimental.context_parallel_rotate_method``, 9dec370) and its load
  balancing, which cuts each sequence into 2C chunks): forward all-gathers the K and V of the C
  ranks once per attention call and merges C sub-SDPAs' outputs and log-sum-exps in fp32;
  backward all-gathers K and V again, accumulates dQ, dK, dV in fp32 and passes the fp32 dK, dV
  partial sums around the ring (``permute_tensor``, C sends).
- ``p2p`` (Megatron-Core, and NeMo on it: Transformer Engine's ``AttnFuncWithCPAndKVP2P``,
  ``cp_comm_type`` p2p, the default; transformer_engine/pytorch/attention.py): the same 2C-chunk
  load balancing; the K and V of each rank go round the ring by point-to-point send/recv, one
  hop per step, C steps, the transfer of step i + 1's K, V issued before step i's attention
  and overlapped with it ("overlap current-step compute with next-step communication");
  backward the same ring with K, V and the partial dK, dV passed on in one buffer, the last dK,
  dV hop waited for after the loop.
- ``ulysses`` (DeepSpeed-Ulysses, deepspeed/sequence/layer.py ``DistributedAttention``): an
  all-to-all of each of q, k, v (sequence-sharded to head-sharded) before attention and one of
  its output after; backward the four transposed all-to-alls.

Everything else is the job of sequences of s/C tokens: the per-rank view ``cp_view`` (B C
pieces of s/C tokens over the N/t ranks, i.e. B sequences over N/(t C) data-parallel ranks),
whose attention runs over a context of s (``Job.cp``, cost/compute.py). Per rank, with
t_l = b s / C tokens of a micro-batch of b sequences, a_b bytes per activation element:

Memory: the activations and loss peak of s/C tokens per sequence (every saved tensor is per
token; FlashAttention's log-sum-exp per token and head). Model states and buffers do not change
(sharded over all N/t ranks, as torchtitan's FSDP over dp_shard x cp and DeepSpeed's ZeRO over
its sequence-data-parallel group). The exchange adds the transient buffers of one attention
call (``cp_buffer_bytes``), per token of the rank, per TP rank 1/t of them:
  ring     backward, the larger phase: the gathered K and V of the C ranks 2 C d_kv a_b, the
           fp32 dQ, dK, dV accumulators 4 (h + 2 d_kv), one sub-SDPA's dQ, dK, dV
           (h + 2 d_kv) a_b, the fp32 dK, dV sent and received 2 x 8 d_kv;
  p2p      backward, the larger phase: two ring buffers of K, V and dK, dV, 2 x 4 d_kv a_b;
  ulysses  the all-to-alls' inputs and outputs of q, k, v: 2 (h + 2 d_kv) a_b.

Time: compute of s/C tokens per sequence with attention over s (C times the view's attention
FLOPs), and the exchange's collectives as entries of group CP (size C, stride t: torchtitan's
mesh puts cp inside dp_shard, tp innermost), on the compute stream as TP's are (none hidden:
an upper bound, torch's ring overlaps its all-gather with the first local sub-SDPA), per block
and micro-batch:
  ring     forward: an all-gather of K and V (2 d_kv a_b t_l per rank), one more in the
           recomputed forward of a checkpointed block; backward: one all-gather of K and V and
           the C - 1 passes of the fp32 dK, dV (8 d_kv t_l each) priced as one all-gather that
           moves as many bytes per rank;
  p2p      send/recv hops of 2 d_kv a_b t_l bytes (K and V) between neighbours of the CP
           group, each priced as a pipeline send (cost/pipeline.py: latency + bytes over NVLink,
           or the NIC's share per GPU across nodes) and hidden behind one ring step of the
           attention, the block's attention / C (forward) or 2.5 x that (backward), so a hop
           costs max(0, hop - step): forward C - 1 hops, again in a recomputed forward;
           backward C - 1 hops of K, V with dK, dV (twice the bytes) and the last dK, dV hop
           whole;
  ulysses  forward 4 all-to-alls (q h, k and v d_kv, the output h; a_b t_l per rank), backward
           4, the recomputed forward 4 more.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from amsp_planner.cost.schedule_entry import ScheduleEntry, algorithm_name
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import Strategy, checkpointed_blocks
from amsp_planner.topology import split_bytes

if TYPE_CHECKING:  # annotations only: cost/job.py checks cp= through check_cp
    from amsp_planner.cost.job import Job

KINDS = {"torchtitan": "ring", "fsdp2": "ring", "deepspeed": "ulysses", "megatron": "p2p"}
"""The context-parallel attention each engine runs (module docstring); others run none."""


def cp_kind(job: Job) -> str | None:
    from amsp_planner.engines import runs_as

    return KINDS.get(runs_as(job.engine).partition("@")[0])


def check_cp(job: Job, s: Strategy) -> None:
    """One line naming ``cp=`` and the fix where the job cannot run context parallelism `s.cp`."""
    c, kind, m, t = s.cp, cp_kind(job), job.model, job.training
    head = f"--strategy {s}: cp={c}"
    if kind is None:
        raise AmspUserError(f"{head}: {job.profile.title} does not run context parallelism here: "
                            "use cp=1, or --engine torchtitan / fsdp2 / deepspeed / megatron")
    chunks = 2 * c if kind in ("ring", "p2p") else c  # the ring's load balancing: 2C chunks
    if t.seq_len % chunks:
        raise AmspUserError(f"{head} cuts each sequence into {chunks} equal chunks ({kind} "
                            f"attention): use a --seq-len that is a multiple of {chunks}")
    if not t.flash_attention:
        raise AmspUserError(f"{head} merges attention through FlashAttention's log-sum-exp: "
                            "keep flash_attention on, or use cp=1")
    if m.is_moe:
        raise AmspUserError(f"{head}: context parallelism of a mixture-of-experts model is "
                            "not modelled: use cp=1")
    if kind == "ulysses" and (s.tp > 1 or m.num_heads % c or m.kv_heads % c):
        raise AmspUserError(f"{head}: Ulysses gives each of the cp ranks whole heads: cp must "
                            f"divide the {m.num_heads} query and {m.kv_heads} key/value heads, "
                            "with tp=1")


def cp_view(job: Job, cp: int) -> Job:
    """The job as one rank of context parallelism `cp` runs it (module docstring)."""
    if cp == 1:
        return job
    t = job.training
    tr = t.model_copy(update={"seq_len": t.seq_len // cp, "global_batch_seqs": t.batch_seqs * cp,
                              "global_batch_tokens": None})
    return replace(job, training=tr, cp=cp)


def cp_buffer_bytes(view: Job, s: Strategy) -> float:
    """The exchange's transient bytes during one attention call (module docstring); `view` is
    ``cp_view(job, s.cp)``."""
    if view.cp == 1:
        return 0.0
    m, ab = view.model, view.training.param_bytes
    h, kv, c = m.hidden_size, m.kv_dim, view.cp
    tokens = s.micro_batch * view.training.seq_len
    if cp_kind(view) == "ring":
        per = 2 * c * kv * ab + 4 * (h + 2 * kv) + (h + 2 * kv) * ab + 2 * 8 * kv
    elif cp_kind(view) == "p2p":
        per = 2 * 4 * kv * ab
    else:
        per = 2 * (h + 2 * kv) * ab
    return per * tokens / s.tp


def _entry(view: Job, phase: str, op: str, s: Strategy, dtype: str, per_call: float,
           calls_per_block: float, n_micro: int) -> ScheduleEntry | None:
    """`calls_per_block` calls of `per_call` full bytes per block and micro-batch over the CP
    group (size C, stride t)."""
    if not calls_per_block:
        return None
    topo, c, stride = view.topology, view.cp, s.tp
    one = topo.collective_time(op, c, stride, per_call)
    per_step = n_micro * view.model.num_layers * calls_per_block
    lay = topo.layout(c, stride)
    total = per_step * per_call
    intra, inter = split_bytes(op, total, lay)
    return ScheduleEntry(phase, op, "CP", c, stride, lay.members_per_node, dtype,
                         round(per_step), int(total), intra, inter, per_step * one, 0.0,
                         (0.0, calls_per_block * one, 0.0), (0.0, 0.0, 0.0),
                         algorithm_name(view, op, c, stride, per_call))


def cp_entries(view: Job, s: Strategy, n_micro: int) -> list[ScheduleEntry]:
    """The exchange's collectives of one step (module docstring)."""
    if view.cp == 1:
        return []
    m, t = view.model, view.training
    c, tokens, ab = view.cp, s.micro_batch * t.seq_len, t.param_bytes
    k, op_level = checkpointed_blocks(s.ckpt_value, m.num_layers)
    again = 0.0 if op_level else k / m.num_layers  # attention recomputed in these blocks
    dt = t.dtype_name
    if cp_kind(view) == "ring":
        kv = c * 2 * m.kv_dim * ab * tokens / s.tp  # K and V of the C ranks, gathered
        dkv = c * 8 * m.kv_dim * tokens / s.tp  # fp32 dK, dV: (C - 1) x 8 d_kv t_l sent
        out = [_entry(view, "forward", "all_gather", s, dt, kv, 1, n_micro),
               _entry(view, "recompute", "all_gather", s, dt, kv, again, n_micro),
               _entry(view, "backward", "all_gather", s, dt, kv, 1, n_micro),
               _entry(view, "backward", "all_gather", s, "fp32", dkv, 1, n_micro)]
    elif cp_kind(view) == "p2p":
        return _p2p_entries(view, s, n_micro, again)
    else:
        each = (2 * m.hidden_size + 2 * m.kv_dim) / 4 * ab * tokens  # q, k, v, out: the mean
        out = [_entry(view, ph, "all_to_all", s, dt, each, 4 * n, n_micro)
               for ph, n in (("forward", 1), ("recompute", again), ("backward", 1))]
    return [e for e in out if e is not None]


def p2p_hop_seconds(view: Job, s: Strategy, bytes_: float) -> float:
    """One send/recv hop of `bytes_` per rank between CP neighbours, as a pipeline send
    (cost/pipeline.py ``send_seconds``): NVLink inside a node, the NIC's share across nodes."""
    c = view.cluster
    if view.topology.layout(view.cp, s.tp).members_per_node >= view.cp:
        return c.intra_latency_us * 1e-6 + bytes_ / c.intra_bytes_per_s
    return c.inter_latency_us * 1e-6 + bytes_ / (c.node_nic_bytes_per_s / c.gpus_per_node)


def _p2p_entries(view: Job, s: Strategy, n_micro: int, again: float) -> list[ScheduleEntry]:
    """Transformer Engine's K/V ring (module docstring): the seconds its hops add to the
    compute stream, max(0, hop - ring step) each."""
    from amsp_planner.cost.attention_kernel import attention_fraction

    m, t, c = view.model, view.training, view.cp
    tokens, ab = s.micro_batch * t.seq_len, t.param_bytes
    rate = view.cluster.gpu.peak_flop_per_s(t.dtype_name) * attention_fraction(view)
    attn = 2.0 * tokens * t.seq_len * c * m.num_heads * m.head_dim / s.tp / rate  # compute.py's
    kv = 2 * m.kv_dim * ab * tokens / s.tp
    hop, hop2 = p2p_hop_seconds(view, s, kv), p2p_hop_seconds(view, s, 2 * kv)
    fwd = (c - 1) * max(0.0, hop - attn / c)
    bwd = (c - 1) * max(0.0, hop2 - 2.5 * attn / c) + hop
    per_block = {"forward": fwd, "recompute": again * fwd, "backward": bwd}
    sends = {"forward": (c - 1) * kv, "recompute": again * (c - 1) * kv,
             "backward": (c - 1) * 2 * kv + kv}
    lay = view.topology.layout(c, s.tp)
    out = []
    for phase, sec in per_block.items():
        per_step = n_micro * m.num_layers
        b = sends[phase] * per_step
        if not b:
            continue
        intra = lay.members_per_node >= c
        out.append(ScheduleEntry(phase, "send_recv", "CP", c, s.tp, lay.members_per_node,
                                 t.dtype_name, round(per_step * (c - 1 if phase != "backward"
                                                                 else c)), int(b * c),
                                 b if intra else 0.0, 0.0 if intra else b, per_step * sec, 0.0,
                                 (0.0, sec, 0.0), (0.0, 0.0, 0.0)))
    return out
