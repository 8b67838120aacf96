"""Attention of a ModelSpec: its parameters and its FLOPs, for the three kinds counted.

- **grouped-query attention** (every dense family, Mixtral, Qwen-MoE, OLMoE, Granite-MoE,
  gpt-oss): Q = h x d_q, K and V = h x d_kv each, O = d_q x h (d_q = heads * head_dim,
  d_kv = kv_heads * head_dim); biases d_q + 2*d_kv on QKV (``attention_bias`` 'qkv') and h more
  on O ('all').
- **attention sinks** (gpt-oss, ``attention_sinks``): one learned logit per query head, added to
  the softmax's denominator (transformers ``GptOssAttention.sinks``): ``num_heads`` parameters.
- **multi-head latent attention** (DeepSeek-V2/V3, arXiv 2405.04434 section 2.1; ``kv_lora_rank``
  set): the queries go through a low-rank bottleneck of width r_q (``q_lora_rank``; none: a plain
  h x H*d_qk projection), keys and values through one of width r_kv plus a shared RoPE key of
  width d_rope:

      q_a h x r_q, its RMSNorm r_q, q_b r_q x H*d_qk       (d_qk = d_nope + d_rope = head_dim)
      kv_a h x (r_kv + d_rope), its RMSNorm r_kv, kv_b r_kv x H*(d_nope + d_v)
      o   H*d_v x h
      biases ('all'): r_q on q_a (with q_lora_rank), r_kv + d_rope on kv_a, h on o

  as transformers' ``DeepseekV3Attention`` builds them. Keys and values are decompressed per
  query head, so num_kv_heads = num_heads; ``head_dim`` is the query/key head width
  d_nope + d_rope and ``v_head_dim`` the value head width.

FLOPs of the attention itself (the score and value matmuls; the projections are in 6N), per
token and layer, forward and backward, as PaLM counts them (arXiv 2204.02311, appendix B:
12 * d_q * s, full non-causal attention over the s keys of the sequence):

      6 * s_eff * (H * d_qk + H * d_v)      (= 12 * d_q * s when d_qk = d_v = head_dim)

with s_eff = s on a full-attention layer and min(s, window) on a sliding-window layer
(``sliding_layers``, gpt-oss's alternate layers): a query there sees at most the window's keys.
"""

from __future__ import annotations


class AttentionCounts:
    """ModelSpec's attention methods (the fields are declared on ModelSpec)."""

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    @property
    def value_head_dim(self) -> int:
        """Width of one value head: ``v_head_dim`` under MLA, else ``head_dim``."""
        return self.v_head_dim if self.is_mla else self.head_dim

    def is_sliding_layer(self, i: int) -> bool:
        """Layer i (0-based) attends to at most ``sliding_window`` keys."""
        return i in self.sliding_layers

    def _attn_params(self) -> int:
        """The attention projections of one block, their biases and sinks (norms apart)."""
        h, heads = self.hidden_size, self.num_heads
        sinks = heads if self.attention_sinks else 0
        if self.is_mla:
            return self._mla_params() + sinks
        q, kv = self.q_dim, self.kv_dim
        attn = h * (q + 2 * kv) + q * h
        if self.attention_bias in ("qkv", "all"):
            attn += q + 2 * kv
        if self.attention_bias == "all":
            attn += h
        return attn + sinks

    def _mla_params(self) -> int:
        h, heads, rq, rkv = self.hidden_size, self.num_heads, self.q_lora_rank, self.kv_lora_rank
        nope, rope, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = (h * rq + rq + rq * heads * self.head_dim) if rq else h * heads * self.head_dim
        kv = h * (rkv + rope) + rkv + rkv * heads * (nope + v)
        o = heads * v * h
        bias = ((rq or 0) + rkv + rope + h) if self.attention_bias == "all" else 0
        return q + kv + o + bias

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Score and value matmuls of every layer, forward and backward (module docstring)."""
        per_key = 6.0 * self.num_heads * (self.head_dim + self.value_head_dim)
        window = self.sliding_window or seq_len
        return sum(per_key * (min(seq_len, window) if self.is_sliding_layer(i) else seq_len)
                   for i in range(self.num_layers))


def check_attention(m) -> None:
    """ValueError naming the field and its fix when the attention fields do not fit together."""
    if m.sliding_layers or m.sliding_window is not None:
        if not (m.sliding_layers and m.sliding_window is not None):
            raise ValueError("sliding_window and sliding_layers go together: give the window "
                             "(tokens) and the 0-based layers that use it, or neither")
        bad = [i for i in m.sliding_layers if i >= m.num_layers]
        if bad or len(set(m.sliding_layers)) != len(m.sliding_layers):
            raise ValueError(f"sliding_layers {list(m.sliding_layers)} must be distinct layer "
                             f"indices below num_layers = {m.num_layers}: fix the list")
    mla = {"q_lora_rank": m.q_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
           "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}
    if m.kv_lora_rank is None:
        given = [k for k, v in mla.items() if v is not None]
        if given:
            raise ValueError(f"{given[0]} is set but kv_lora_rank is not (multi-head latent "
                             "attention): give kv_lora_rank, or drop it")
        return
    if m.fused_qkv:
        raise ValueError("fused_qkv is set with kv_lora_rank: multi-head latent attention has "
                         "no QKV projection to fuse: drop fused_qkv")
    missing = [k for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
               if mla[k] is None]
    if missing:
        raise ValueError(f"{missing[0]} is missing: multi-head latent attention (kv_lora_rank) "
                         "needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
    if m.num_kv_heads not in (None, m.num_heads):
        raise ValueError(f"num_kv_heads {m.num_kv_heads} != num_heads {m.num_heads}: multi-head "
                         "latent attention decompresses keys and values per query head: drop "
                         "num_kv_heads")
    if m.qk_norm != "none" or m.attention_bias == "qkv":
        raise ValueError("multi-head latent attention has its own norms and biases: set "
                         "qk_norm: none and attention_bias: none or all")
