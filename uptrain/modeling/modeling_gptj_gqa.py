"""GPT-J with grouped-query attention (`model_type` "gptj_gqa"), built on transformers' GPT-J.

Stored form: separate `q_proj`, `k_proj`, `v_proj`, `out_proj` (no biases) as in GPT-J, with
`k_proj` and `v_proj` of G·d rows. Rotary embedding acts inside each head (adjacent pairs of
the first `rotary_dim` dims), so pooling whole heads needs no un-permuting. Everything else
is transformers' GPT-J unchanged. Copied beside converted weights under this name:
imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPTJConfig
from transformers.models.gptj.modeling_gptj import GPTJAttention, GPTJForCausalLM, GPTJModel, apply_rotary_pos_emb

from .attention import GroupedAttentionOnly, grouped_query_attention


class GPTJGQAConfig(GPTJConfig):
    model_type = "gptj_gqa"

    num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_head
        super().__post_init__(**kwargs)
        if self.n_head % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} does not divide n_head {self.n_head}")


def _rotate(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, rotary_dim: int | None) -> torch.Tensor:
    """GPT-J's rotary embedding on `[B, T, heads, d]`, on the first `rotary_dim` dims (all when None)."""
    if rotary_dim is None:
        return apply_rotary_pos_emb(x, sin, cos)
    return torch.cat([apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos), x[..., rotary_dim:]], dim=-1)


class GPTJGQAAttention(GPTJAttention):
    """GPT-J attention over `num_key_value_heads` K/V heads; the cache holds G heads."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        kv_dim = config.num_key_value_heads * self.head_dim
        self.k_proj = nn.Linear(self.embed_dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, kv_dim, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        heads = (*input_shape, -1, self.head_dim)
        sin, cos = position_embeddings
        q = _rotate(self.q_proj(hidden_states).view(heads), sin, cos, self.rotary_dim).transpose(1, 2)
        k = _rotate(self.k_proj(hidden_states).view(heads), sin, cos, self.rotary_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = grouped_query_attention(
            q, k, v, attention_mask=attention_mask, scale=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            eager=self.config._attn_implementation == "eager")
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.resid_dropout(self.out_proj(out)), weights


def _use_gqa_attention(model: GPTJModel, config: GPTJGQAConfig) -> None:
    for i, block in enumerate(model.h):
        block.attn = GPTJGQAAttention(config, i)


class GPTJGQAModel(GroupedAttentionOnly, GPTJModel):
    config_class = GPTJGQAConfig

    def __init__(self, config: GPTJGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self, config)
        self.post_init()


class GPTJGQAForCausalLM(GroupedAttentionOnly, GPTJForCausalLM):
    config_class = GPTJGQAConfig

    def __init__(self, config: GPTJGQAConfig):
        super().__init__(config)
        _use_gqa_attention(self.transformer, config)
        self.post_init()
