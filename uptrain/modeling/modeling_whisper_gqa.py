"""Whisper with grouped-query attention (`model_type` "whisper_gqa"), built on transformers' Whisper.

Stored form: Whisper's own, with `k_proj` (no bias, as Whisper's) and `v_proj` of G·d rows, G per
attention (`encoder_num_key_value_heads`, `decoder_num_key_value_heads`,
`cross_attention_num_key_value_heads`; each defaults to its attention's heads). Everything
else is transformers' Whisper unchanged. Copied beside converted weights under this name:
imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperAttention, WhisperForConditionalGeneration, WhisperModel

from .attention import (
    AttentionBackends,
    EncoderDecoderAttention,
    GroupedStacksConfig,
    build_as_eager,
    use_encoder_decoder_attention,
)


class WhisperGQAConfig(GroupedStacksConfig, WhisperConfig):
    model_type = "whisper_gqa"
    # WhisperConfig makes `num_key_value_heads` another name for the encoder's attention heads;
    # here it is a field of its own (the decoder self-attention's KV heads, GroupedStacksConfig),
    # which must not overwrite the encoder's head count.
    attribute_map = {k: v for k, v in WhisperConfig.attribute_map.items() if k != "num_key_value_heads"}

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None
    decoder_num_key_value_heads: int | None = None
    cross_attention_num_key_value_heads: int | None = None


class WhisperGQAAttention(EncoderDecoderAttention, WhisperAttention):
    """Whisper attention over the KV heads of its place (encoder, decoder self, cross)."""

    queries_scaled_first = True  # Whisper's order of operations (see EncoderDecoderAttention)


class WhisperGQAModel(AttentionBackends, WhisperModel):
    config_class = WhisperGQAConfig

    def __init__(self, config: WhisperGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self, WhisperGQAAttention, config)
        self.post_init()


class WhisperGQAForConditionalGeneration(AttentionBackends, WhisperForConditionalGeneration):
    config_class = WhisperGQAConfig

    def __init__(self, config: WhisperGQAConfig):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self.model, WhisperGQAAttention, config)
        self.post_init()

    def _prepare_decoder_input_ids_for_generation(
        self, batch_size, model_input_name, model_kwargs, decoder_start_token_id, device=None
    ):
        """Decoder ids the caller gives are used as given, as transformers' generation does for
        `model_type` "whisper" (and only that name): Whisper's prompts begin with
        <|startofprev|>, not the decoder start token, which would be put before them otherwise."""
        if model_kwargs is not None and "decoder_input_ids" in model_kwargs:
            return model_kwargs.pop("decoder_input_ids"), model_kwargs
        if "input_ids" in model_kwargs and model_input_name != "input_ids":
            return model_kwargs.pop("input_ids"), model_kwargs
        return super()._prepare_decoder_input_ids_for_generation(
            batch_size, model_input_name, model_kwargs, decoder_start_token_id, device
        )
