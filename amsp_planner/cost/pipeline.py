"""Pipeline parallelism (``pp=P``, ``vpp=V``): a step priced as its busiest stage runs it.

A stage is N/P consecutive GPUs (Megatron's rank order tp-dp-pp) holding ceil(L/P) blocks
(``strategy_pipeline.stage_blocks``); with V model chunks per rank, as many as the engine's
split gives its busiest rank (``strategy_pipeline.CHUNK_SPLITS``: Megatron's with the embedding
and the loss in a block's place, torchtitan's floor/ceil chunks), ceil(L/P) again. Its data- and tensor-parallel work is exactly that of a
job of N/P GPUs training a model of those blocks on the same global batch (``stage_job``):
the same m = B / (DP x mb) micro-batches, the data-parallel collectives of its own layers over
its N/(tp P) DP ranks as the engine's profile runs them (Megatron's distributed optimizer: the
gradients reduce-scattered and the parameters all-gathered per bucket, once per step; FSDP's
per-micro-batch gathers), its optimizer step on its own shard. That job is priced by the
unpipelined model (cost/step_time.py); the pipeline adds:

- the bubble: (P-1)/V micro-batches' work of the stage, t_mb = (compute + its kernels + TP
  and EP collectives + the exposed per-micro-batch gathers) / m (the contention of the
  step-end reduction with the last backward is not a micro-batch's work); the step of
  1F1B is (m + P - 1) t_mb (Narayanan et al. 2021, arXiv 2104.04473, sec. 2.2.1), of the
  interleaved schedule (m + (P-1)/V) t_mb (sec. 2.2.2);
- the point-to-point sends: per micro-batch and model chunk, the activation forward and its
  gradient backward, mb x seq x hidden x 2 bytes (bf16) per boundary, split over the stage's TP
  ranks (Megatron sends the sequence-parallel shard; torchtitan's stages hold it whole at
  tp = 1). Neighbouring stages are N/P ranks apart: over the NIC when a stage spans a node or
  more (every GPU of the node sending at once: a node's NIC bandwidth / R each), NVLink
  otherwise; a send costs its latency + bytes / bandwidth. 1F1B and GPipe exchange them on the
  critical path (Megatron's ``send_forward_recv_backward`` waits for both): 2 (m + P - 1) sends
  exposed; the interleaved schedule overlaps them with another chunk's compute (Megatron-Core's
  ``overlap_p2p_comm``, on by default with interleaving), only the warm-up and cool-down chain,
  2 (P - 1), exposed.

Which stage is charged: the last one (its blocks, the final norm, the LM head and the loss;
the first stage's embedding lookup has no matmul), which is the busiest with equal blocks.
Its blocks are the model's last ones (``stage_model``): the per-layer lists (a mixture of
experts' dense layers, sliding-window layers) re-indexed from the stage's first block, the MTP
modules kept; a mixture of experts' experts and all-to-alls are the stage's, over its N/P ranks
(docs/moe.md, "Pipeline stages").
Memory is the larger of the first stage's (the embedding and its blocks' states, the
activations of ``in_flight`` micro-batches of its blocks and one block's recomputation) and the
last stage's (its blocks, the head, one micro-batch's activations with the head's and the loss
peak). The buffers and reserves are the stage job's.

Not modelled: zero-bubble schedules, uneven stage work beyond ceil(L/P) blocks, the embedding
group's all-reduce of tied embeddings across the first and last stage, and contention of the
sends with the data-parallel collectives.
"""

from __future__ import annotations

from dataclasses import replace

from amsp_planner.cost.job import Job
from amsp_planner.cost.schedule_entry import ScheduleEntry
from amsp_planner.cost.straggler import straggler_seconds
from amsp_planner.engines import runs_as
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import Strategy
from amsp_planner.strategy_pipeline import (
    bubble_fraction,
    check_pp_job,
    chunk_split,
    in_flight,
    schedule_of,
    stage_blocks,
)


def flat(s: Strategy) -> Strategy:
    """The strategy one stage runs as a job of its own (no pipeline tokens)."""
    return s.with_(pp=1, vpp=1, pp_sched=None)


_STAGE_JOBS: dict[tuple[int, int, int], tuple[Job, Job]] = {}
"""(id of the job, P) -> (the job, its stage job): a search prices many strategies of one job."""


def stage_model(model, blocks: int):
    """The model of the last `blocks` layers (the charged stage): the per-layer lists
    (a mixture of experts' dense layers, the sliding-window layers) re-indexed from that
    stage's first layer, the multi-token-prediction modules (the model's last blocks) kept."""
    first = model.num_layers - blocks
    return model.model_copy(update={
        "num_layers": blocks,
        "dense_layers": tuple(i - first for i in model.dense_layers if i >= first),
        "sliding_layers": tuple(i - first for i in model.sliding_layers if i >= first),
        "mtp_layers": min(model.mtp_layers, blocks)})


def stage_job(job: Job, s: Strategy) -> Job:
    """The job of one stage: ceil(L/P) blocks on N/P GPUs, the same batch and engine."""
    hit = _STAGE_JOBS.get((id(job), s.pp, s.cp))
    if hit is not None and hit[0] is job:
        return hit[1]
    model = stage_model(job.model, stage_blocks(job.model.num_layers, s.pp))
    sj = Job.create(model, job.cluster, job.training, job.num_gpus // s.pp, job.engine,
                    cp=s.cp)
    if len(_STAGE_JOBS) > 16:
        _STAGE_JOBS.clear()
    _STAGE_JOBS[id(job), s.pp, s.cp] = (job, sj)
    return sj


def check(job: Job, s: Strategy) -> None:
    """The pipeline's job-level rules (one line, AmspUserError), and the stage job's."""
    try:
        check_pp_job(s.pp, s.vpp, job.model.num_layers, job.n_micro(s),
                     schedule_of(s.pp, s.vpp, s.pp_sched), chunk_split(runs_as(job.engine)))
    except ValueError as e:
        raise AmspUserError(f"--strategy {s}: {e}") from None


def send_bytes(job: Job, s: Strategy) -> float:
    """Bytes one GPU sends per boundary crossing: mb x seq x hidden x activation bytes / tp."""
    t = job.training
    return s.micro_batch * t.seq_len * job.model.hidden_size * t.param_bytes / s.tp


def send_seconds(job: Job, s: Strategy) -> tuple[float, bool]:
    """(seconds of one send, over the NIC?) between neighbouring stages (module docstring)."""
    c, stage = job.cluster, job.num_gpus // s.pp
    inter = stage >= c.gpus_per_node and job.num_gpus > c.gpus_per_node
    if inter:
        bw, lat = c.node_nic_bytes_per_s / c.gpus_per_node, c.inter_latency_us
    else:
        bw, lat = c.intra_bytes_per_s, c.intra_latency_us
    return lat * 1e-6 + send_bytes(job, s) / bw, inter


def p2p_entry(job: Job, s: Strategy, n_micro: int) -> ScheduleEntry:
    """The step's point-to-point sends as one schedule entry (group PP): every micro-batch's
    activation and gradient through each of the V chunks, plus the chain's."""
    per, inter = send_seconds(job, s)
    calls = 2 * s.vpp * n_micro
    b = send_bytes(job, s)
    return ScheduleEntry(
        phase="pipeline", op="send_recv", group="PP", group_size=2,
        stride=job.num_gpus // s.pp, members_per_node=1, dtype=job.training.dtype_name, calls_per_step=calls,
        full_bytes_per_step=int(b * calls), intra_bytes_per_rank_per_step=0.0 if inter else b * calls,
        inter_bytes_per_rank_per_step=b * calls if inter else 0.0, time_s=per * calls)


def pipeline_time(job: Job, s: Strategy, t, n_micro: int):
    """(the step time, the sends' schedule entry) of `s` from its stage's unpipelined step
    time `t` over `n_micro` micro-batches (module docstring)."""
    sched = schedule_of(s.pp, s.vpp, s.pp_sched)
    per_mb = (t.compute_s + t.kernel_s + t.tp_comm_s + t.ep_comm_s + t.exposed_forward_s
              ) / n_micro
    bubble = bubble_fraction(s.pp, s.vpp, n_micro) * n_micro * per_mb
    send, _ = send_seconds(job, s)
    exposed_sends = 2 * (s.pp - 1) + (0 if sched == "interleaved-1f1b" else 2 * n_micro)
    p2p = p2p_entry(job, s, n_micro)
    # the slowest of all N ranks, not of the stage's: the gradient norm is all-reduced over the
    # stages and the gradients over the data-parallel ranks, so each step every rank waits on
    # every other (cost/straggler.py)
    lag = straggler_seconds(t.compute_s + t.kernel_s, job.num_gpus, job.cluster.rank_jitter)
    return replace(t, bubble_s=bubble, p2p_s=exposed_sends * send, straggler_s=lag,
                   comm_total_s=t.comm_total_s + p2p.time_s), p2p


def stage_memory(sj: Job, s: Strategy, mem, n_micro: int):
    """The larger of the first and the last stage's memory (module docstring), from the
    stage job's unpipelined breakdown `mem`."""
    from amsp_planner.cost.activations import phase_bytes
    from amsp_planner.cost.memory import job_state_bytes

    st = flat(s)
    units = sj.tp_units(s.tp)
    head, recompute = phase_bytes(sj, s.micro_batch, st.ckpt_value, s.tp)
    stash = mem.activations - head - recompute  # one micro-batch's blocks (and rope table)
    sched = schedule_of(s.pp, s.vpp, s.pp_sched)
    first_act = stash * in_flight(s.pp, s.vpp, n_micro, sched) + recompute
    first = job_state_bytes(sj, sum(units[:-1]), st)
    last = job_state_bytes(sj, sum(units[1:]), st)
    gpu = sj.cluster.gpu
    experts = mem.expert_params + mem.expert_grads + mem.expert_optimizer  # the same per stage
    out = []
    for states, act, peak, overlap in ((first, first_act, 0.0, 0.0),
                                       (last, mem.activations, mem.loss_peak, mem.phase_overlap)):
        frag = gpu.fragmentation_fraction * (sum(states.values()) + mem.buffers + act + peak
                                             + experts)
        out.append(replace(mem, **states, activations=act, loss_peak=peak, fragmentation=frag,
                           phase_overlap=overlap))
    return max(out, key=lambda m: m.total)


def pipeline_memory(job: Job, s: Strategy, st: Strategy | None = None):
    """The memory ``evaluate`` gives `s` (pp > 1), without its schedule and step time: what
    the pipeline search bisects on (solver/pipeline_search.py); `st`: ``flat(s)``, when the
    caller holds it."""
    from amsp_planner.cost.memory import memory

    job.check(s)
    check(job, s)
    sj = stage_job(job, s)
    st = sj.checked(flat(s) if st is None else st)
    return stage_memory(sj, s, memory(sj, st), sj.n_micro(st))
