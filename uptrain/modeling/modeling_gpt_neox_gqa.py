"""GPT-NeoX / Pythia with grouped-query attention (`model_type` "gpt_neox_gqa"), built on
transformers' GPT-NeoX.

Stored form: `query_key_value` stays one Linear whose output rows are grouped per KV head,
`[G, r + 2, d]` with r = h / G: the group's r query heads, then its K head, then its V head.
At G = h that is NeoX's own per-head `[h, 3, d]` interleaving. Everything else (partial
rotary, parallel residual) is transformers' GPT-NeoX unchanged. Copied beside converted
weights under this name: imports only torch, transformers and the attention
file next to it.
"""

from __future__ import annotations

from torch import nn
from transformers import GPTNeoXConfig
from transformers.models.gpt_neox.modeling_gpt_neox import (GPTNeoXAttention, GPTNeoXForCausalLM, GPTNeoXModel,
                                                            apply_rotary_pos_emb)

from .attention import GroupedAttentionOnly, grouped_query_attention


class GPTNeoXGQAConfig(GPTNeoXConfig):
    model_type = "gpt_neox_gqa"

    num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} does not divide "
                             f"num_attention_heads {self.num_attention_heads}")


class GPTNeoXGQAAttention(GPTNeoXAttention):
    """NeoX attention over `num_key_value_heads` K/V heads; the cache holds G heads."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = config.num_key_value_heads
        self.queries_per_group = config.num_attention_heads // config.num_key_value_heads
        rows = (config.num_attention_heads + 2 * self.num_key_value_heads) * self.head_size
        self.query_key_value = nn.Linear(config.hidden_size, rows, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask, layer_past=None, position_embeddings=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        r, d = self.queries_per_group, self.head_size
        qkv = self.query_key_value(hidden_states).view(*input_shape, self.num_key_value_heads, r + 2, d)
        q = qkv[..., :r, :].reshape(*input_shape, -1, d).transpose(1, 2)
        k, v = qkv[..., r, :].transpose(1, 2), qkv[..., r + 1, :].transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        out, weights = grouped_query_attention(
            q, k, v, attention_mask=attention_mask, scale=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            eager=self.config._attn_implementation == "eager")
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.dense(out), weights


def _use_gqa_attention(model: GPTNeoXModel, config: GPTNeoXGQAConfig) -> None:
    for i, layer in enumerate(model.layers):
        layer.attention = GPTNeoXGQAAttention(config, layer_idx=i)


class GPTNeoXGQAModel(GroupedAttentionOnly, GPTNeoXModel):
    config_class = GPTNeoXGQAConfig

    def __init__(self, config: GPTNeoXGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self, config)
        self.post_init()


class GPTNeoXGQAForCausalLM(GroupedAttentionOnly, GPTNeoXForCausalLM):
    config_class = GPTNeoXGQAConfig

    def __init__(self, config: GPTNeoXGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self.gpt_neox, config)
        self.post_init()
