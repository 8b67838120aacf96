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

Attention sinks, sliding-window layers and multi-head latent attention: specs/attention.py;
routed and shared experts, the router and multi-token-prediction modules: specs/moe.py; the
Hugging Face families and what each maps to: docs/models.md.

With tensor parallelism of degree t (Megatron-style: QKV and the MLP's gate/up column-parallel,
the output projection and the MLP's down row-parallel, the embedding and LM head vocab-parallel),
each TP rank holds 1/t of every matrix and of the column-parallel biases, and the whole of the
norms, q/k norms, learned positions and row-parallel biases (``tp_unit_params``).

Checks (tests/test_specs.py): LLaMA-7B 6.74e9, LLaMA-2-70B 68.98e9, LLaMA-3-405B 405.9e9.
"""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

from amsp_planner.specs.attention import AttentionCounts, check_attention
from amsp_planner.specs.fields import Flag, Int, Maybe, Real, Text
from amsp_planner.specs.moe import ROUTING, MoeCounts, check_moe


class ModelSpec(AttentionCounts, MoeCounts, BaseModel):
    """A decoder-only transformer: dense (LLaMA, Mistral, Qwen, Phi-3, Gemma, OLMo 2, Granite,
    GPT-3 families) or a mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, gpt-oss,
    DeepSeek-V2/V3; docs/models.md)."""

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
    fused_qkv: Flag = False
    """Queries, keys and values are one linear module, (d_q + 2 d_kv) x h with its bias, as the
    model's implementation builds it (Megatron-LM's ParallelAttention ``query_key_value``,
    BLOOM's ``query_key_value``); false: three modules (Hugging Face Llama-style q_proj,
    k_proj, v_proj). The parameters are the same; an engine that gathers or reduces module by
    module, tensor by tensor (DeepSpeed ZeRO-3) sees one tensor (cost/schedule.py)."""

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
    router_bias: Flag = False
    """The router has a bias per expert (gpt-oss)."""
    shared_expert_gate: Flag = False
    """The shared expert's output is scaled by a sigmoid gate, a h x 1 linear map (Qwen2-MoE)."""
    routing: Literal[ROUTING] = "softmax_topk"
    """How the router picks experts (specs/moe.py): softmax_topk (Mixtral, Qwen, OLMoE),
    topk_softmax (Granite-MoE, gpt-oss), softmax_group_topk (DeepSeek-V2),
    sigmoid_group_topk (DeepSeek-V3)."""
    mtp_layers: Int(0, 16) = 0
    """The last mtp_layers blocks are multi-token-prediction modules (DeepSeek-V3's
    num_nextn_predict_layers; specs/moe.py)."""

    # ----- attention beyond grouped-query (specs/attention.py) ------------------------------
    attention_sinks: Flag = False
    """One learned sink logit per query head (gpt-oss)."""
    sliding_window: Maybe(Int(1, 1048576)) = None
    """Keys a query of a sliding-window layer sees at most (gpt-oss: 128)."""
    sliding_layers: tuple[Int(0, 1023), ...] = ()
    """0-based indices of the sliding-window layers (gpt-oss: the even ones)."""
    q_lora_rank: Maybe(Int(1, 65536)) = None
    """Multi-head latent attention: the queries' low-rank width (null: a full projection)."""
    kv_lora_rank: Maybe(Int(1, 65536)) = None
    """Multi-head latent attention (DeepSeek-V2/V3) when set: the keys' and values' latent
    width."""
    qk_nope_head_dim: Maybe(Int(1, 65536)) = None
    """MLA: per-head query/key width without RoPE (head_dim = this + qk_rope_head_dim)."""
    qk_rope_head_dim: Maybe(Int(1, 65536)) = None
    """MLA: per-head query/key width with RoPE (the key's part shared by every head)."""
    v_head_dim: Maybe(Int(1, 65536)) = None
    """MLA: width of one value head."""

    # Fields a preset leaves at their default stay out of its dump, so the plan files and hashes
    # of models that do not use them are what they were before the fields existed.
    _OMIT_DEFAULT = {"head_dim": None, "qk_norm": "none", "post_norms": False,
                     "fused_qkv": False, "num_experts": 0, "experts_per_token": 0,
                     "expert_ffn_hidden_size": None,
                     "shared_expert_ffn_hidden_size": 0, "dense_layers": (),
                     "router_bias": False, "shared_expert_gate": False,
                     "routing": "softmax_topk", "mtp_layers": 0, "attention_sinks": False,
                     "sliding_window": None, "sliding_layers": (), "q_lora_rank": None,
                     "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
                     "v_head_dim": None}

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
        if self.kv_lora_rank is not None and None not in (self.qk_nope_head_dim,
                                                          self.qk_rope_head_dim):
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim not in (None, qk):
                raise ValueError(f"head_dim {self.head_dim} != qk_nope_head_dim + "
                                 f"qk_rope_head_dim = {qk} (multi-head latent attention): "
                                 "drop head_dim")
            object.__setattr__(self, "head_dim", qk)
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
        check_attention(self)
        check_moe(self)
        return self

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

    def mlp_matrices(self, f: int) -> list[tuple[int, int]]:
        """(K, N) of each matrix of one MLP of inner width f: gate, up, down (GELU: fc1, fc2)."""
        h = self.hidden_size
        return [(h, f)] * (self.ffn_matrices - 1) + [(f, h)]

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
        """Attention (specs/attention.py: projections, biases, sinks) and the block's norms."""
        norms = (4 if self.post_norms else 2) * self._norm_params() + self._qk_norm_params()
        return self._attn_params() + norms

    def block_params(self) -> int:
        """Parameters of a dense block (every block of a dense model; a MoE model's dense
        layers)."""
        return self._attn_norm_params() + self._mlp_params(self.ffn_hidden_size)

    def head_params(self) -> int:
        lm = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self._norm_params() + lm

    def unit_params(self) -> list[int]:
        """Unpadded parameters of each unit: embedding, each block, final norm + LM head
        (computed once per model: ``_unit_params``)."""
        return list(_unit_params(self))

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
        if tp > 1 and not self._tp_modelled:
            raise ValueError("tensor parallelism of a mixture-of-experts model, of multi-head "
                             "latent attention or of MTP modules is not modelled")
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

    @property
    def _tp_modelled(self) -> bool:
        """Expert TP, MLA's TP and the MTP modules' are not modelled yet (docs/models.md)."""
        return not (self.is_moe or self.is_mla or self.mtp_layers)

    def tp_degrees(self, gpus_per_node: int) -> list[int]:
        """Tensor-parallel degrees the model admits on nodes of R GPUs: divisors of R that
        divide the query and the key/value heads (each TP rank holds whole heads) and the MLP
        width (column-sharded gate/up, row-sharded down: equal slices)."""
        if not self._tp_modelled:
            return [1]
        return [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0
                and self.num_heads % t == 0 and self.kv_heads % t == 0
                and self.ffn_hidden_size % t == 0]

    @property
    def num_params(self) -> int:
        """Total parameters (unpadded), every expert counted."""
        return sum(self.unit_params())

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

        N counts matmul parameters (``num_flop_params``: a MoE layer's active experts only),
        plus the output head once more per multi-token-prediction module (it shares the
        main model's head). The second term is attention (QK^T and AV, forward and backward)
        over the query width d_q = heads * head_dim, which is h unless head_dim is given apart;
        every layer counts full attention over the s keys as PaLM does, but a sliding-window
        layer at most its window and MLA its real head widths (specs/attention.py). Model
        FLOPs: recomputation is not counted here.
        """
        return _flops_per_token(self, seq_len)


# A ModelSpec is frozen (hashable, equal by value), so its derived counts are computed once per
# model: a search prices thousands of strategies of one job (solver/pipeline_search.py).
@functools.lru_cache(maxsize=256)
def _unit_params(m: ModelSpec) -> tuple[int, ...]:
    return (m.embedding_params(), *(m.layer_params(i) for i in range(m.num_layers)),
            m.head_params())


@functools.lru_cache(maxsize=256)
def _flops_per_token(m: ModelSpec, seq_len: int) -> float:
    mtp_head = m.mtp_layers * m.vocab_size * m.hidden_size
    return 6.0 * (m.num_flop_params + mtp_head) + m.attention_flops_per_token(seq_len)
