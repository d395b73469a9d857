"""OPT with grouped-query attention (`model_type` "opt_gqa"), built on transformers' OPT.

Stored form: separate `q_proj`, `k_proj`, `v_proj`, `out_proj` as in OPT, with `k_proj` and
`v_proj` (weights and biases) of G·d rows. Everything else is transformers' OPT unchanged.
Copied beside converted weights under this name: imports only torch, transformers and
the attention file next to it.
"""

from __future__ import annotations

from torch import nn
from transformers import OPTConfig
from transformers.models.opt.modeling_opt import OPTAttention, OPTForCausalLM, OPTModel

from .attention import GroupedAttentionOnly, grouped_query_attention


class OPTGQAConfig(OPTConfig):
    model_type = "opt_gqa"

    num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} does not divide "
                             f"num_attention_heads {self.num_attention_heads}")


class OPTGQAAttention(OPTAttention):
    """OPT attention over `num_key_value_heads` K/V heads; the cache holds G heads."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        kv_dim = config.num_key_value_heads * self.head_dim
        self.k_proj = nn.Linear(self.embed_dim, kv_dim, bias=self.enable_bias)
        self.v_proj = nn.Linear(self.embed_dim, kv_dim, bias=self.enable_bias)

    def forward(self, hidden_states, cache=None, attention_mask=None, output_attentions=False, **kwargs):
        bsz, tgt_len, _ = hidden_states.size()
        # OPT scales the queries before the product (and attends with scale 1): kept, so that
        # G = h reproduces its logits bit for bit.
        q = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = grouped_query_attention(
            q, k, v, attention_mask=attention_mask, scale=1.0, dropout=self.dropout if self.training else 0.0,
            eager=self.config._attn_implementation == "eager")
        out = out.transpose(1, 2).reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(out), weights


def _use_gqa_attention(model: OPTModel, config: OPTGQAConfig) -> None:
    for i, layer in enumerate(model.decoder.layers):
        layer.self_attn = OPTGQAAttention(config, layer_idx=i)


class OPTGQAModel(GroupedAttentionOnly, OPTModel):
    config_class = OPTGQAConfig

    def __init__(self, config: OPTGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self, config)
        self.post_init()


class OPTGQAForCausalLM(GroupedAttentionOnly, OPTForCausalLM):
    config_class = OPTGQAConfig

    def __init__(self, config: OPTGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self.model, config)
        self.post_init()
