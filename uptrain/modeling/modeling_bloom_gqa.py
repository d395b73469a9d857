"""BLOOM with grouped-query attention (`model_type` "bloom_gqa"), built on transformers' BLOOM.

Stored form: `query_key_value` stays one Linear whose output rows are grouped per KV head,
`[G, r + 2, d]` with r = h / G: the group's r query heads, then its K head, then its V head.
At G = h that is BLOOM's own per-head `[h, 3, d]` interleaving. ALiBi slopes belong to the
query heads and are unchanged. Everything else is transformers' BLOOM unchanged. Copied beside
converted weights under this name: imports only torch, transformers and the
attention file next to it.
"""

from __future__ import annotations

from torch import nn
from transformers import BloomConfig
from transformers.models.bloom.modeling_bloom import BloomAttention, BloomForCausalLM, BloomModel, dropout_add

from .attention import grouped_query_attention


class BloomGQAConfig(BloomConfig):
    model_type = "bloom_gqa"

    num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_head
        super().__post_init__(**kwargs)
        if self.n_head % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} does not divide n_head {self.n_head}")
        if self.pretraining_tp > 1 and self.slow_but_exact:
            raise ValueError("bloom_gqa does not implement slow_but_exact tensor-parallel output projection")


class BloomGQAAttention(BloomAttention):
    """BLOOM attention over `num_key_value_heads` K/V heads; the cache holds G heads."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = config.num_key_value_heads
        self.queries_per_group = self.num_heads // self.num_key_value_heads
        rows = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.query_key_value = nn.Linear(self.hidden_size, rows, bias=True)

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        b, t, _ = hidden_states.shape
        r, d = self.queries_per_group, self.head_dim
        qkv = self.query_key_value(hidden_states).view(b, t, self.num_key_value_heads, r + 2, d)
        q = qkv[..., :r, :].reshape(b, t, -1, d).transpose(1, 2)
        k, v = qkv[..., r, :].transpose(1, 2), qkv[..., r + 1, :].transpose(1, 2)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        # transformers builds ALiBi as [B·h, 1, S]: one slope per query head.
        out, weights = grouped_query_attention(
            q, k, v, attention_mask=attention_mask, scale=self.inv_norm_factor,
            alibi=alibi.view(b, self.num_heads, 1, -1), dropout=self.attention_dropout.p if self.training else 0.0,
            eager=True)  # transformers' BLOOM is eager-only: its masks are additive
        out = self.dense(out.transpose(1, 2).reshape(b, t, -1))
        return dropout_add(out, residual, self.hidden_dropout, self.training), weights


def _use_gqa_attention(model: BloomModel, config: BloomGQAConfig) -> None:
    for i, block in enumerate(model.h):
        block.self_attention = BloomGQAAttention(config, layer_idx=i)


class BloomGQAModel(BloomModel):
    config_class = BloomGQAConfig

    def __init__(self, config: BloomGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self, config)
        self.post_init()


class BloomGQAForCausalLM(BloomForCausalLM):
    config_class = BloomGQAConfig

    def __init__(self, config: BloomGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self.transformer, config)
        self.post_init()
