"""Multi-head Falcon (Falcon-RW: `multi_query` and `new_decoder_architecture` false) with
grouped-query attention (`model_type` "falcon_gqa"), built on transformers' Falcon.

Stored form: `query_key_value` stays one FalconLinear whose output rows are grouped per KV
head, `[G, r + 2, d]` with r = h / G: the group's r query heads, then its K head, then its V
head. At G = h that is Falcon's own per-head `[h, 3, d]` interleaving. Rotary or ALiBi
(`alibi: true`), whose slopes belong to the query heads and are unchanged. Everything else is
transformers' Falcon unchanged. Copied beside converted weights under this name: imports only
torch, transformers and the attention file next to it.
"""

from __future__ import annotations

import math

from transformers import FalconConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.falcon.modeling_falcon import (
    FalconAttention,
    FalconForCausalLM,
    FalconLinear,
    FalconModel,
    apply_rotary_pos_emb,
)

from .attention import (
    AttentionBackends,
    GroupedHeadsConfig,
    causal_lm_gqa,
    eager_attention_forward,
    kv_heads_of_layer,
    pop_cache,
    refuse_backend,
    rope_for_4x,
    update_cache,
)

# The attention implementations that apply ALiBi: transformers' Falcon folds it into the 4D mask
# it builds, which flash attention and registered kernels do not take, and which it cannot build
# for flex attention (a BlockMask). Rotary Falcon runs on every backend.
ALIBI_BACKENDS = ("eager", "sdpa")


def check_config(config) -> None:
    """Refuse, in one line, what this modeling does not compute: multi-query Falcon (Falcon-7B)
    and the new decoder architecture (Falcon-40B), whose KV heads are shared already."""
    if config.multi_query or config.new_decoder_architecture:
        raise ValueError(
            "falcon_gqa is the multi-head Falcon (multi_query and new_decoder_architecture false); this config "
            f"has multi_query={config.multi_query}, new_decoder_architecture={config.new_decoder_architecture}"
        )


def check_backend(config) -> None:
    if config.alibi:
        refuse_backend(config._attn_implementation, ALIBI_BACKENDS, "falcon_gqa with ALiBi", "ALiBi")


class FalconGQAConfig(GroupedHeadsConfig, FalconConfig):
    model_type = "falcon_gqa"

    num_key_value_heads: int | None = None

    @staticmethod
    def _kwargs_for_4x(kwargs: dict) -> dict:
        return rope_for_4x(kwargs, theta="rope_theta")

    def _check_gqa(self) -> None:
        # Falcon's own KV-head count (read by transformers' Falcon only in the new decoder
        # architecture, refused here), mirrored: engines that size the KV cache read it first
        # (vLLM: `n_head_kv`, then `num_kv_heads`, then `num_key_value_heads`).
        self.num_kv_heads = self.num_key_value_heads


class FalconGQAAttention(FalconAttention):
    """Falcon attention over its layer's K/V heads (`kv_heads_of_layer`); the cache holds them."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx)
        self.queries_per_group = self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        rows = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.query_key_value = FalconLinear(self.hidden_size, rows, bias=config.bias)
        # transformers' Falcon before 5.25 (4.57 included) has an attention of its own: eager
        # divides the scores by √d, and only ALiBi drops attention weights out (`attention_dropout`
        # a module). From 5.25 it is the common one (`scaling`, dropout a rate, on every path).
        self.legacy_falcon = not hasattr(self, "scaling")

    def forward(self, hidden_states, alibi=None, attention_mask=None, position_embeddings=None, **kwargs):
        cache = pop_cache(kwargs)
        # 4.57 passes a per-head mask (None unless the caller gives one; 5.x has none).
        if kwargs.pop("head_mask", None) is not None:
            raise ValueError("falcon_gqa does not support head masks")
        for unused in ("use_cache", "output_attentions"):
            kwargs.pop(unused, None)
        b, t, _ = hidden_states.shape
        r, d = self.queries_per_group, self.head_dim
        qkv = self.query_key_value(hidden_states).view(b, t, self.num_key_value_heads, r + 2, d)
        q = qkv[..., :r, :].reshape(b, t, -1, d).transpose(1, 2)
        k, v = qkv[..., r, :].transpose(1, 2), qkv[..., r + 1, :].transpose(1, 2)
        # By the config, not by `alibi`: transformers 5.25's Falcon passes the attention no
        # `alibi` (it is in the mask) and computes rotary embeddings for ALiBi models too.
        if not self.config.alibi:
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = update_cache(cache, k, v, self.layer_idx, kwargs)
        check_backend(self.config)  # also after a `set_attn_implementation`
        # With ALiBi, transformers' Falcon has added ALiBi / √d into the 4D mask: every backend
        # here adds the mask to the scaled scores, once. (Its own eager attention adds ALiBi a
        # second time, unscaled, before scaling; its SDPA, its default, once, as here.)
        if self.legacy_falcon and self.config._attn_implementation in (None, "eager"):
            kwargs["score_divisor"] = math.sqrt(d)  # that eager's division: bit for bit at G = h
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.inv_norm_factor,
            dropout=self._dropout(),
            **kwargs,
        )
        return self.dense(out.reshape(b, t, -1)), weights

    def _dropout(self) -> float:
        if not self.training or (self.legacy_falcon and not self.config.alibi):
            return 0.0
        return getattr(self.attention_dropout, "p", self.attention_dropout)


def _use_gqa_attention(model: FalconModel, config: FalconGQAConfig) -> None:
    check_config(config)
    check_backend(config)
    for i, layer in enumerate(model.h):
        layer.self_attention = FalconGQAAttention(config, layer_idx=i)


class FalconBackends(AttentionBackends):
    """Every backend serves rotary Falcon; ALiBi Falcon is refused the backends without a place
    for it when the model is built (`check_backend`). Engines that plug in their own kernels
    (`is_backend_compatible()`, asked of the class, before any config) are told no: with ALiBi
    they would run without it."""

    _supports_attention_backend = False


FalconGQAModel, FalconGQAForCausalLM = causal_lm_gqa(
    __name__, FalconGQAConfig, FalconModel, FalconForCausalLM, _use_gqa_attention, mixins=(FalconBackends,)
)
