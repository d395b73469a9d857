"""GPT-2 with grouped-query attention (`model_type` "gpt2_gqa"), built on transformers' GPT-2.

Stored form: `c_attn` stays one Conv1D (weight `[in, out]`) whose output columns are
`[Q (h·d) | K (G·d) | V (G·d)]`; at G = h that is GPT-2's own layout. Everything else is
transformers' GPT-2 unchanged. Copied beside converted weights under this name:
imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

from transformers import GPT2Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2LMHeadModel, GPT2Model
from transformers.pytorch_utils import Conv1D

from .attention import (
    GroupedHeadsConfig,
    causal_lm_gqa,
    eager_attention_forward,
    kv_heads_of_layer,
    pop_cache,
    update_cache,
)


class GPT2GQAConfig(GroupedHeadsConfig, GPT2Config):
    model_type = "gpt2_gqa"

    num_key_value_heads: int | None = None

    def _check_gqa(self) -> None:
        if self.add_cross_attention:
            raise ValueError("gpt2_gqa has no cross-attention")


class GPT2GQAAttention(GPT2Attention):
    """GPT-2 self-attention over its layer's K/V heads (`kv_heads_of_layer`); the cache holds them."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.kv_dim = self.num_key_value_heads * self.head_dim
        self.c_attn = Conv1D(self.embed_dim + 2 * self.kv_dim, self.embed_dim)
        # transformers 4.x GPT-2 has no `scaling` (it divides inside its attention): the same rule.
        self.scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        q, k, v = self.c_attn(hidden_states).split([self.embed_dim, self.kv_dim, self.kv_dim], dim=2)
        heads = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (x.view(heads).transpose(1, 2) for x in (q, k, v))
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
            dropout=self.attn_dropout.p if self.training else 0.0,
            **kwargs,
        )
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.resid_dropout(self.c_proj(out)), weights


class MaskBufferKeys:
    """Old GPT-2 checkpoints hold causal-mask buffers (`h.N.attn.bias`, `attn.masked_bias`) that
    loading ignores. transformers' pattern for them, "attn.bias", also matches `c_attn.bias`
    under `re.search`, and vLLM's transformers backend drops every key it matches, the QKV bias
    with them: anchored here, so that only the buffers match."""

    _keys_to_ignore_on_load_unexpected = [r"\.attn\.bias$", r"\.attn\.masked_bias$", r"crossattention\.bias$"]


def _use_gqa_attention(model: GPT2Model, config: GPT2GQAConfig) -> None:
    for i, block in enumerate(model.h):
        block.attn = GPT2GQAAttention(config, layer_idx=i)


GPT2GQAModel, GPT2GQAForCausalLM = causal_lm_gqa(
    __name__, GPT2GQAConfig, GPT2Model, GPT2LMHeadModel, _use_gqa_attention, mixins=(MaskBufferKeys,)
)
