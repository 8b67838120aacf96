"""Mixture of experts in a ModelSpec: which layers route, and the parameters of each class.

A MoE layer (every layer not in ``dense_layers``) replaces the dense MLP with

- a router: h x E scores (+ E biases with ``router_bias``, gpt-oss);
- E routed experts, each an MLP of width ``expert_ffn_hidden_size`` with the model's ffn_type
  (and its biases with ``mlp_bias``: 2f + h for a gated MLP, gpt-oss), of which each token
  uses ``experts_per_token``;
- optionally a shared-expert MLP of width ``shared_expert_ffn_hidden_size`` that every token
  goes through (DeepSeek's n_shared_experts x moe_intermediate_size, Qwen2-MoE's
  shared_expert_intermediate_size), and with ``shared_expert_gate`` its sigmoid gate, a
  h x 1 linear map (Qwen2-MoE's ``shared_expert_gate``).

Routed experts are one parameter class (sharded over the expert-parallel group); everything
else, router and shared experts included, is dense.

``routing`` names how the router picks the experts (it moves no parameter count, but the
runtime and the exports need it):

- ``softmax_topk``: softmax over the E scores, then the top k (Mixtral, Qwen2/3-MoE, OLMoE,
  DeepSeek-V2 ``topk_method: greedy``);
- ``topk_softmax``: the top k scores, then a softmax over those k (Granite-MoE, gpt-oss);
- ``softmax_group_topk``: softmax, then the top k within the best ``topk_group`` expert groups
  (DeepSeek-V2 ``group_limited_greedy``);
- ``sigmoid_group_topk``: sigmoid scores with a bias that balances the load (not trained by
  gradient: a buffer, not a parameter), top k within the best groups (DeepSeek-V3
  ``noaux_tc``).

Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2; ``mtp_layers``): the last
``mtp_layers`` of the ``num_layers`` blocks are MTP modules, as the checkpoint numbers them
(DeepSeek-V3's layer 61). Each is a block plus a projection 2h -> h (``eh_proj``) and three
RMSNorms (``enorm``, ``hnorm`` and its head's norm); it shares the embedding and the output
head with the main model, so these are not counted again, but it runs the head once more per
token (``flops_per_token``).
"""

from __future__ import annotations

import functools

ROUTING = ("softmax_topk", "topk_softmax", "softmax_group_topk", "sigmoid_group_topk")
"""Routing schemes modelled (module docstring)."""


class MoeCounts:
    """ModelSpec's mixture-of-experts methods (the fields are declared on ModelSpec)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) routes its tokens to experts."""
        return self.is_moe and i not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return _num_moe_layers(self)

    def is_mtp_layer(self, i: int) -> bool:
        """Layer i (0-based) is a multi-token-prediction module (the last ``mtp_layers``)."""
        return i >= self.num_layers - self.mtp_layers

    def mtp_extra_params(self) -> int:
        """What an MTP module holds beyond its block: eh_proj (2h x h) and three norms."""
        return 2 * self.hidden_size * self.hidden_size + 3 * self._norm_params()

    def expert_params(self) -> int:
        """One routed expert's MLP (with its biases when mlp_bias)."""
        return self._mlp_params(self.expert_ffn_hidden_size or self.ffn_hidden_size)

    def router_params(self) -> int:
        """The router of one MoE layer: a linear map from h to E scores (+ E biases)."""
        return (self.hidden_size + (1 if self.router_bias else 0)) * self.num_experts

    def shared_expert_params(self) -> int:
        """The shared-expert MLP of one MoE layer and its gate (0 when none)."""
        f = self.shared_expert_ffn_hidden_size
        if not f:
            return 0
        return self._mlp_params(f) + (self.hidden_size if self.shared_expert_gate else 0)

    def layer_dense_params(self, i: int) -> int:
        """The dense parameters of layer i: attention and norms, plus the dense MLP (a dense
        layer) or the router and the shared experts (a MoE layer), plus an MTP module's own."""
        mtp = self.mtp_extra_params() if self.is_mtp_layer(i) else 0
        if not self.is_moe_layer(i):
            return self.block_params() + mtp
        return self._attn_norm_params() + self.router_params() + self.shared_expert_params() + mtp

    def layer_expert_params(self, i: int) -> int:
        """The routed experts' parameters of layer i (all E of them; 0 for a dense layer)."""
        return self.num_experts * self.expert_params() if self.is_moe_layer(i) else 0

    def layer_params(self, i: int) -> int:
        return self.layer_dense_params(i) + self.layer_expert_params(i)

    def unit_expert_params(self) -> list[int]:
        """Routed-expert parameters of each unit (0 for the embedding, the head and dense
        layers); ``unit_params`` minus these is the dense class."""
        return [0] + [self.layer_expert_params(i) for i in range(self.num_layers)] + [0]

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: every dense parameter and experts_per_token routed
        experts per MoE layer (= num_params for a dense model). The embedding is counted
        (some model cards leave it out: see tests/test_moe_models.py)."""
        inactive = (self.num_experts - self.experts_per_token) * self.expert_params()
        return self.num_params - self.num_moe_layers * inactive


def check_moe(m) -> None:
    """ValueError naming the field and its fix when the MoE fields do not fit together."""
    e, k = m.num_experts, m.experts_per_token
    if m.mtp_layers >= m.num_layers:
        raise ValueError(f"mtp_layers {m.mtp_layers} must be below num_layers = {m.num_layers} "
                         "(the MTP modules are the last blocks): fix the count")
    if e == 0:
        moe_only = {"experts_per_token": k, "expert_ffn_hidden_size": m.expert_ffn_hidden_size,
                    "shared_expert_ffn_hidden_size": m.shared_expert_ffn_hidden_size,
                    "dense_layers": m.dense_layers, "router_bias": m.router_bias,
                    "shared_expert_gate": m.shared_expert_gate, "routing": m.routing}
        for key, value in moe_only.items():
            if value != m._OMIT_DEFAULT[key]:
                raise ValueError(f"{key} is set but num_experts is 0 (a dense model): "
                                 "give num_experts, or drop it")
        return
    if not 1 <= k <= e:
        raise ValueError(f"experts_per_token {k} must be in [1, num_experts = {e}]: "
                         "set it to the router's top-k")
    bad = [i for i in m.dense_layers if i >= m.num_layers]
    if bad or len(set(m.dense_layers)) != len(m.dense_layers):
        raise ValueError(f"dense_layers {list(m.dense_layers)} must be distinct layer "
                         f"indices below num_layers = {m.num_layers}: fix the list")
    if len(m.dense_layers) == m.num_layers:
        raise ValueError("dense_layers lists every layer: a MoE model needs at least one MoE "
                         "layer; drop num_experts for a dense model")
    if m.shared_expert_gate and not m.shared_expert_ffn_hidden_size:
        raise ValueError("shared_expert_gate is set but shared_expert_ffn_hidden_size is 0: "
                         "give the shared expert's width, or drop the gate")


@functools.lru_cache(maxsize=256)
def _num_moe_layers(m) -> int:
    """MoE layers of a (frozen, hashable) model, counted once per model."""
    return sum(m.is_moe_layer(i) for i in range(m.num_layers))
