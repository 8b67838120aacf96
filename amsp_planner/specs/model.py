"""ModelSpec: a decoder-only transformer (dense, or a mixture of experts), and the parameter
count derived from it.

A mixture-of-experts model (``num_experts`` > 0) replaces the MLP of each MoE layer with a router
(h x E), E routed experts (each an MLP of width ``expert_ffn_hidden_size``) of which each token
uses ``experts_per_token``, and optionally a shared-expert MLP; the layers in ``dense_layers``
keep a dense MLP. The parameters split into two classes: the routed experts
(``unit_expert_params``) and everything else (dense).

Parameter count, per unit (the units are what the runtime shards; see docs/design.md):

- embedding:  V*h token embedding (+ S*h learned positions for GPT-style models)
- each block: attention  h*(d_q + 2*d_kv) [QKV] + d_q*h [out],  d_q = heads * head_dim,
                         d_kv = kv_heads * head_dim (head_dim = h/heads unless given)
              MLP        3*h*f [SwiGLU/GeGLU: gate, up, down]  or  2*h*f [GELU: fc1, fc2]
              norms      2*h [RMSNorm] or 4*h [LayerNorm, with bias]; 2*h more with post-norms
                         (Gemma 2/3); q/k norms: 2*head_dim per head (Qwen3, Gemma 3) or
                         d_q + d_kv over the whole projection (OLMo 2)
              biases     d_q + 2*d_kv [qkv], + h [out] when attention_bias='all'; f + h for the MLP
- head:       final norm (h or 2h) + V*h LM head unless tied to the embedding

With tensor parallelism of degree t (Megatron-style: QKV and the MLP's gate/up column-parallel,
the output projection and the MLP's down row-parallel, the embedding and LM head vocab-parallel),
each TP rank holds 1/t of every matrix and of the column-parallel biases, and the whole of the
norms, q/k norms, learned positions and row-parallel biases (``tp_unit_params``).

Checks (tests/test_specs.py): LLaMA-7B 6.74e9, LLaMA-2-70B 68.98e9, LLaMA-3-405B 405.9e9.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

from amsp_planner.specs.fields import Flag, Int, Maybe, Real, Text


class ModelSpec(BaseModel):
    """A dense decoder-only transformer (LLaMA, Mistral, Qwen, Phi-3, Gemma, OLMo 2, Granite,
    GPT-3 families)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Text(200)
    """Short name, e.g. 'llama-7b'."""
    num_layers: Int(1, 1024)
    """Transformer blocks."""
    hidden_size: Int(8, 131072)
    """Model width h."""
    num_heads: Int(1, 4096)
    """Query heads a."""
    num_kv_heads: Maybe(Int(1, 4096)) = None
    """Key/value heads (GQA); defaults to num_heads (MHA)."""
    ffn_hidden_size: Int(1, 1048576)
    """MLP inner width f."""
    ffn_type: Literal["swiglu", "geglu", "gelu"] = "swiglu"
    """SwiGLU or GeGLU (three matrices: gate, up, down) or GELU (two)."""
    vocab_size: Int(2, 4194304)
    """Vocabulary size V."""
    tied_embeddings: Flag = False
    """LM head shares the token embedding."""
    max_seq_len: Int(1, 1048576) = 4096
    """Longest sequence the model supports (tokens)."""
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """RMSNorm (weight) or LayerNorm (weight and bias)."""
    position_embedding: Literal["rope", "learned"] = "rope"
    """RoPE (no parameters) or learned absolute positions (max_seq_len*h parameters)."""
    attention_bias: Literal["none", "qkv", "all"] = "none"
    """Bias on the QKV projection (Qwen2) or on QKV and output (GPT)."""
    mlp_bias: Flag = False
    """Bias on the MLP projections (GPT)."""
    rope_theta: Real(1.0, 1e12) = 10000.0
    """RoPE base, used by the runtime (at least 1: the longest wavelength is 2*pi*theta)."""
    head_dim: Maybe(Int(1, 65536)) = None
    """Width of one attention head; defaults to hidden_size / num_heads (Gemma, Qwen3 and
    Mistral-Nemo set it apart)."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """RMSNorm on queries and keys: per head (Qwen3, Gemma 3) or over the whole projection
    (OLMo 2)."""
    post_norms: Flag = False
    """Two more norms per block, after attention and after the MLP (Gemma 2 and 3)."""

    # ----- mixture of experts (docs/moe.md); all at their defaults for a dense model ---------
    num_experts: Int(0, 65536) = 0
    """Routed experts E per MoE layer; 0 = a dense model."""
    experts_per_token: Int(0, 1024) = 0
    """Routed experts each token goes to (top-k); at least 1 and at most E when E > 0."""
    expert_ffn_hidden_size: Maybe(Int(1, 1048576)) = None
    """Inner width of one routed expert's MLP (``moe_intermediate_size``); defaults to
    ffn_hidden_size. The expert MLP has the model's ffn_type."""
    shared_expert_ffn_hidden_size: Int(0, 1048576) = 0
    """Inner width of the shared-expert MLP every token goes through in a MoE layer (all shared
    experts together, as one MLP: DeepSeek's n_shared_experts x moe_intermediate_size); 0 =
    none. A dense parameter."""
    dense_layers: tuple[Int(0, 1023), ...] = ()
    """0-based indices of the layers whose MLP is dense (width ffn_hidden_size) in a MoE model
    (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers and decoder_sparse_step); every
    other layer is a MoE layer."""

    # Fields a preset leaves at their default stay out of its dump, so the plan files and hashes
    # of models that do not use them are what they were before the fields existed.
    _OMIT_DEFAULT = {"head_dim": None, "qk_norm": "none", "post_norms": False,
                     "num_experts": 0, "experts_per_token": 0, "expert_ffn_hidden_size": None,
                     "shared_expert_ffn_hidden_size": 0, "dense_layers": ()}

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        for key, default in self._OMIT_DEFAULT.items():
            if key in out and (out[key] == default or (default == () and not out[key])
                               or (key == "head_dim" and out[key] == self._even_head_dim)):
                del out[key]
        return out

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelSpec:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}: "
                "pick num_heads that divides hidden_size, or give head_dim"
            )
        kv = self.kv_heads
        if kv > self.num_heads or self.num_heads % kv:
            raise ValueError(
                f"num_kv_heads {kv} must divide num_heads {self.num_heads} (GQA groups): "
                "use a divisor of num_heads"
            )
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self._even_head_dim)
        self._check_moe()
        return self

    def _check_moe(self) -> None:
        e, k = self.num_experts, self.experts_per_token
        if e == 0:
            moe_only = {"experts_per_token": k, "expert_ffn_hidden_size": self.expert_ffn_hidden_size,
                        "shared_expert_ffn_hidden_size": self.shared_expert_ffn_hidden_size,
                        "dense_layers": self.dense_layers}
            for key, value in moe_only.items():
                if value != self._OMIT_DEFAULT[key]:
                    raise ValueError(f"{key} is set but num_experts is 0 (a dense model): "
                                     "give num_experts, or drop it")
            return
        if not 1 <= k <= e:
            raise ValueError(f"experts_per_token {k} must be in [1, num_experts = {e}]: "
                             "set it to the router's top-k")
        bad = [i for i in self.dense_layers if i >= self.num_layers]
        if bad or len(set(self.dense_layers)) != len(self.dense_layers):
            raise ValueError(f"dense_layers {list(self.dense_layers)} must be distinct layer "
                             f"indices below num_layers = {self.num_layers}: fix the list")
        if len(self.dense_layers) == self.num_layers:
            raise ValueError("dense_layers lists every layer: a MoE model needs at least one MoE "
                             "layer; drop num_experts for a dense model")

    # ----- derived shapes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def _even_head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of all query heads (= hidden_size unless head_dim is given apart)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def ffn_matrices(self) -> int:
        """Matrices in the MLP: 3 gated (SwiGLU, GeGLU), 2 plain (GELU)."""
        return 2 if self.ffn_type == "gelu" else 3

    # ----- parameter counts per unit ---------------------------------------------------------
    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm_type == "layernorm" else 1)

    def embedding_params(self) -> int:
        h = self.hidden_size
        pos = self.max_seq_len * h if self.position_embedding == "learned" else 0
        return self.vocab_size * h + pos

    def _qk_norm_params(self) -> int:
        if self.qk_norm == "head":
            return 2 * self.head_dim
        return self.q_dim + self.kv_dim if self.qk_norm == "full" else 0

    def _mlp_params(self, f: int) -> int:
        """One MLP of inner width f (with its biases when mlp_bias)."""
        h = self.hidden_size
        mlp = self.ffn_matrices * h * f
        if self.mlp_bias:
            mlp += (self.ffn_matrices - 1) * f + h
        return mlp

    def _attn_norm_params(self) -> int:
        """Attention (QKV, output, their biases) and the block's norms."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * (q + 2 * kv) + q * h
        if self.attention_bias in ("qkv", "all"):
            attn += q + 2 * kv
        if self.attention_bias == "all":
            attn += h
        norms = (4 if self.post_norms else 2) * self._norm_params() + self._qk_norm_params()
        return attn + norms

    def block_params(self) -> int:
        """Parameters of a dense block (every block of a dense model; a MoE model's dense
        layers)."""
        return self._attn_norm_params() + self._mlp_params(self.ffn_hidden_size)

    # ----- mixture of experts ---------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) routes its tokens to experts."""
        return self.is_moe and i not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def expert_params(self) -> int:
        """One routed expert's MLP."""
        return self._mlp_params(self.expert_ffn_hidden_size or self.ffn_hidden_size)

    def router_params(self) -> int:
        """The router of one MoE layer: a linear map from h to E scores, no bias."""
        return self.hidden_size * self.num_experts

    def layer_dense_params(self, i: int) -> int:
        """The dense parameters of layer i: attention and norms, plus the dense MLP (a dense
        layer) or the router and the shared experts (a MoE layer)."""
        if not self.is_moe_layer(i):
            return self.block_params()
        shared = self.shared_expert_ffn_hidden_size
        return (self._attn_norm_params() + self.router_params()
                + (self._mlp_params(shared) if shared else 0))

    def layer_expert_params(self, i: int) -> int:
        """The routed experts' parameters of layer i (all E of them; 0 for a dense layer)."""
        return self.num_experts * self.expert_params() if self.is_moe_layer(i) else 0

    def layer_params(self, i: int) -> int:
        return self.layer_dense_params(i) + self.layer_expert_params(i)

    def unit_expert_params(self) -> list[int]:
        """Routed-expert parameters of each unit (0 for the embedding, the head and dense
        layers); ``unit_params`` minus these is the dense class."""
        return [0] + [self.layer_expert_params(i) for i in range(self.num_layers)] + [0]

    def head_params(self) -> int:
        lm = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self._norm_params() + lm

    def unit_params(self) -> list[int]:
        """Unpadded parameters of each unit: embedding, each block, final norm + LM head."""
        return [self.embedding_params()] + [self.layer_params(i) for i in range(self.num_layers)] + [
            self.head_params()
        ]

    def _replicated(self) -> tuple[int, int, int]:
        """Elements of (embedding, a block, the head) every TP rank holds whole: norms, q/k
        norms with head_dim weights, learned positions, row-parallel biases."""
        h = self.hidden_size
        pos = self.max_seq_len * h if self.position_embedding == "learned" else 0
        qk = 2 * self.head_dim if self.qk_norm == "head" else 0
        block = (4 if self.post_norms else 2) * self._norm_params() + qk
        block += h if self.attention_bias == "all" else 0
        block += h if self.mlp_bias else 0
        return pos, block, self._norm_params()

    def tp_unit_params(self, tp: int) -> list[int]:
        """Unpadded elements one TP rank holds of each unit (module docstring): the sharded
        part split in `tp` (rounded up), the replicated part whole; `tp` = 1 is
        ``unit_params``."""
        if tp > 1 and self.is_moe:
            raise ValueError("tensor parallelism of a mixture-of-experts model is not modelled")
        if tp == 1:
            return self.unit_params()
        rep = self._replicated()
        full = (self.embedding_params(), self.block_params(), self.head_params())
        emb, blk, head = (r + -(-(f - r) // tp) for f, r in zip(full, rep, strict=True))
        return [emb] + [blk] * self.num_layers + [head]

    def tp_replicated_params(self) -> list[int]:
        """Elements of each unit that every TP rank holds whole (their gradients are summed
        over the TP group)."""
        emb, blk, head = self._replicated()
        return [emb] + [blk] * self.num_layers + [head]

    def tp_degrees(self, gpus_per_node: int) -> list[int]:
        """Tensor-parallel degrees the model admits on nodes of R GPUs: divisors of R that
        divide the query and the key/value heads (each TP rank holds whole heads) and the MLP
        width (column-sharded gate/up, row-sharded down: equal slices)."""
        if self.is_moe:
            return [1]  # expert tensor parallelism is not modelled yet (docs/moe.md)
        return [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0
                and self.num_heads % t == 0 and self.kv_heads % t == 0
                and self.ffn_hidden_size % t == 0]

    @property
    def num_params(self) -> int:
        """Total parameters (unpadded), every expert counted."""
        return sum(self.unit_params())

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: every dense parameter and experts_per_token routed
        experts per MoE layer (= num_params for a dense model)."""
        inactive = (self.num_experts - self.experts_per_token) * self.expert_params()
        return self.num_params - self.num_moe_layers * inactive

    @property
    def num_flop_params(self) -> int:
        """Parameters that take part in a token's matmuls: the active ones but the input
        embedding lookup.

        With tied embeddings the shared matrix is counted once, as the LM head.
        """
        pos = self.max_seq_len * self.hidden_size if self.position_embedding == "learned" else 0
        emb_lookup = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.num_active_params - emb_lookup - pos

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6*N + 12*L*d_q*s (PaLM, arXiv 2204.02311, appendix B).

        N counts matmul parameters (``num_flop_params``); the second term is attention
        (QK^T and AV, forward and backward) over the query width d_q = heads * head_dim, which
        is h unless head_dim is given apart. Every layer counts full causal attention (as PaLM
        does; sliding-window layers do less). Model FLOPs: recomputation is not counted here.
        """
        return 6.0 * self.num_flop_params + 12.0 * self.num_layers * self.q_dim * seq_len
