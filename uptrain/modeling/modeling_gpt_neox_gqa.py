"""GPT-NeoX / Pythia with grouped-query attention (`model_type` "gpt_neox_gqa"), built on
transformers' GPT-NeoX.

Stored form: `query_key_value` stays one Linear whose output rows are grouped per KV head,
`[G, r + 2, d]` with r = h / G: the group's r query heads, then its K head, then its V head.
At G = h that is NeoX's own per-head `[h, 3, d]` interleaving. The output head is stored as
`lm_head` (transformers 5's name; 4.x calls the module `embed_out` and is given the same
tensor, see `Transformers4HeadName`). Everything else (partial rotary, parallel residual) is
transformers' GPT-NeoX unchanged. Copied beside converted weights under this name: imports
only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

from torch import nn
from transformers import GPTNeoXConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import (
    GPTNeoXAttention,
    GPTNeoXForCausalLM,
    GPTNeoXModel,
    apply_rotary_pos_emb,
)

from .attention import (
    TRANSFORMERS_4,
    GroupedHeadsConfig,
    causal_lm_gqa,
    eager_attention_forward,
    kv_heads_of_layer,
    pop_cache,
    rope_for_4x,
    update_cache,
)


class GPTNeoXGQAConfig(GroupedHeadsConfig, GPTNeoXConfig):
    model_type = "gpt_neox_gqa"

    num_key_value_heads: int | None = None

    @staticmethod
    def _kwargs_for_4x(kwargs: dict) -> dict:
        return rope_for_4x(kwargs, theta="rotary_emb_base", partial="rotary_pct")


class GPTNeoXGQAAttention(GPTNeoXAttention):
    """NeoX attention over its layer's K/V heads (`kv_heads_of_layer`); the cache holds them."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx)
        self.queries_per_group = self.num_key_value_groups = config.num_attention_heads // self.num_key_value_heads
        rows = (config.num_attention_heads + 2 * self.num_key_value_heads) * self.head_size
        self.query_key_value = nn.Linear(config.hidden_size, rows, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        cache = pop_cache(kwargs)
        input_shape = hidden_states.shape[:-1]
        r, d = self.queries_per_group, self.head_size
        qkv = self.query_key_value(hidden_states).view(*input_shape, self.num_key_value_heads, r + 2, d)
        q = qkv[..., :r, :].reshape(*input_shape, -1, d).transpose(1, 2)
        k, v = qkv[..., r, :].transpose(1, 2), qkv[..., r + 1, :].transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
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
            dropout=self.attention_dropout if self.training else 0.0,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.dense(out), weights


def _use_gqa_attention(model: GPTNeoXModel, config: GPTNeoXGQAConfig) -> None:
    for i, layer in enumerate(model.layers):
        layer.attention = GPTNeoXGQAAttention(config, layer_idx=i)


class Transformers4HeadName:
    """transformers 4.x names the head `embed_out` and loads a stored `lm_head` into nothing (a
    fresh head, wrong logits): the name mapped both ways with 4.x's own hooks for it."""

    @staticmethod
    def _fix_state_dict_key_on_load(key):
        if key.startswith("lm_head."):
            return "embed_out." + key[len("lm_head.") :], True
        return GPTNeoXForCausalLM._fix_state_dict_key_on_load(key)

    @staticmethod
    def _fix_state_dict_key_on_save(key):
        if key.startswith("embed_out."):
            return "lm_head." + key[len("embed_out.") :], True
        return GPTNeoXForCausalLM._fix_state_dict_key_on_save(key)


GPTNeoXGQAModel, GPTNeoXGQAForCausalLM = causal_lm_gqa(
    __name__,
    GPTNeoXGQAConfig,
    GPTNeoXModel,
    GPTNeoXForCausalLM,
    _use_gqa_attention,
    head_mixins=(Transformers4HeadName,) if TRANSFORMERS_4 else (),
)
