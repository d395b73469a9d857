"""MPT with grouped-query attention (`model_type` "mpt_gqa"), built on transformers' MPT.

Stored form: `Wqkv` stays one Linear (no bias, as MPT's) whose output rows are
`[Q (h·d) | K (G·d) | V (G·d)]`, each head-major: at G = h that is MPT's own `chunk(3)`.
`clip_qkv` clamps that whole output, as MPT does. ALiBi slopes belong to the query heads and
are unchanged. Everything else is transformers' MPT unchanged. Copied beside converted weights
under this name: imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import MptConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.mpt.modeling_mpt import MptAttention, MptForCausalLM, MptModel

from .attention import (
    TRANSFORMERS_4,
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

if not TRANSFORMERS_4:
    from transformers.masking_utils import create_causal_mask

    # transformers 5.24 names the mask builder's cache argument `cache`, earlier 5.x `past_key_values`.
    CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    # MptModel.forward's own cache argument, which the base model's forward is given it by (5.17: past_key_values).
    MODEL_CACHE = "cache" if "cache" in inspect.signature(MptModel.forward).parameters else "past_key_values"

# The attention implementations that apply ALiBi (see MptGQAAttention.forward). Not flex: the mask
# transformers 5's MPT builds for it is a BlockMask, which MPT casts to booleans.
BACKENDS = ("eager", "sdpa")


def check_backend(implementation: str | None) -> None:
    refuse_backend(implementation, BACKENDS, "mpt_gqa", "ALiBi")


class MptGQAConfig(GroupedHeadsConfig, MptConfig):
    model_type = "mpt_gqa"

    num_key_value_heads: int | None = None


class MptGQAAttention(MptAttention):
    """MPT attention over its layer's K/V heads (`kv_heads_of_layer`); the cache holds them."""

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        self.num_heads = config.n_heads
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.config = config  # read by the attention interface (transformers' MPT attention keeps none)
        self.is_causal = True
        rows = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.Wqkv = nn.Linear(self.hidden_size, rows, bias=False)

    def forward(self, hidden_states, position_bias, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        b, t, _ = hidden_states.shape
        d, g = self.head_dim, self.num_key_value_heads
        qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split([self.num_heads * d, g * d, g * d], dim=2)
        q = q.reshape(b, t, self.num_heads, d).transpose(1, 2)
        k, v = (x.reshape(b, t, g, d).transpose(1, 2) for x in (k, v))
        k, v = update_cache(cache, k, v, self.layer_idx, kwargs)
        s = k.shape[2]
        # MPT's ALiBi `[h, 1, max_seq_len]` ends at the last key (a per-query shift, which the
        # softmax ignores): its last s columns, as MPT reads them. It joins the mask, booleans
        # with True = blocked, as one additive mask: the form eager attention and SDPA add to
        # the scores (at G = h eager adds the bias, then the mask, as MPT does, bit for bit).
        alibi = position_bias[:, :, max(0, position_bias.shape[2] - s) :].unsqueeze(0)
        allowed = None if attention_mask is None else ~attention_mask[..., :s]
        attention_mask = alibi_as_mask(alibi, allowed, t, s, q.dtype)
        check_backend(self.config._attn_implementation)  # also after a `set_attn_implementation`
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.softmax_scale,
            dropout=self.attn_dropout_p if self.training else 0.0,
            **kwargs,
        )
        return self.out_proj(out.reshape(b, t, -1)), weights


def blocked_positions(model: MptModel, inputs_embeds, attention_mask, cache) -> torch.Tensor:
    """The 4D mask transformers 5's MPT reads (booleans, True = blocked), for every backend.

    transformers 5's MPT builds its mask for the model's backend and casts it to booleans, read
    as True = blocked: right for the eager mask (0 or the dtype's minimum), not for SDPA's (True
    = attend, or None where causality alone would do, which the cast fails on). Built here with
    transformers' own mask builder, never skipped, and passed in as a 4D mask it keeps as it is.
    A 4D mask of the caller's (True = attend, or additive) is read the same way."""
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        **{CACHE_KEYWORD: cache},
    )
    return ~mask if mask.dtype == torch.bool else mask < 0


def _use_gqa_attention(model: MptModel, config: MptGQAConfig) -> None:
    for i, block in enumerate(model.blocks):
        block.attn = MptGQAAttention(config, layer_idx=i)


class MptBackends(AttentionBackends):
    """ALiBi is a per-head bias on the scores: eager and SDPA (as an additive mask) apply it;
    flash attention, flex (see BACKENDS) and registered kernels are refused when the model is
    built (`check_backend`) rather than run without it, and engines that ask
    `is_backend_compatible()` are told no."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False


class MptMasks:
    """transformers 5's MPT base model given its mask from `blocked_positions`; 4.x's MPT builds
    a 4D mask with True = blocked for every backend, and is left as it is."""

    if not TRANSFORMERS_4:

        def forward(self, input_ids=None, cache=None, attention_mask=None, inputs_embeds=None, **kwargs):
            cache = cache if cache is not None else kwargs.pop("past_key_values", None)
            if inputs_embeds is None and input_ids is not None:
                inputs_embeds, input_ids = self.wte(input_ids), None
            if inputs_embeds is not None:
                attention_mask = blocked_positions(self, inputs_embeds, attention_mask, cache)
            return super().forward(
                input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **{MODEL_CACHE: cache}, **kwargs
            )


# The task model's base is a new MptGQAModel (not MptModel with its attention replaced): its
# `forward` (MptMasks) is the one that builds the mask.
MptGQAModel, MptGQAForCausalLM = causal_lm_gqa(
    __name__,
    MptGQAConfig,
    MptModel,
    MptForCausalLM,
    _use_gqa_attention,
    mixins=(MptBackends,),
    check_backend=check_backend,
    model_mixins=(MptMasks,),
    new_base_model=True,
)
