"""Marian with grouped-query attention (`model_type` "marian_gqa"), built on transformers' Marian.

Stored form: Marian's own, with `k_proj` and `v_proj` (weights and biases) of G·d rows, G per
attention (`encoder_num_key_value_heads`, `decoder_num_key_value_heads`,
`cross_attention_num_key_value_heads`; each defaults to its attention's heads). Everything
else is transformers' Marian unchanged. Copied beside converted weights under this name:
imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

from transformers import MarianConfig
from transformers.models.marian.modeling_marian import MarianAttention, MarianModel, MarianMTModel

from .attention import (
    AttentionBackends,
    EncoderDecoderAttention,
    GroupedStacksConfig,
    build_as_eager,
    use_encoder_decoder_attention,
)


class MarianGQAConfig(GroupedStacksConfig, MarianConfig):
    model_type = "marian_gqa"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None
    decoder_num_key_value_heads: int | None = None
    cross_attention_num_key_value_heads: int | None = None


class MarianGQAAttention(EncoderDecoderAttention, MarianAttention):
    """Marian attention over the KV heads of its place (encoder, decoder self, cross)."""


class MarianGQAModel(AttentionBackends, MarianModel):
    config_class = MarianGQAConfig

    def __init__(self, config: MarianGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self, MarianGQAAttention, config)
        self.post_init()


class MarianGQAMTModel(AttentionBackends, MarianMTModel):
    config_class = MarianGQAConfig

    def __init__(self, config: MarianGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self.model, MarianGQAAttention, config)
        self.post_init()
