"""Whisper with grouped-query attention (`model_type` "whisper_gqa"), built on transformers' Whisper.

Stored form: Whisper's own, with `k_proj` (no bias, as Whisper's) and `v_proj` of G·d rows, G per
attention (`encoder_decoder_gqa` in the attention file next to this one, which builds the
classes). Copied beside converted weights under this name: imports only transformers and that file.
"""

from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperAttention, WhisperForConditionalGeneration, WhisperModel

from .attention import encoder_decoder_gqa


class DecoderPromptAsGiven:
    """Decoder ids the caller gives are used as given, as transformers' generation does for
    `model_type` "whisper" (and only that name): Whisper's prompts begin with <|startofprev|>,
    not the decoder start token, which would be put before them otherwise."""

    def _prepare_decoder_input_ids_for_generation(
        self, batch_size, model_input_name, model_kwargs, decoder_start_token_id, device=None
    ):
        if model_kwargs is not None and "decoder_input_ids" in model_kwargs:
            return model_kwargs.pop("decoder_input_ids"), model_kwargs
        if "input_ids" in model_kwargs and model_input_name != "input_ids":
            return model_kwargs.pop("input_ids"), model_kwargs
        return super()._prepare_decoder_input_ids_for_generation(
            batch_size, model_input_name, model_kwargs, decoder_start_token_id, device
        )


WhisperGQAConfig, WhisperGQAAttention, WhisperGQAModel, WhisperGQAForConditionalGeneration = encoder_decoder_gqa(
    __name__,
    WhisperConfig,
    WhisperAttention,
    WhisperModel,
    WhisperForConditionalGeneration,
    queries_scaled_first=True,  # Whisper's order of operations (see EncoderDecoderAttention)
    # WhisperConfig makes `num_key_value_heads` another name for the encoder's attention heads;
    # here it is a field of its own (the decoder self-attention's KV heads, GroupedStacksConfig),
    # which must not overwrite the encoder's head count.
    config_attributes={
        "attribute_map": {k: v for k, v in WhisperConfig.attribute_map.items() if k != "num_key_value_heads"}
    },
    head_mixins=(DecoderPromptAsGiven,),
)
