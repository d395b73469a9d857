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
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gptj.modeling_gptj import GPTJAttention, GPTJForCausalLM, GPTJModel, apply_rotary_pos_emb

from .attention import (
    GroupedHeadsConfig,
    causal_lm_gqa,
    eager_attention_forward,
    kv_heads_of_layer,
    pop_cache,
    update_cache,
)


class GPTJGQAConfig(GroupedHeadsConfig, GPTJConfig):
    model_type = "gptj_gqa"

    num_key_value_heads: int | None = None


def _rotate(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, rotary_dim: int | None) -> torch.Tensor:
    """GPT-J's rotary embedding on `[B, T, heads, d]`, on the first `rotary_dim` dims (all when None)."""
    if rotary_dim is None:
        return apply_rotary_pos_emb(x, sin, cos)
    return torch.cat([apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos), x[..., rotary_dim:]], dim=-1)


class GPTJGQAAttention(GPTJAttention):
    """GPT-J attention over its layer's K/V heads (`kv_heads_of_layer`); the cache holds them."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx)
        self.num_key_value_groups = config.num_attention_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.k_proj = nn.Linear(self.embed_dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, kv_dim, bias=False)
        self.scaling = self.head_dim**-0.5  # 4.x GPT-J divides by √d inside its attention instead

    def _sin_cos(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers 4.x computes GPT-J's rotary table inside attention (5.x passes
        `position_embeddings`): the same values, from the table 4.x's GPTJAttention holds."""
        table = self.embed_positions.to(position_ids.device)
        sincos = table[position_ids].to(dtype)
        return torch.split(sincos, sincos.shape[-1] // 2, dim=-1)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kwargs):
        cache = pop_cache(kwargs)
        input_shape = hidden_states.shape[:-1]
        heads = (*input_shape, -1, self.head_dim)
        if position_embeddings is None:
            position_embeddings = self._sin_cos(position_ids, hidden_states.dtype)
        sin, cos = position_embeddings
        q = _rotate(self.q_proj(hidden_states).view(heads), sin, cos, self.rotary_dim).transpose(1, 2)
        k = _rotate(self.k_proj(hidden_states).view(heads), sin, cos, self.rotary_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        k, v = update_cache(cache, k, v, self.layer_idx, kwargs)
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.scaling,
            dropout=self.config.attn_pdrop if self.training else 0.0,
            position_ids=position_ids,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.resid_dropout(self.out_proj(out)), weights


def _use_gqa_attention(model: GPTJModel, config: GPTJGQAConfig) -> None:
    for i, block in enumerate(model.h):
        block.attn = GPTJGQAAttention(config, i)


GPTJGQAModel, GPTJGQAForCausalLM = causal_lm_gqa(
    __name__, GPTJGQAConfig, GPTJModel, GPTJForCausalLM, _use_gqa_attention
)
