"""BART with grouped-query attention (`model_type` "bart_gqa"), built on transformers' BART.

Stored form: BART's own, with `k_proj` and `v_proj` (weights and biases) of G·d rows, G per
attention (`encoder_num_key_value_heads`, `decoder_num_key_value_heads`,
`cross_attention_num_key_value_heads`; each defaults to its attention's heads). Everything
else is transformers' BART unchanged. Copied beside converted weights under this name:
imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

from transformers import BartConfig
from transformers.models.bart.modeling_bart import BartAttention, BartForConditionalGeneration, BartModel

from .attention import (
    AttentionBackends,
    EncoderDecoderAttention,
    GroupedStacksConfig,
    build_as_eager,
    use_encoder_decoder_attention,
)


class BartGQAConfig(GroupedStacksConfig, BartConfig):
    model_type = "bart_gqa"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None
    decoder_num_key_value_heads: int | None = None
    cross_attention_num_key_value_heads: int | None = None


class BartGQAAttention(EncoderDecoderAttention, BartAttention):
    """BART attention over the KV heads of its place (encoder, decoder self, cross)."""


class BartGQAModel(AttentionBackends, BartModel):
    config_class = BartGQAConfig

    def __init__(self, config: BartGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self, BartGQAAttention, config)
        self.post_init()


class BartGQAForConditionalGeneration(AttentionBackends, BartForConditionalGeneration):
    config_class = BartGQAConfig

    def __init__(self, config: BartGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self.model, BartGQAAttention, config)
        self.post_init()
