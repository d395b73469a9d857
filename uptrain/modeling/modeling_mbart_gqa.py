"""mBART with grouped-query attention (`model_type` "mbart_gqa"), built on transformers' mBART.

Stored form: mBART's own, with `k_proj` and `v_proj` (weights and biases) of G·d rows, G per
attention (`encoder_num_key_value_heads`, `decoder_num_key_value_heads`,
`cross_attention_num_key_value_heads`; each defaults to its attention's heads). Everything
else is transformers' mBART unchanged. Copied beside converted weights under this name:
imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

from transformers import MBartConfig
from transformers.models.mbart.modeling_mbart import MBartAttention, MBartForConditionalGeneration, MBartModel

from .attention import (
    AttentionBackends,
    EncoderDecoderAttention,
    GroupedStacksConfig,
    build_as_eager,
    use_encoder_decoder_attention,
)


class MBartGQAConfig(GroupedStacksConfig, MBartConfig):
    model_type = "mbart_gqa"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None
    decoder_num_key_value_heads: int | None = None
    cross_attention_num_key_value_heads: int | None = None


class MBartGQAAttention(EncoderDecoderAttention, MBartAttention):
    """mBART attention over the KV heads of its place (encoder, decoder self, cross)."""


class MBartGQAModel(AttentionBackends, MBartModel):
    config_class = MBartGQAConfig

    def __init__(self, config: MBartGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self, MBartGQAAttention, config)
        self.post_init()


class MBartGQAForConditionalGeneration(AttentionBackends, MBartForConditionalGeneration):
    config_class = MBartGQAConfig

    def __init__(self, config: MBartGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self.model, MBartGQAAttention, config)
        self.post_init()
