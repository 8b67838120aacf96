"""The parameter tensors of a unit (the embedding, a block, the head) as an engine that fetches
or reduces module by module, tensor by tensor, sees them (``cost/schedule.py`` prices its
calls from these). Pure functions of the ``ModelSpec``."""

from __future__ import annotations


def unit_elements(job, tp: int = 1) -> tuple[int, int, int]:
    """Padded elements of a unit of each class (the embedding, a block, the head), one TP
    rank's shard."""
    u = job.tp_units(tp)
    return u[0], u[1] if len(u) > 2 else 0, u[-1]


def unit_tensors(model) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Elements of each parameter-holding module of (the embedding, a block, the head), in
    execution order, as an engine that fetches per module sees them: a linear layer with its
    bias, a norm, the embedding table (and learned positions), the LM head. They sum to
    ``ModelSpec.unit_params``."""
    m = model
    h, f, q, kv = m.hidden_size, m.ffn_hidden_size, m.q_dim, m.kv_dim
    qkv_b = m.attention_bias in ("qkv", "all")
    qkv = [h * x + (x if qkv_b else 0) for x in (q, kv, kv)]  # fused: one (d_q + 2 d_kv) x h
    attn = ([sum(qkv)] if m.fused_qkv else qkv) + [q * h + (h if m.attention_bias == "all" else 0)]
    up = [h * f + (f if m.mlp_bias else 0)] * (m.ffn_matrices - 1)
    mlp = up + [f * h + (h if m.mlp_bias else 0)]
    norm = m._norm_params()
    qk = ([m.head_dim] * 2 if m.qk_norm == "head" else
          [q, kv] if m.qk_norm == "full" else [])
    post = [norm] * 2 if m.post_norms else []
    block = [norm, *attn, *qk, *post, norm, *mlp]
    emb = [m.vocab_size * h] + ([m.max_seq_len * h] if m.position_embedding == "learned" else [])
    head = [norm] + ([] if m.tied_embeddings else [m.vocab_size * h])
    return tuple(emb), tuple(block), tuple(head)


def unit_tensor_counts(model) -> tuple[int, int, int]:
    """Parameter tensors of (the embedding, a block, the head): weights, biases and norm
    weights (and biases) apart, as an engine that reduces tensor by tensor sees them."""
    m = model
    norm = 2 if m.norm_type == "layernorm" else 1
    qkv = 1 if m.fused_qkv else 3
    biases = (qkv if m.attention_bias in ("qkv", "all") else 0) + (
        1 if m.attention_bias == "all" else 0) + (m.ffn_matrices if m.mlp_bias else 0)
    qk = 2 if m.qk_norm in ("head", "full") else 0
    block = qkv + 1 + m.ffn_matrices + biases + norm * (4 if m.post_norms else 2) + qk
    emb = 1 + (1 if m.position_embedding == "learned" else 0)
    head = norm + (0 if m.tied_embeddings else 1)
    return emb, block, head
