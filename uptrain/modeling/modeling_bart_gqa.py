"""BART with grouped-query attention (`model_type` "bart_gqa"), built on transformers' BART.

Stored form: BART's own, with `k_proj` and `v_proj` of G·d rows, G per attention
(`encoder_decoder_gqa` in the attention file next to this one, which builds the classes).
Copied beside converted weights under this name: imports only transformers and that file.
"""

from transformers import BartConfig
from transformers.models.bart.modeling_bart import BartAttention, BartForConditionalGeneration, BartModel

from .attention import encoder_decoder_gqa

BartGQAConfig, BartGQAAttention, BartGQAModel, BartGQAForConditionalGeneration = encoder_decoder_gqa(
    __name__, BartConfig, BartAttention, BartModel, BartForConditionalGeneration
)
