"""GPT-2 with grouped-query attention (`model_type` "gpt2_gqa"), built on transformers' GPT-2.

Stored form: `c_attn` stays one Conv1D (weight `[in, out]`) whose output columns are
`[Q (h·d) | K (G·d) | V (G·d)]`; at G = h that is GPT-2's own layout. Everything else is
transformers' GPT-2 unchanged. Copied beside converted weights under this name:
imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2LMHeadModel, GPT2Model
from transformers.pytorch_utils import Conv1D

from .attention import GroupedAttentionOnly, grouped_query_attention


class GPT2GQAConfig(GPT2Config):
    model_type = "gpt2_gqa"

    num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_head
        super().__post_init__(**kwargs)
        if self.n_head % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} does not divide n_head {self.n_head}")
        if self.add_cross_attention:
            raise ValueError("gpt2_gqa has no cross-attention")


class GPT2GQAAttention(GPT2Attention):
    """GPT-2 self-attention over `num_key_value_heads` K/V heads; the cache holds G heads."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = config.num_key_value_heads
        self.kv_dim = self.num_key_value_heads * self.head_dim
        self.c_attn = Conv1D(self.embed_dim + 2 * self.kv_dim, self.embed_dim)

    def forward(self, hidden_states, cache=None, attention_mask=None, output_attentions=False, **kwargs):
        q, k, v = self.c_attn(hidden_states).split([self.embed_dim, self.kv_dim, self.kv_dim], dim=2)
        heads = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (x.view(heads).transpose(1, 2) for x in (q, k, v))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = grouped_query_attention(
            q, k, v, attention_mask=attention_mask, scale=self.scaling,
            dropout=self.attn_dropout.p if self.training else 0.0,
            eager=self.config._attn_implementation == "eager")
        out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.resid_dropout(self.c_proj(out)), weights


def _use_gqa_attention(model: GPT2Model, config: GPT2GQAConfig) -> None:
    for i, block in enumerate(model.h):
        block.attn = GPT2GQAAttention(config, layer_idx=i)


class GPT2GQAModel(GroupedAttentionOnly, GPT2Model):
    config_class = GPT2GQAConfig

    def __init__(self, config: GPT2GQAConfig):
        super().__init__(config)
        _use_gqa_attention(self, config)
        self.post_init()


class GPT2GQAForCausalLM(GroupedAttentionOnly, GPT2LMHeadModel):
    config_class = GPT2GQAConfig

    def __init__(self, config: GPT2GQAConfig):
        super().__init__(config)
        _use_gqa_attention(self.transformer, config)
        self.post_init()
