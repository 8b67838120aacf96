"""Activation memory of one micro-batch, by implementation profile (docs/memory.md).

Bytes per token, a_b = bytes of an activation element (2 in bf16, 4 in fp32), h hidden size,
d_kv = kv_heads x head_dim, f FFN size, a heads, V vocabulary, L blocks.

``eager`` (the default): what eager PyTorch saves for backward with SDPA / FlashAttention, as
the bundled runtime, FSDP2 and DeepSpeed run LLaMA-style models, each tensor counted once per
storage (tests/test_saved_tensors.py counts them with ``saved_tensors_hooks``):
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

``fused`` (compiled or fused-kernel stacks: torch.compile, Liger, Apex fused norms): the
Korthikanti et al. 2022 (arXiv 2205.05198) count adapted to no dropout, GQA and SwiGLU,
(6h + 2 d_kv + 3f) a_b + 4a per block, head 2h a_b + 4V, no loss peak (a fused linear
cross-entropy never holds the fp32 logits of the whole micro-batch).

Full checkpointing keeps each block's input (h a_b per token) and one block's activations
while it is recomputed, plus the head. Checkpointing the first K of the L blocks keeps K inputs,
the L - K other blocks whole and, when K > 0, one block's activations while it is recomputed.
Op-level selective checkpointing (every block; matmul and attention outputs kept, the rest
recomputed) keeps per block the input h, the QKV output h + 2 d_kv, the attention output h and
its 4a log-sum-exp, the output projection's h, the MLP's up projection 2f (SwiGLU's gate and up;
GELU: f) and its down projection's h, and while one block is recomputed the saved tensors it
does not have yet: its norms, the rotated Q and K, the head-merged attention output, SiLU's
output and the product (docs/memory.md derives both).

Tensor + sequence parallelism of degree t (Korthikanti et al. 2022, arXiv 2205.05198, section
4.2.2: with SP every activation of a block is divided by t): each TP rank saves 1/t of every
tensor above (norms and residual-stream tensors over its s/t tokens, attention and MLP tensors
over its heads and its f/t columns, log-probabilities over its V/t vocabulary), except what
every rank holds whole: the int64 token ids and targets and the RoPE tables, and, in the eager
profile, the all-gathered inputs of the column-parallel matmuls (QKV, the MLP's gate/up, the LM
head: h a_b per token each), which autograd saves as PyTorch's DTensor runs them (so backward
needs no second all-gather: docs/cost-model.md). The fused profile is Megatron's count, every
block tensor divided by t.
"""

from __future__ import annotations

from amsp_planner.cost.job import Job
from amsp_planner.strategy import checkpointed_blocks

INDEX_BYTES = 8
"""int64 token ids (embedding backward) and targets (cross-entropy backward)."""


def _norm(job: Job) -> float:
    m, ab = job.model, job.training.param_bytes
    if m.norm_type == "layernorm":
        return 2 * m.hidden_size * ab + 8
    return 4 * m.hidden_size + 4 + 2 * m.hidden_size * ab


def _div(x: float, tp: int) -> float:
    """x / tp, and x itself (its type kept) at tp = 1."""
    return x if tp == 1 else x / tp


def _gathered(job: Job, tp: int, count: int) -> float:
    """Bytes per token, beyond their 1/tp share, of `count` all-gathered matmul inputs kept
    whole on every TP rank (eager profile only; module docstring)."""
    if tp == 1 or job.training.activation_profile == "fused":
        return 0.0
    return count * job.model.hidden_size * job.training.param_bytes * (1 - 1 / tp)


def block_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes one block saves per token in the job's activation profile (per TP rank)."""
    if tp > 1:
        return block_bytes_per_token(job) / tp + _gathered(job, tp, 2)
    m, t = job.model, job.training
    ab = t.param_bytes
    h, f, kv, a = m.hidden_size, m.ffn_hidden_size, m.kv_dim, m.num_heads
    softmax = 4 * a if t.flash_attention else 2 * a * t.seq_len * ab
    if t.activation_profile == "fused":
        mlp = 3 * f if m.ffn_type != "gelu" else 2 * f
        return (6 * h + 2 * kv + mlp) * ab + softmax
    rope = (h + kv) * ab if m.position_embedding == "rope" else 0
    mlp = 4 * f if m.ffn_type != "gelu" else 2 * f
    attention = (h + 2 * kv) * ab + rope + 2 * h * ab + softmax
    return 2 * _norm(job) + attention + mlp * ab


def head_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes the head (final norm, logits, loss) and the embedding save per token."""
    m, t = job.model, job.training
    if tp > 1:
        whole = 0 if t.activation_profile == "fused" else 2 * INDEX_BYTES
        return (head_bytes_per_token(job) - whole) / tp + whole + _gathered(job, tp, 1)
    if t.activation_profile == "fused":
        return 2 * m.hidden_size * t.param_bytes + 4 * m.vocab_size
    return _norm(job) + 4 * m.vocab_size + 2 * INDEX_BYTES


def op_kept_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes one op-level checkpointed block keeps per token: its input and the outputs of
    its matmuls and of attention (module docstring); with TP also the gathered matmul inputs
    (so no TP collective is repeated)."""
    m, t = job.model, job.training
    if tp > 1:
        return op_kept_bytes_per_token(job) / tp + _gathered(job, tp, 2)
    h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_dim
    up = f if m.ffn_type == "gelu" else 2 * f
    lse = 4 * m.num_heads if t.flash_attention else 0
    return (h + (h + 2 * kv) + h + h + up + h) * t.param_bytes + lse


def op_recompute_bytes_per_token(job: Job, tp: int = 1) -> float:
    """Bytes the recomputation of one op-level block adds per token: the block's saved
    tensors other than the kept matmul and attention outputs that backward saves too (the QKV
    output, the attention output and its log-sum-exp, the MLP's up projection)."""
    m, t = job.model, job.training
    if tp > 1:
        return op_recompute_bytes_per_token(job) / tp
    h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_dim
    up = f if m.ffn_type == "gelu" else 2 * f
    lse = 4 * m.num_heads if t.flash_attention else 0
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
    else:
        kept = _div(k * m.hidden_size * ab, tp) + (m.num_layers - k) * block + (block if k else 0)
    return kept + head_bytes_per_token(job, tp)


def rope_table_bytes(job: Job) -> float:
    """The cos and sin tables of one micro-batch (eager; one per position, shared by blocks)."""
    m, t = job.model, job.training
    if t.activation_profile == "fused" or m.position_embedding != "rope":
        return 0.0
    return t.seq_len * m.head_dim * t.param_bytes


def saved_bytes(job: Job, micro_batch: int, ckpt: bool | int | str, tp: int = 1) -> float:
    """Bytes of every tensor autograd saves for one micro-batch (what the tests measure)."""
    tokens = micro_batch * job.training.seq_len
    return saved_bytes_per_token(job, ckpt, tp) * tokens + rope_table_bytes(job)


def loss_peak_bytes(job: Job, micro_batch: int, tp: int = 1) -> float:
    """The cross-entropy backward's transient above the saved tensors (eager: 8V per token;
    vocabulary-parallel with TP: 8V/tp)."""
    if job.training.activation_profile == "fused":
        return 0.0
    return _div(8 * job.model.vocab_size * micro_batch * job.training.seq_len, tp)
