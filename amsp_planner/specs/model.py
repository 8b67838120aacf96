"""ModelSpec: a dense decoder-only transformer, and the parameter count derived from it.

Parameter count, per unit (the units are what the runtime shards; see DESIGN.md 3a):

- embedding:  V*h token embedding (+ S*h learned positions for GPT-style models)
- each block: attention  h*(h + 2*d_kv) [QKV] + h*h [out],  d_kv = kv_heads * head_dim
              MLP        3*h*f [SwiGLU: gate, up, down]  or  2*h*f [GELU: fc1, fc2]
              norms      2*h [RMSNorm] or 4*h [LayerNorm, with bias]
              biases     h + 2*d_kv [qkv], + h [out] when attention_bias='all'; f + h for the MLP
- head:       final norm (h or 2h) + V*h LM head unless tied to the embedding

Checks (tests/test_specs.py): LLaMA-7B 6.74e9, LLaMA-2-70B 68.98e9, LLaMA-3-405B 405.9e9.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelSpec(BaseModel):
    """A dense decoder-only transformer (LLaMA, Mistral, Qwen2, GPT-3 families)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=200)
    """Short name, e.g. 'llama-7b'."""
    num_layers: int = Field(ge=1, le=1024)
    """Transformer blocks."""
    hidden_size: int = Field(ge=8, le=131072)
    """Model width h."""
    num_heads: int = Field(ge=1, le=4096)
    """Query heads a."""
    num_kv_heads: int | None = Field(default=None, ge=1, le=4096)
    """Key/value heads (GQA); defaults to num_heads (MHA)."""
    ffn_hidden_size: int = Field(ge=1, le=1048576)
    """MLP inner width f."""
    ffn_type: Literal["swiglu", "gelu"] = "swiglu"
    """SwiGLU (three matrices) or GELU (two)."""
    vocab_size: int = Field(ge=2, le=4194304)
    """Vocabulary size V."""
    tied_embeddings: bool = False
    """LM head shares the token embedding."""
    max_seq_len: int = Field(default=4096, ge=1, le=1048576)
    """Longest sequence the model supports (tokens)."""
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """RMSNorm (weight) or LayerNorm (weight and bias)."""
    position_embedding: Literal["rope", "learned"] = "rope"
    """RoPE (no parameters) or learned absolute positions (max_seq_len*h parameters)."""
    attention_bias: Literal["none", "qkv", "all"] = "none"
    """Bias on the QKV projection (Qwen2) or on QKV and output (GPT)."""
    mlp_bias: bool = False
    """Bias on the MLP projections (GPT)."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base, used by the runtime."""

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}: "
                "pick num_heads that divides hidden_size"
            )
        kv = self.kv_heads
        if kv > self.num_heads or self.num_heads % kv:
            raise ValueError(
                f"num_kv_heads {kv} must divide num_heads {self.num_heads} (GQA groups): "
                "use a divisor of num_heads"
            )
        return self

    # ----- derived shapes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # ----- parameter counts per unit ---------------------------------------------------------
    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm_type == "layernorm" else 1)

    def embedding_params(self) -> int:
        h = self.hidden_size
        pos = self.max_seq_len * h if self.position_embedding == "learned" else 0
        return self.vocab_size * h + pos

    def block_params(self) -> int:
        h, f, kv = self.hidden_size, self.ffn_hidden_size, self.kv_dim
        attn = h * (h + 2 * kv) + h * h
        if self.attention_bias in ("qkv", "all"):
            attn += h + 2 * kv
        if self.attention_bias == "all":
            attn += h
        mlp = (3 if self.ffn_type == "swiglu" else 2) * h * f
        if self.mlp_bias:
            mlp += (2 * f if self.ffn_type == "swiglu" else f) + h
        return attn + mlp + 2 * self._norm_params()

    def head_params(self) -> int:
        lm = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self._norm_params() + lm

    def unit_params(self) -> list[int]:
        """Unpadded parameters of each unit: embedding, each block, final norm + LM head."""
        return [self.embedding_params()] + [self.block_params()] * self.num_layers + [
            self.head_params()
        ]

    @property
    def num_params(self) -> int:
        """Total parameters (unpadded)."""
        return self.embedding_params() + self.num_layers * self.block_params() + self.head_params()

    @property
    def num_flop_params(self) -> int:
        """Parameters that take part in matmuls: all but the input embedding lookup.

        With tied embeddings the shared matrix is counted once, as the LM head.
        """
        pos = self.max_seq_len * self.hidden_size if self.position_embedding == "learned" else 0
        emb_lookup = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.num_params - emb_lookup - pos

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6*N + 12*L*h*s (PaLM, arXiv 2204.02311, appendix B).

        N counts matmul parameters (``num_flop_params``); the second term is attention
        (QK^T and AV, forward and backward). Model FLOPs: recomputation is not counted here.
        """
        return 6.0 * self.num_flop_params + 12.0 * self.num_layers * self.hidden_size * seq_len
