"""Memory per GPU, by term.

Model states (ZeRO, arXiv 1910.02054, with K = 12 for mixed-precision Adam):
  parameters Phi/s_P * p_b, gradients Phi/s_G * g_b, optimizer Phi/s_OS * 12 (fp32 master, m, v),
  or, where the engine's sharded parameters are the fp32 master (FSDP2, torchtitan:
  ``EngineProfile.master_params``), parameters Phi/s_P * 4 and optimizer Phi/s_OS * 8;
  hpZ secondary copy Phi/h_z * p_b. (p_b, g_b: 2 in bf16, 4 in fp32; g_b = 4 with fp32
  gradient accumulation.)

Buffers (U = largest padded unit, in elements), exactly what the runtime allocates:
  gather      2 * U * p_b when s_P > 1 (the unit in use + the prefetched one);
              qwZ adds 2 quantized receive buffers of U*(1 + 4/block) bytes; the FP8
              all-gather (fp8ag) 2 receive buffers of the unit's FP8 bytes in the bundled
              runtime, and FP8 units in place of the 2 gathered ones under torchao
              (cost/fp8_bytes.py: unit_gathers);
  grad        2 * U * g_b when s_G > 1 (the unit's full gradient + the next one, overlapping
              the reduce-scatter); qgZ adds 2 buffers of U*(1/2 + 4/block) bytes;
  staging     U * g_b when the gradient needs a permuted copy before its reduction
              (s_G > 1 and (1 < s_P < s_G, or qgZ)). The permuted output of the update
              all-gather (s_P < s_G < s_OS) needs no buffer of its own: it lands in a buffer
              that is idle after backward (a gather buffer when s_P > 1, else a gradient
              buffer, which exists since s_G > 1 there);
  step        U/s_OS * g_b when s_OS > s_G (the OS-shard slice of the step reduce-scatter).
  per module  an engine that fetches per module (DeepSpeed ZeRO-3, ``Execution.gather_grouping
              'module'``) holds what its coordinator gathers, not whole units: the gather term is
              the most elements a replay of its fetch, prefetch and release rules holds at once
              (persistent small parameters included), the gradient term its one reduce bucket
              and the largest parameter's whole gradient (``cost/module_fetch.py``);
  tied        with tied embeddings, one more gather buffer (s_P > 1) and one more gradient
              buffer (s_G > 1) of the embedding unit's E elements: the embedding stays gathered
              from the lookup to the LM head, and its gradient collects the head's part at the
              start of backward and the lookup's at the end (runtime/engine.py, [Note: tied
              embeddings]).

Tensor parallelism of degree t: Phi and U are one TP rank's (``Job.tp_units``: 1/t of every
matrix, the norms whole), so model states and buffers are those of the TP shard, sharded over
the data-parallel ranks as above; activations per TP rank with sequence parallelism
(``cost/activations.py``).

Activations per micro-batch: ``cost/activations.py`` (eager or fused profile; the saved
tensors, and the cross-entropy backward's peak above them). NCCL communicator buffers per
process group the strategy uses: ``cost/communicators.py``.
Mixture of experts (docs/moe.md): the terms above are the dense class's (``Job.units``); the
expert class's states and buffers are the same formulas over the E/e experts a rank holds with
the expert triple (``expert_bytes``), and expert parallelism adds the all-to-all's send and
receive buffers (2 x b s h x copies x imbalance elements,
``moe_compute.dispatch_buffer_bytes``). ``TrainingSpec.master_weights`` off puts every state
in the parameters' dtype (``model_state_bytes``, `pure`).

Totals: (states + buffers + activations + loss peak) * (1 + fragmentation) + communicators
+ context reserve. Three figures of the peak (docs/memory.md, "Allocated, reserved, device"):
``allocated`` (the tensors: torch.cuda.max_memory_allocated), ``reserved`` (the allocator's
segments: max_memory_reserved, torchtitan's logged figure), ``total`` (with NCCL's
buffers and the CUDA context: what the GPU holds and what must fit). The fragmentation
reserve covers what the caching allocator holds beyond the live tensors (rounding to its block
sizes, split blocks it cannot return) and the short-lived tensors of backward (activation gradients, SDPA workspaces); NCCL's buffers are allocated
outside it, and the context reserve is the CUDA context and the libraries' process-wide state.
Backward runs in two phases whose transients never live together: first the loss and the LM
head (the head's saved tensors and the loss peak), then, block by block, the recomputation of
a checkpointed block (what it saves again). ``allocated`` holds the larger of the two;
``reserved`` counts both (``phase_overlap`` is the smaller), taking the loss phase's segments as
still cached while the recomputation allocates tensors of other sizes: an approximation of the
caching allocator, checked on torchtitan PR 165, which published both peaks of its runs
(reserved / allocated 1.20-1.36).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from amsp_planner.cost.activations import loss_peak_bytes, phase_bytes, saved_bytes
from amsp_planner.cost.communicators import communicator_bytes
from amsp_planner.cost.fp8_gathers import fp8_gathers, gathers_fp8
from amsp_planner.cost.job import Job
from amsp_planner.cost.module_fetch import gathered_elements, grad_bucket_elements
from amsp_planner.cost.schedule import quantized_bytes
from amsp_planner.strategy import Strategy

OPTIMIZER_BYTES = 12  # fp32 master + Adam m + v per parameter
MASTER_BYTES = 4  # the fp32 master copy of a parameter


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    hpz: float
    gather_buffers: float
    grad_buffers: float
    staging: float
    step_buffer: float
    activations: float
    loss_peak: float
    fragmentation: float
    communicators: float
    context: float
    expert_params: float = 0.0
    """Mixture of experts: the routed experts' parameter shard (its own factor ep.p); the
    fields above are then the dense class's."""
    expert_grads: float = 0.0
    expert_optimizer: float = 0.0
    expert_buffers: float = 0.0
    """The expert class's gather, gradient, staging and step buffers."""
    dispatch_buffers: float = 0.0
    """The token all-to-all's send and receive buffers (expert parallelism)."""
    cp_buffers: float = 0.0
    """Context parallelism: the K/V exchange's transient buffers of one attention call
    (cost/context_parallel.py)."""
    fp8_weight_cache: float = 0.0
    """Transformer Engine's cached FP8 weights (cost/fp8_bytes.py ``te_weight_cache_bytes``)."""
    load_peak: float = 0.0
    """The segments a whole-model load leaves reserved (``TrainingSpec.model_load`` 'whole'
    with sharded parameters): the unsharded model in its dtype, moved to the GPU before the
    engine shards it. The reserved peak is at least this; 0 otherwise."""
    phase_overlap: float = 0.0
    """Bytes counted in both backward phases that never live together: the head's saved
    tensors with the loss peak, and a checkpointed block's recomputation (the smaller of the
    two). Not allocated at once, but held by the allocator's segments (module docstring)."""

    @property
    def model_states(self) -> float:
        """Parameter, gradient, optimizer shards and the hpZ copy (both classes)."""
        return (self.params + self.grads + self.optimizer + self.hpz + self.expert_params
                + self.expert_grads + self.expert_optimizer)

    @property
    def buffers(self) -> float:
        return (self.gather_buffers + self.grad_buffers + self.staging + self.step_buffer
                + self.expert_buffers + self.dispatch_buffers + self.cp_buffers
                + self.fp8_weight_cache)

    @property
    def runtime_tensors(self) -> float:
        """Model states + buffers: what the runtime's own tensors sum to."""
        return self.model_states + self.buffers

    @property
    def allocated(self) -> float:
        """The live tensors at the peak: what ``torch.cuda.max_memory_allocated`` reports (the
        loss phase and the recomputation phase of backward not at once)."""
        return self.runtime_tensors + self.activations + self.loss_peak - self.phase_overlap

    @property
    def reserved(self) -> float:
        """The caching allocator's segments at the peak: the tensors of both backward phases
        (the segments the loss phase used stay cached when the recomputation allocates) and the
        fragmentation reserve: what ``torch.cuda.max_memory_reserved`` reports, and torchtitan
        logs as ``memory:`` (max_reserved_gib)."""
        return max(self.allocated + self.phase_overlap + self.fragmentation, self.load_peak)

    @property
    def total(self) -> float:
        """What the GPU holds (nvidia-smi's figure): the reserved segments, NCCL's buffers and
        the CUDA context, all outside the allocator's statistics. What must fit."""
        return self.reserved + self.communicators + self.context

    def peak(self, kind: str) -> float:
        """The figure a published peak reports: 'allocated', 'reserved' or 'device'."""
        return {"allocated": self.allocated, "reserved": self.reserved,
                "device": self.total}[kind]

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in OPTIONAL_FIELDS:
            if not d[key]:
                del d[key]  # dense plans keep their fields
        d.update(model_states=self.model_states, buffers=self.buffers, total=self.total)
        return d


def model_state_bytes(phi: float, s: Strategy, param_bytes: int = 2, grad_bytes: int = 2,
                      master: bool = False, pure: bool = False) -> dict[str, float]:
    """Model-state bytes per GPU for Phi parameters (the ZeRO paper's table). With `master`
    (``EngineProfile.master_params``: FSDP keeps its sharded parameters in fp32 and casts
    them in the all-gather), the parameter shard is the fp32 master (4 bytes) and the
    optimizer holds Adam's two moments only (8). With `pure` (``TrainingSpec.master_weights``
    off: no fp32 copy anywhere), parameters, gradient shards and both moments are in the
    parameters' dtype: p_b + p_b + 2 p_b (bf16: 2 + 2 + 4 bytes)."""
    if pure:
        return {"params": phi / s.s_p * param_bytes, "grads": phi / s.s_g * param_bytes,
                "optimizer": phi / s.s_os * 2 * param_bytes,
                "hpz": phi / s.hpz * param_bytes if s.hpz > 1 else 0.0}
    return {
        "params": phi / s.s_p * (MASTER_BYTES if master else param_bytes),
        "grads": phi / s.s_g * grad_bytes,
        "optimizer": phi / s.s_os * (OPTIMIZER_BYTES - MASTER_BYTES if master
                                     else OPTIMIZER_BYTES),
        "hpz": phi / s.hpz * param_bytes if s.hpz > 1 else 0.0,
    }


def job_state_bytes(job: Job, phi: float, s: Strategy) -> dict[str, float]:
    """``model_state_bytes`` with the job's dtypes, its engine's master rule and its
    ``master_weights`` setting; with the optimizer offloaded (cost/offload.py) the optimizer
    states, and the gradient shard where gradients are sharded, are in host memory."""
    t = job.training
    st = model_state_bytes(phi, s, t.param_bytes, t.grad_bytes, job.profile.master_params,
                           pure=not t.master_weights)
    if t.optimizer_offload == "cpu":
        st["optimizer"] = 0.0
        if s.s_g > 1:
            st["grads"] = 0.0
    return st


def activation_bytes(job: Job, micro_batch: int, ckpt: bool | int | str, tp: int = 1) -> float:
    """Saved activations of one micro-batch and the loss peak above them."""
    return saved_bytes(job, micro_batch, ckpt, tp) + loss_peak_bytes(job, micro_batch, tp)


def buffer_bytes(job: Job, s: Strategy) -> dict[str, float]:
    t = job.training
    u, pb, gb = job.tp_max_unit(s.tp), t.param_bytes, t.grad_bytes
    e = job.tp_units(s.tp)[0] if job.model.tied_embeddings else 0
    # DeepSpeed's coordinator holds what its replay says whether it gathers a module's
    # parameters in one call or one by one (0.3.14's 'parameter' grouping)
    per_module = job.profile.execution.gather_grouping in ("module", "parameter") and s.tp == 1
    gather = 0.0
    if s.s_p > 1:
        gather = (gathered_elements(job) if per_module else 2 * u + e) * pb
        if s.qwz:
            gather += 2 * quantized_bytes(u, 8, s.quant_block)
        if gathers_fp8(job, s):  # FP8 receive buffers (the bundled runtime), or FP8 units
            from amsp_planner.cost.fp8 import GATHER_ONLY

            fb = 2 * max(g.gather_bytes for g in fp8_gathers(job, s.tp))
            gather += fb if job.engine in GATHER_ONLY else fb - 2 * u * pb
    grad = 0.0
    if s.s_g > 1:
        grad = (grad_bucket_elements(job) if per_module else 2 * u + e) * gb
        if s.qgz:
            grad += 2 * quantized_bytes(u, 4, s.quant_block)
    staging = u * gb if s.s_g > 1 and (1 < s.s_p < s.s_g or s.qgz) else 0.0
    step = u // s.s_os * gb if s.s_os > s.s_g else 0.0
    return {"gather_buffers": gather, "grad_buffers": grad, "staging": staging,
            "step_buffer": step}


def expert_bytes(job: Job, s: Strategy) -> dict[str, float]:
    """The expert class's states and buffers per GPU, and the all-to-all buffers: the dense
    formulas over the E/e experts a rank holds (``Job.expert_units``) with the expert triple
    (U = the largest expert unit); none for a dense model."""
    if not job.model.is_moe:
        return {}
    t = job.training
    units = job.expert_units(s.ep)
    p, g, o = (s.expert_factor(c) for c in ("p", "g", "os"))
    ex = Strategy(s_p=p, s_g=g, s_os=o)
    st = job_state_bytes(job, sum(units), ex)
    u, pb, gb = max(units), t.param_bytes, t.grad_bytes
    buf = (2 * u * pb if p > 1 else 0) + (2 * u * gb if g > 1 else 0)
    buf += (u * gb if 1 < p < g else 0) + (u // o * gb if o > g else 0)
    from amsp_planner.cost.moe_compute import dispatch_buffer_bytes

    a2a = dispatch_buffer_bytes(job, s.micro_batch, s.ep) if s.ep > 1 else 0.0
    return {"expert_params": st["params"], "expert_grads": st["grads"],
            "expert_optimizer": st["optimizer"], "expert_buffers": float(buf),
            "dispatch_buffers": a2a}


OPTIONAL_FIELDS = ("expert_params", "expert_grads", "expert_optimizer", "expert_buffers",
                   "dispatch_buffers", "cp_buffers", "fp8_weight_cache", "load_peak")
"""Fields left out of a plan's memory where they are 0 (the expert class's, context
parallelism's buffers, a whole-model load), so plans without them keep their fields."""


def fp8_cache(job: Job, s: Strategy) -> float:
    """Transformer Engine's FP8 weight cache of `s`'s TP degree (0 without FP8)."""
    if job.training.precision != "fp8":
        return 0.0
    from amsp_planner.cost.fp8_bytes import te_weight_cache_bytes

    return te_weight_cache_bytes(job, s)


def memory(job: Job, s: Strategy) -> MemoryBreakdown:
    """Every term of the peak per GPU; with context parallelism ``cp=C``, those of the rank's
    s/C tokens per sequence and the exchange's buffers (cost/context_parallel.py)."""
    if s.cp > 1:
        from amsp_planner.cost.context_parallel import cp_buffer_bytes, cp_view

        view = cp_view(job, s.cp)
        m = memory(view, s.with_(cp=1))
        cpb = cp_buffer_bytes(view, s)
        return replace(m, cp_buffers=cpb, fragmentation=m.fragmentation
                       + job.cluster.gpu.fragmentation_fraction * cpb)
    states = job_state_bytes(job, job.tp_phi(s.tp), s)
    bufs = buffer_bytes(job, s)
    experts = expert_bytes(job, s)
    act = saved_bytes(job, s.micro_batch, s.ckpt_value, s.tp)
    peak = loss_peak_bytes(job, s.micro_batch, s.tp)
    head, recompute = phase_bytes(job, s.micro_batch, s.ckpt_value, s.tp)
    gpu = job.cluster.gpu
    cache = fp8_cache(job, s)
    frag = gpu.fragmentation_fraction * (sum(states.values()) + sum(bufs.values()) + act + peak
                                         + sum(experts.values()) + cache)
    load = (job.tp_phi(s.tp) * job.training.param_bytes
            if job.training.model_load == "whole" and s.s_p > 1 else 0.0)
    return MemoryBreakdown(**states, **bufs, activations=act, loss_peak=peak, fragmentation=frag,
                           communicators=communicator_bytes(job, s),
                           context=gpu.context_reserve_gib * 1024**3, **experts,
                           fp8_weight_cache=cache, load_peak=load,
                           phase_overlap=min(head + peak, recompute))
