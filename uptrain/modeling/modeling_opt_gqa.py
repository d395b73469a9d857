"""OPT with grouped-query attention (`model_type` "opt_gqa"), built on transformers' OPT.

Stored form: separate `q_proj`, `k_proj`, `v_proj`, `out_proj` as in OPT, with `k_proj` and
`v_proj` (weights and biases) of G·d rows. Everything else is transformers' OPT unchanged.
Copied beside converted weights under this name: imports only torch, transformers and
the attention file next to it.
"""

from __future__ import annotations

from torch import nn
from transformers import OPTConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.opt.modeling_opt import OPTAttention, OPTForCausalLM, OPTModel

from .attention import (
    GroupedHeadsConfig,
    causal_lm_gqa,
    eager_attention_forward,
    kv_heads_of_layer,
    pop_cache,
    update_cache,
)


class OPTGQAConfig(GroupedHeadsConfig, OPTConfig):
    model_type = "opt_gqa"

    num_key_value_heads: int | None = None


class OPTGQAAttention(OPTAttention):
    """OPT attention over its layer's K/V heads (`kv_heads_of_layer`); the cache holds them."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx)
        self.num_key_value_groups = config.num_attention_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.k_proj = nn.Linear(self.embed_dim, kv_dim, bias=self.enable_bias)
        self.v_proj = nn.Linear(self.embed_dim, kv_dim, bias=self.enable_bias)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        bsz, tgt_len, _ = hidden_states.size()
        # OPT scales the queries before the product (and attends with scale 1): kept, so that
        # G = h reproduces its logits bit for bit.
        q = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        k, v = update_cache(cache, k, v, self.layer_idx, kwargs)
        dropout = self.dropout if self.training else 0.0
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(self, q, k, v, attention_mask, scaling=1.0, dropout=dropout, **kwargs)
        out = out.reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(out), weights


def _use_gqa_attention(model: OPTModel, config: OPTGQAConfig) -> None:
    for i, layer in enumerate(model.decoder.layers):
        layer.self_attn = OPTGQAAttention(config, layer_idx=i)


OPTGQAModel, OPTGQAForCausalLM = causal_lm_gqa(__name__, OPTGQAConfig, OPTModel, OPTForCausalLM, _use_gqa_attention)
