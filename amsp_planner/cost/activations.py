"""Activation memory of one micro-batch, by implementation profile (docs/memory.md).

Bytes per token, a_b = bytes of an activation element (2 in bf16, 4 in fp32), h hidden size,
d_kv = kv_heads x head_dim, f FFN size, a heads, V vocabulary, L blocks. The profile is the
training spec's ``activation_profile``, by default the engine's (``EngineProfile.
activation_profile``: amsp, FSDP2 and DeepSpeed eager, torchtitan its own, InternEvo fused).

``eager``: what eager PyTorch saves for backward with SDPA / FlashAttention, as the bundled
runtime, and Hugging Face models under FSDP2 or DeepSpeed, run LLaMA-style models, each tensor
counted once per storage (tests/test_saved_tensors.py counts them with ``saved_tensors_hooks``):
  per RMSNorm     4h (fp32 copy of the input) + 4 (fp32 1/rms) + 2h a_b (normalized, weighted);
                  LayerNorm: the input and output 2h a_b + 8 (fp32 mean and 1/std)
  attention       (h + 2 d_kv) a_b  QKV projection output (V is a view of it, so it stays whole)
                  (h + d_kv) a_b    rotated Q and K (RoPE; learned positions rotate nothing)
                  2h a_b            attention output and its head-merged copy (the out-proj input)
                  4a                fp32 log-sum-exp per head (FlashAttention; without it the
                                    scores and probabilities, 2 a s a_b)
  MLP             4f a_b  SwiGLU: gate/up output (2f), SiLU output, product; GELU: 2f
  per block       2 norms + attention + MLP (the residual adds save nothing)
  head            final norm + 4V (fp32 log-probabilities) + 8 (int64 targets) + 8 (int64 tokens
                  kept by the embedding lookup); RoPE tables s x head_dim x a_b per micro-batch
  loss peak       8V more while cross-entropy runs backward: the fp32 gradients of the
                  log-probabilities and of the logits exist together with the saved 4V, 12V in
                  all (measured by tests/test_saved_tensors.py on CPU: 12.0 bytes per entry).

``torchtitan``: torchtitan's Llama code run eagerly, as its latest release runs it (v0.2.2,
2026-02-20: torchtitan/models/llama3/model/model.py; every published torchtitan run too; the
fused ``wqkv`` of main since pytorch/torchtitan#2878, 2026-04, is in no release), the eager
count with three differences:
  norms           ``nn.RMSNorm``, one fused kernel on CUDA: its input and fp32 1/rms (the
                  output is saved by the next matmul): 2h a_b + 4
  attention       separate wq, wk, wv: their bf16 outputs go to ``.float()`` (which saves
                  nothing) but V, which attention saves: d_kv a_b; RoPE as a complex product in
                  fp32 (``view_as_complex(xq.float())``): the fp32 copies of Q and K
                  4(h + d_kv), the rotated Q and K (h + d_kv) a_b; the attention output and its
                  ``.contiguous()`` copy 2h a_b; log-sum-exp 4a
  tables          ``freqs_cis`` is a model buffer (not per micro-batch): none
  head            fused final norm, fp32 cross-entropy (``F.cross_entropy(pred.float())``): 4V
                  saved and the 8V loss peak of eager.

``fused`` (Megatron-Core with Transformer Engine, Liger, flash-attn's fused ops): the
Korthikanti et al. 2022 (arXiv 2205.05198) count adapted to no dropout, GQA and SwiGLU,
(6h + 2 d_kv + 3f) a_b + 4a per block, head 2h a_b + 4V (the fp32 softmax of a vocabulary-
parallel cross-entropy), no loss peak (a fused cross-entropy computes the logits' gradient in
its forward).

``compiled`` (torch.compile of each block, as torchtitan's ``compile`` compiles them): the
blocks as ``fused`` (Inductor fuses the norms, RoPE and SwiGLU's pointwise ops and its min-cut
partitioner recomputes them from the matmul outputs); the head and loss as eager (the final
norm fused), as torchtitan ran them in the published compiled runs (2024: the model's blocks
compiled, the loss not).

Mixture of experts: a block's MLP part is the mean over the L blocks of a dense layer's and a
MoE layer's (router probabilities, the routed copies' expert inputs, MLP tensors and outputs,
the shared expert: cost/moe_compute.py), scaled by the expert imbalance for the routed part.

``ckpt=moe`` (mixtures of experts) drops each MoE layer's MLP part (``moe_layer_saved``: the
router's probabilities, the routed copies' tensors, the shared expert's) and keeps the rest of
every block, the MLP's input (the pre-MLP norm's output) included; one MoE layer's MLP part is
saved again while it is recomputed in backward.
Full checkpointing keeps each block's input (h a_b per token) and one block's activations
while it is recomputed, plus the head. Checkpointing the first K of the L blocks keeps K inputs,
the L - K other blocks whole and, when K > 0, one block's activations while it is recomputed.
Op-level selective checkpointing (every block) keeps the block's input and the outputs of
attention (with its log-sum-exp) and of the matmuls its policy saves (``op_policy``: the
engine's ``EngineProfile.op_policy``, torchtitan's wherever the torchtitan profile runs):
  matmuls    every matmul (the bundled runtime: QKV h + 2 d_kv, output projection h, gate/up
             2f (GELU: f), down h);
  alternate  every second matmul in forward order, counted per block (torchtitan's policy:
             ``op_sac_save_list`` = aten.mm, the SDPA kernels and reduce-scatter, "every
             second mm" recomputed, the count reset per block: torchtitan v0.2.2
             torchtitan/distributed/activation_checkpoint.py ``_apply_op_sac``, as in
             torchtrain/parallelisms/parallelize_llama.py at 83c879f, 2024-03): of wq, wk, wv,
             wo, w1, w3, w2 it keeps wq h, wv d_kv, w1 f and w2 h, and recomputes wk, wo and w3
             (GELU: keeps wq, wv and fc1);
and, while one block is recomputed, the saved tensors of the profile that it does not have yet
(docs/memory.md derives both).

Tensor + sequence parallelism of degree t (Korthikanti et al. 2022, arXiv 2205.05198, section
4.2.2: with SP every activation of a block is divided by t): each TP rank saves 1/t of every
tensor above (norms and residual-stream tensors over its s/t tokens, attention and MLP tensors
over its heads and its f/t columns, log-probabilities over its V/t vocabulary), except what
every rank holds whole: the int64 token ids and targets and the RoPE tables, and, in the eager
profiles, the all-gathered inputs of the column-parallel matmuls (QKV, the MLP's gate/up, the LM
head: h a_b per token each), which autograd saves as PyTorch's DTensor runs them (so backward
needs no second all-gather: docs/cost-model.md). The fused and compiled profiles are Megatron's
count, every block tensor divided by t; compiled keeps the all-gathered inputs whole as eager does
(Inductor's min-cut partitioner never recomputes a collective, torch/_functorch/partitioners.py,
so the gathered input a matmul's weight gradient needs is saved).
"""

from __future__ import annotations

from amsp_planner.ckpt_setting import is_moe_only
from amsp_planner.cost.job import Job
from amsp_planner.strategy import checkpointed_blocks

INDEX_BYTES = 8
"""int64 token ids (embedding backward) and targets (cross-entropy backward)."""

PROFILES = ("eager", "torchtitan", "compiled", "fused")
KORTHIKANTI = frozenset({"compiled", "fused"})
"""Profiles whose blocks are Korthikanti et al.'s fused count (under TP the fused profile keeps
no all-gathered input whole; compiled does: module docstring)."""


def profile_of(job: Job) -> str:
    """The job's activation profile: its training spec's, else its engine's default."""
    return job.training.activation_profile or job.profile.activation_profile


def op_policy(job: Job) -> str:
    """The op-level checkpointing policy: the engine's, or torchtitan's wherever its model
    code runs (the torchtitan profile: its code and its ``SelectiveAC`` come together)."""
    return "alternate" if profile_of(job) == "torchtitan" else job.profile.op_policy


def _norm(job: Job, fused: bool = False) -> float:
    m, ab = job.model, job.training.param_bytes
    if m.norm_type == "layernorm":
        return 2 * m.hidden_size * ab + 8
    if fused:
        return 2 * m.hidden_size * ab + 4
    return 4 * m.hidden_size + 4 + 2 * m.hidden_size * ab


def _div(x: float, tp: int) -> float:
    """x / tp, and x itself (its type kept) at tp = 1."""
    return x if tp == 1 else x / tp


def _gathered(job: Job, tp: int, count: int) -> float:
    """Bytes per token, beyond their 1/tp share, of `count` all-gathered matmul inputs kept
    whole on every TP rank (eager profiles only; module docstring)."""
    if tp == 1 or profile_of(job) == "fused":
        return 0.0
    return count * job.model.hidden_size * job.training.param_bytes * (1 - 1 / tp)


def _unsplit(job: Job, tp: int) -> float:
    """Bytes per token, beyond their 1/tp share, that tensor parallelism without sequence
    parallelism keeps whole on every rank: the two norms' inputs and (fused profiles; the eager
    ones count them in ``_gathered``) the two matmul inputs after them (Korthikanti et al. 2022,
    eq. 2: 10 sbh of the 34 sbh, less the 2 sbh of dropout masks, which no profile holds)."""
    if tp == 1 or job.training.sequence_parallel:
        return 0.0
    lin = 2 * job.model.hidden_size * job.training.param_bytes if profile_of(job) in KORTHIKANTI else 0
    return (2 * _norm(job) + lin) * (1 - 1 / tp)


def _softmax(job: Job) -> float:
    """Attention's own saved statistics per token: fp32 log-sum-exp per head with
    FlashAttention, else the scores and probabilities."""
    m, t = job.model, job.training
    return 4 * m.num_heads if t.flash_attention else 2 * m.num_heads * t.seq_len * t.param_bytes


def block_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes one block saves per token in the job's activation profile (per TP rank)."""
    if tp > 1:
        return block_bytes_per_token(job) / tp + _gathered(job, tp, 2) + _unsplit(job, tp)
    m, ab, prof = job.model, job.training.param_bytes, profile_of(job)
    h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_dim
    gelu = m.ffn_type == "gelu"
    if m.is_moe:  # the MLP part, the mean over the blocks (cost/moe_compute.py)
        from amsp_planner.cost.moe_compute import mean_mlp_saved
    if prof in KORTHIKANTI:
        mlp = (2 * f if gelu else 3 * f) * ab
        if m.is_moe:
            mlp = mean_mlp_saved(job, True, mlp)
        return (6 * h + 2 * kv) * ab + mlp + _softmax(job) - _te_fp8_saving(job)
    rope = m.position_embedding == "rope"
    mlp = (2 * f if gelu else 4 * f) * ab
    if m.is_moe:
        mlp = mean_mlp_saved(job, False, mlp)
    if prof == "torchtitan":
        rotary = 4 * (h + kv) + (h + kv) * ab if rope else 0  # fp32 Q, K; rotated Q, K
        qkv = kv * ab + rotary  # wv's output V (wq's and wk's go to .float())
        return 2 * _norm(job, fused=True) + qkv + 2 * h * ab + _softmax(job) + mlp
    rotated = (h + kv) * ab if rope else 0
    attention = (h + 2 * kv) * ab + rotated + 2 * h * ab + _softmax(job)
    return 2 * _norm(job) + attention + mlp - _te_fp8_saving(job)


def _te_fp8_saving(job: Job) -> float:
    """Bytes per token a block saves less with Transformer Engine's FP8 linears (their inputs
    kept in FP8: cost/fp8_bytes.py ``te_saved_input_saving``; in every profile the four linears'
    inputs are saved tensors of the count); 0 otherwise."""
    if job.training.precision != "fp8":
        return 0  # an int: the plans' activation bytes keep their type
    from amsp_planner.cost.fp8_bytes import te_saved_input_saving

    return te_saved_input_saving(job)


def head_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes the head (final norm, logits, loss) and the embedding save per token."""
    m, ab, prof = job.model, job.training.param_bytes, profile_of(job)
    if tp > 1:
        whole = 0 if prof == "fused" else 2 * INDEX_BYTES
        return (head_bytes_per_token(job) - whole) / tp + whole + _gathered(job, tp, 1)
    logits = (0 if fused_linear_ce(job) else ab * m.vocab_size if compiled_ce(job)
              else 4 * m.vocab_size)
    if "z_loss" in eager_loss_extras(job) and prof != "fused":
        # eager z-loss: LogsumexpBackward0 keeps its fp32 input (derivatives.yaml logsumexp:
        # logsumexp_backward(grad, self, result, ...)), beside log-softmax's output
        logits += 4 * m.vocab_size
    if prof == "fused":
        return 2 * m.hidden_size * ab + logits
    return _norm(job, fused=prof != "eager") + logits + 2 * INDEX_BYTES


def fused_linear_ce(job: Job) -> bool:
    """The job runs Liger's fused linear cross-entropy (``TrainingSpec.cross_entropy``)."""
    return job.training.cross_entropy == "fused_linear"


def compiled_ce(job: Job) -> bool:
    """The loss runs under torch.compile (``TrainingSpec.cross_entropy`` 'compiled'): the
    logits saved and their gradient written at the training dtype, no fp32 copies."""
    return job.training.cross_entropy == "compiled"


def eager_loss_extras(job: Job) -> tuple[str, ...]:
    """The extra passes (``TrainingSpec.loss_extras``: z-loss, the shifted-logits copy) the
    job's loss runs eagerly over the fp32 logits: none where the loss is compiled, fused with
    the head, or the engine's own fused kernel (``EngineProfile.fused_cross_entropy``), which
    compute them inside their kernels."""
    if job.training.cross_entropy != "logits" or job.profile.fused_cross_entropy:
        return ()
    return job.training.loss_extras


def flce_chunk_tokens(job: Job, micro_batch: int) -> int:
    """Tokens of one chunk of Liger's fused linear cross-entropy: the next power of two of
    ceil(BT / ceil(V / H)), so that a chunk's logits (chunk x V) are about the head's input
    (BT x H) in size (liger_kernel/ops/fused_linear_cross_entropy.py v0.8.0
    ``fused_linear_cross_entropy_forward``: inc_factor, chunk_size)."""
    m = job.model
    bt = micro_batch * job.training.seq_len
    inc = -(-m.vocab_size // m.hidden_size)
    return 1 << max(0, (-(-bt // inc) - 1).bit_length())


def flce_weight_grad_bytes(job: Job, tp: int = 1) -> float | int:
    """The head weight's gradient Liger's fused linear cross-entropy allocates in its forward
    (``torch.zeros_like(weight)``, the gathered weight's dtype) and saves for its backward,
    once per micro-batch; 0 without it."""
    if not fused_linear_ce(job):
        return 0  # an int: the plans' activation bytes keep their type
    m = job.model
    return _div(m.vocab_size * m.hidden_size * job.training.param_bytes, tp)


def _op_matmuls(job: Job) -> list[tuple[str, int]]:
    """(name, output width) of a block's matmuls in forward order: torchtitan's separate wq,
    wk, wv where its policy runs ('alternate'), else the bundled runtime's fused wqkv; then
    wo, w1, w3, w2 (GELU: fc1, fc2)."""
    m = job.model
    h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_dim
    mlp = [("fc1", f), ("fc2", h)] if m.ffn_type == "gelu" else [("w1", f), ("w3", f), ("w2", h)]
    if op_policy(job) == "alternate":
        return [("wq", h), ("wk", kv), ("wv", kv), ("wo", h)] + mlp
    return [("wqkv", h + 2 * kv), ("wo", h)] + mlp


def op_recomputed_matmuls(job: Job) -> tuple[str, ...]:
    """The matmuls the engine's op-level policy recomputes in backward: none for 'matmuls',
    every second in forward order for 'alternate' (torchtitan: wk, wo and w3; GELU: wk, wo,
    fc2)."""
    if op_policy(job) != "alternate":
        return ()
    return tuple(name for i, (name, _) in enumerate(_op_matmuls(job)) if i % 2)


def op_kept_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes one op-level checkpointed block keeps per token: its input, the outputs of
    attention and of the matmuls the engine's policy saves (module docstring); with TP also
    the gathered matmul inputs (so no TP collective is repeated)."""
    m, t = job.model, job.training
    if tp > 1:
        return op_kept_bytes_per_token(job) / tp + _gathered(job, tp, 2)
    h = m.hidden_size
    lse = 4 * m.num_heads if t.flash_attention else 0
    if op_policy(job) == "alternate":
        gone = set(op_recomputed_matmuls(job))
        kept = sum(w for name, w in _op_matmuls(job) if name not in gone)
        return (h + h + kept) * t.param_bytes + lse
    f, kv = m.ffn_hidden_size, m.kv_dim
    up = f if m.ffn_type == "gelu" else 2 * f
    return (h + (h + 2 * kv) + h + h + up + h) * t.param_bytes + lse


def op_recompute_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes the recomputation of one op-level block adds per token: the block's saved
    tensors other than the kept outputs that backward saves too (attention's output and
    log-sum-exp, and wv's output V and the MLP's first projection, or with the 'matmuls' policy
    the whole QKV output and the MLP's up projection)."""
    m, t = job.model, job.training
    if tp > 1:
        return op_recompute_bytes_per_token(job) / tp
    h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_dim
    lse = 4 * m.num_heads if t.flash_attention else 0
    if op_policy(job) == "alternate":
        shared = (kv + h + f) * t.param_bytes + lse
    else:
        up = f if m.ffn_type == "gelu" else 2 * f
        shared = (h + 2 * kv + h + up) * t.param_bytes + lse
    return max(0.0, block_bytes_per_token(job) - shared)


def saved_bytes_per_token(job: Job, ckpt: bool | int | str, tp: int = 1) -> float:
    """Bytes autograd holds per token at the end of forward, plus, when checkpointing, what
    the recomputation of one block adds in backward. `ckpt`: True (every block), False, the
    first K blocks, or 'op'. With `tp`, per TP rank (a checkpointed block's input is
    sequence-parallel: 1/tp of it)."""
    m, ab = job.model, job.training.param_bytes
    block = block_bytes_per_token(job, tp)
    k, op = checkpointed_blocks(ckpt, m.num_layers)
    if op:
        kept = (m.num_layers * op_kept_bytes_per_token(job, tp)
                + op_recompute_bytes_per_token(job, tp))
    elif is_moe_only(ckpt) and m.num_moe_layers:  # every MoE MLP's tensors but one's dropped
        kept = m.num_layers * block - (m.num_moe_layers - 1) * _moe_saved(job, tp)
    else:
        inp = k * m.hidden_size * ab  # a checkpointed block's input: 1/tp of it with SP
        inp = _div(inp, tp) if job.training.sequence_parallel else inp
        kept = inp + (m.num_layers - k) * block + (block if k else 0)
    return kept + head_bytes_per_token(job, tp)


def _moe_saved(job: Job, tp: int) -> float:
    """Bytes one MoE layer's MLP part saves per token (``ckpt=moe`` drops them and saves
    them again while it recomputes the layer); per TP rank."""
    from amsp_planner.cost.moe_compute import moe_layer_saved

    return _div(moe_layer_saved(job, profile_of(job) in KORTHIKANTI), tp)


def phase_bytes(job: Job, micro_batch: int, ckpt: bool | int | str, tp: int = 1
                ) -> tuple[float, float]:
    """(head, recomputation): the bytes of one micro-batch that exist only in one phase of
    backward. The head's saved tensors (with the loss peak above them, ``loss_peak_bytes``) live
    until the loss and the LM head have run backward; the recomputation of a checkpointed block
    (what it saves again) only after that. Both are in ``saved_bytes``."""
    tokens = micro_batch * job.training.seq_len
    k, op = checkpointed_blocks(ckpt, job.model.num_layers)
    per = (op_recompute_bytes_per_token(job, tp) if op
           else block_bytes_per_token(job, tp) if k
           else _moe_saved(job, tp) if is_moe_only(ckpt) and job.model.num_moe_layers else 0.0)
    return (head_bytes_per_token(job, tp) * tokens + flce_weight_grad_bytes(job, tp),
            per * tokens)


def rope_table_bytes(job: Job) -> float:
    """The cos and sin tables of one micro-batch (eager; one per position, shared by blocks)."""
    m, t = job.model, job.training
    if profile_of(job) != "eager" or m.position_embedding != "rope":
        return 0.0
    return t.seq_len * m.head_dim * t.param_bytes


def saved_bytes(job: Job, micro_batch: int, ckpt: bool | int | str, tp: int = 1) -> float:
    """Bytes of every tensor autograd saves for one micro-batch (what the tests measure)."""
    tokens = micro_batch * job.training.seq_len
    return (saved_bytes_per_token(job, ckpt, tp) * tokens + rope_table_bytes(job)
            + flce_weight_grad_bytes(job, tp))


LOSS_PEAK_PER_V = {"eager": 8, "torchtitan": 8, "compiled": 8, "fused": 0}
"""Bytes per token and vocabulary entry that cross-entropy's backward holds above the saved
tensors: eager fp32 gradients of the log-probabilities and the logits (measured, 8V); none
fused."""


def loss_peak_bytes(job: Job, micro_batch: int, tp: int = 1) -> float:
    """The cross-entropy backward's transient above the saved tensors, by profile
    (``LOSS_PEAK_PER_V``; vocabulary-parallel with TP: 1/tp of it); a compiled loss's is the
    logits' gradient at the training dtype (bench/compiled_loss_memory.py: Inductor writes it
    in one kernel, no fp32 copies)."""
    if fused_linear_ce(job):  # one chunk's logits and its input gradient, in the forward
        m = job.model
        chunk = min(flce_chunk_tokens(job, micro_batch), micro_batch * job.training.seq_len)
        return _div(chunk * (m.vocab_size + m.hidden_size) * job.training.param_bytes, tp)
    per = job.training.param_bytes if compiled_ce(job) else LOSS_PEAK_PER_V[profile_of(job)]
    return _div(per * job.model.vocab_size * micro_batch * job.training.seq_len, tp)
