"""T5 with grouped-query attention (`model_type` "t5_gqa"), built on transformers' T5.

Also the GQA form of mT5 and T5 v1.1 / Flan-T5 (gated-GELU): transformers runs them with the
same classes. Stored form: T5's own tensor names, with the K and V projections (`k`, `v`, no
biases) of G·d_kv rows in each of the three attentions: the encoder's self-attention
(`encoder.block.{i}.layer.0.SelfAttention`), the decoder's self-attention
(`decoder.block.{i}.layer.0.SelfAttention`) and its cross-attention
(`decoder.block.{i}.layer.1.EncDecAttention`), each with its own G (`STACK_KV_HEADS`). The
relative position bias (block 0 of each stack) stays one per query head. Everything else is
transformers' T5 unchanged. Copied beside converted weights under this name: imports only
torch, transformers and the files next to it (attention.py, t5_family.py).
"""

from __future__ import annotations

import torch
from transformers import T5Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.t5.modeling_t5 import T5Attention, T5ForConditionalGeneration, T5Model

from .attention import TRANSFORMERS_4, eager_attention_forward, pop_cache
from .t5_family import T5FamilyAttention, t5_family_config, t5_family_models

T5GQAConfig = t5_family_config(__name__, T5Config)


def _with_mask(bias: torch.Tensor, mask, causal: bool) -> torch.Tensor:
    """T5's position bias `[1 or B, h, T, S]` with the attention mask folded in: the additive
    mask the attention adds to the scores. `mask` is additive, boolean (True = attend) or None;
    None in a causal self-attention means causal (SDPA masks leave that to the kernel), aligned
    to the end of the keys as after a cache."""
    t, s = bias.shape[-2:]
    if mask is None and causal and t > 1:
        mask = torch.ones(t, s, dtype=torch.bool, device=bias.device).tril(diagonal=s - t)
    if mask is None:
        return bias
    mask = mask[..., :s]  # masks may cover a whole static cache
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, torch.finfo(bias.dtype).min)
    return bias + mask


class T5GQAAttention(T5FamilyAttention, T5Attention):
    """One T5 attention (self or cross) over `kv_heads` K/V heads; the cache holds G heads.

    T5 adds a position bias per query head to the scores and does not scale them. transformers
    5 passes the bias on separately from the mask (its attention functions add both), 4.57
    passes it on with the mask folded in (block 0 folds it; later layers add only the bias
    they are given): each version's convention is kept, so either version's T5 layers above
    this one run unchanged."""

    gqa_model_type = "t5_gqa"
    needs = "T5's position bias"
    bias_in_every_layer = False  # block 0's, passed on to the later layers

    def _buckets(self, relative: torch.Tensor) -> torch.Tensor:
        return self._relative_position_bucket(
            relative,
            bidirectional=not self.is_decoder,
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )

    def _no_position_bias(self, t: int, s: int, like: torch.Tensor) -> torch.Tensor:
        bias = super()._no_position_bias(t, s, like)
        if self.gradient_checkpointing and self.training:
            bias.requires_grad = True  # as transformers' T5: checkpointed layers need an input with grad
        return bias

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, **kwargs):
        cache = pop_cache(kwargs)
        output_attentions = kwargs.pop("output_attentions", False)  # 4.57: decides what is returned
        if kwargs.pop("layer_head_mask", None) is not None:
            raise ValueError("t5_gqa does not support head masks")
        for name in ("use_cache", "query_length"):  # 4.57's, read by its T5Attention only
            kwargs.pop(name, None)
        cross = key_value_states is not None
        b, t = hidden_states.shape[:2]
        past, q, k, v = self._queries_keys_values(hidden_states, cache, key_value_states, kwargs)

        causal = self.is_causal and not cross
        implementation = self.config._attn_implementation
        self.check_backend(implementation)  # also after a `set_attn_implementation`
        if position_bias is None:
            position_bias = self._position_bias(t, k.shape[-2], past, q)
            if TRANSFORMERS_4:
                position_bias = _with_mask(position_bias, mask, causal)
        if TRANSFORMERS_4:
            mask, extra = position_bias, {}
        elif implementation in (None, "eager"):
            # uptrain's eager function adds one additive mask: the bias with the mask in it.
            mask, extra = _with_mask(position_bias, mask, causal), {}
        else:
            # transformers 5's SDPA function takes T5's bias itself (folds it into the mask),
            # exactly as for its own T5.
            extra = {"position_bias": position_bias}
        dropout = self.dropout if self.training else 0.0
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(self, q, k, v, mask, scaling=1.0, dropout=dropout, **extra, **kwargs)
        out = self.o(out.reshape(b, t, -1).contiguous())
        if TRANSFORMERS_4:
            return (out, position_bias, weights) if output_attentions else (out, position_bias)
        return out, position_bias, weights


T5GQAModel, T5GQAForConditionalGeneration = t5_family_models(
    __name__, T5GQAConfig, T5GQAAttention, T5Model, T5ForConditionalGeneration
)
