"""UMT5 with grouped-query attention (`model_type` "umt5_gqa"), built on transformers' UMT5.

UMT5 is T5 (v1.1 style) with a relative position bias of its own in *every* self-attention
layer, not only in block 0, each computed by its layer and never passed on to the next. Stored
form: UMT5's own tensor names (T5's), with the K and V projections (`k`, `v`, no biases) of
G·d_kv rows in each of the three attentions: the encoder's self-attention
(`encoder.block.{i}.layer.0.SelfAttention`), the decoder's self-attention
(`decoder.block.{i}.layer.0.SelfAttention`) and its cross-attention
(`decoder.block.{i}.layer.1.EncDecAttention`), each with its own G (`STACK_KV_HEADS`). Every
layer's `relative_attention_bias` stays one column per query head. Everything else is
transformers' UMT5 unchanged. Copied beside converted weights under this name: imports only
torch, transformers and the files next to it (attention.py, t5_family.py).
"""

from __future__ import annotations

from transformers import UMT5Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.umt5.modeling_umt5 import UMT5Attention, UMT5ForConditionalGeneration, UMT5Model

from .attention import TRANSFORMERS_4, alibi_as_mask, eager_attention_forward, pop_cache
from .t5_family import T5FamilyAttention, t5_family_config, t5_family_models

UMT5GQAConfig = t5_family_config(__name__, UMT5Config)


class UMT5GQAAttention(T5FamilyAttention, UMT5Attention):
    """One UMT5 attention (self or cross) over `kv_heads` K/V heads; the cache holds G heads.

    The scores are unscaled, plus the layer's own position bias per query head (zeros in a
    cross-attention), plus the mask. transformers 5's SDPA function takes the bias itself (as
    for its own UMT5); uptrain's eager function and every 4.57 path get it folded into the
    additive mask."""

    gqa_model_type = "umt5_gqa"
    needs = "UMT5's position bias"
    bias_in_every_layer = True  # each self-attention's own, never passed on

    def _buckets(self, relative):
        return self._relative_position_bucket(relative)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        if kwargs.pop("layer_head_mask", None) is not None:  # 4.57's; None unless the caller gives one
            raise ValueError("umt5_gqa does not support head masks")
        cross = encoder_hidden_states is not None
        b, t = hidden_states.shape[:2]
        past, q, k, v = self._queries_keys_values(hidden_states, cache, encoder_hidden_states, kwargs)

        implementation = self.config._attn_implementation
        self.check_backend(implementation)  # also after a `set_attn_implementation`
        bias = self._position_bias(t, k.shape[-2], past, q)
        if TRANSFORMERS_4 or implementation in (None, "eager"):
            # One additive mask: the bias with the mask in it (4.57's UMT5 adds them so). The bias
            # enters the scores as ALiBi does, hence attention.py's fold; with no mask an encoder's
            # or cross-attention's queries see every key.
            if attention_mask is not None or (self.is_causal and not cross):
                bias = alibi_as_mask(bias, attention_mask, t, k.shape[-2], bias.dtype)
            mask, extra = bias, {}
        else:
            mask, extra = attention_mask, {"position_bias": bias}
        dropout = self.dropout if self.training else 0.0
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(self, q, k, v, mask, scaling=1.0, dropout=dropout, **extra, **kwargs)
        return self.o(out.reshape(b, t, -1).contiguous()), weights


UMT5GQAModel, UMT5GQAForConditionalGeneration = t5_family_models(
    __name__, UMT5GQAConfig, UMT5GQAAttention, UMT5Model, UMT5ForConditionalGeneration
)
