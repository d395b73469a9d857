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
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bloom.modeling_bloom import BloomAttention, BloomForCausalLM, BloomModel, dropout_add

from .attention import (
    FLEX_TAKES_BIAS,
    AttentionBackends,
    GroupedHeadsConfig,
    alibi_as_mask,
    causal_lm_gqa,
    eager_attention_forward,
    kv_heads_of_layer,
    pop_cache,
    refuse_backend,
    update_cache,
)

# The attention implementations that apply ALiBi (see BloomGQAAttention.forward); 4.x's flex
# attention takes no per-head bias.
BACKENDS = ("eager", "sdpa", "flex_attention") if FLEX_TAKES_BIAS else ("eager", "sdpa")


def check_backend(implementation: str | None) -> None:
    """Refuse, in one line, an attention implementation that has no place for ALiBi (flash
    attention, a registered kernel, 4.x's flex): it would run, without ALiBi, and be wrong."""
    refuse_backend(implementation, BACKENDS, "bloom_gqa", "ALiBi")


class BloomGQAConfig(GroupedHeadsConfig, BloomConfig):
    model_type = "bloom_gqa"

    num_key_value_heads: int | None = None

    def _check_gqa(self) -> None:
        if self.pretraining_tp > 1 and self.slow_but_exact:
            raise ValueError("bloom_gqa does not implement slow_but_exact tensor-parallel output projection")


class BloomGQAAttention(BloomAttention):
    """BLOOM attention over its layer's K/V heads (`kv_heads_of_layer`); the cache holds them."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx)
        self.queries_per_group = self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.config = config  # read by the attention interface (transformers' BLOOM attention keeps none)
        self.is_causal = True
        rows = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.query_key_value = nn.Linear(self.hidden_size, rows, bias=True)

    def forward(self, hidden_states, residual, alibi, attention_mask, **kwargs):
        cache = pop_cache(kwargs)
        b, t, _ = hidden_states.shape
        r, d = self.queries_per_group, self.head_dim
        qkv = self.query_key_value(hidden_states).view(b, t, self.num_key_value_heads, r + 2, d)
        q = qkv[..., :r, :].reshape(b, t, -1, d).transpose(1, 2)
        k, v = qkv[..., r, :].transpose(1, 2), qkv[..., r + 1, :].transpose(1, 2)
        k, v = update_cache(cache, k, v, self.layer_idx, kwargs)
        # transformers builds ALiBi as [B·h, 1, S]: one slope per query head. Each backend takes
        # it its own way: eager adds it to the scores (fused, as BLOOM does), flex as a per-head
        # `position_bias`, SDPA inside its additive mask.
        alibi = alibi.view(b, self.num_heads, 1, -1)
        implementation = self.config._attn_implementation
        check_backend(implementation)
        if implementation in (None, "eager"):
            kwargs["alibi"] = alibi
        elif implementation == "flex_attention":
            kwargs["position_bias"] = alibi.expand(b, self.num_heads, t, k.shape[2])
        else:
            attention_mask = alibi_as_mask(alibi, attention_mask, t, k.shape[2], q.dtype)
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.inv_norm_factor,
            dropout=self.attention_dropout.p if self.training else 0.0,
            **kwargs,
        )
        out = self.dense(out.reshape(b, t, -1))
        return dropout_add(out, residual, self.hidden_dropout, self.training), weights


def _use_gqa_attention(model: BloomModel, config: BloomGQAConfig) -> None:
    for i, block in enumerate(model.h):
        block.self_attention = BloomGQAAttention(config, layer_idx=i)


class BloomBackends(AttentionBackends):
    """ALiBi is a per-head bias on the scores: eager, SDPA (as an additive mask) and flex (where
    it takes a per-head bias) apply it; flash attention and registered kernels have no place
    for it, so they are refused when the model is built (`check_backend`) rather than run
    without it, and engines that ask `is_backend_compatible()` are told no."""

    _supports_flash_attn = False
    _supports_flex_attn = FLEX_TAKES_BIAS
    _supports_attention_backend = False


BloomGQAModel, BloomGQAForCausalLM = causal_lm_gqa(
    __name__,
    BloomGQAConfig,
    BloomModel,
    BloomForCausalLM,
    _use_gqa_attention,
    mixins=(BloomBackends,),
    check_backend=check_backend,
)
