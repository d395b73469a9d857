"""Pegasus with grouped-query attention (`model_type` "pegasus_gqa"), built on transformers' Pegasus.

Sinusoidal positions and the encoder's and decoder's final layer norms: transformers' own, unchanged.

Stored form: Pegasus's own, with `k_proj` and `v_proj` of G·d rows, G per attention
(`encoder_decoder_gqa` in the attention file next to this one, which builds the classes).
Copied beside converted weights under this name: imports only transformers and that file.
"""

from transformers import PegasusConfig
from transformers.models.pegasus.modeling_pegasus import PegasusAttention, PegasusForConditionalGeneration, PegasusModel

from .attention import encoder_decoder_gqa

PegasusGQAConfig, PegasusGQAAttention, PegasusGQAModel, PegasusGQAForConditionalGeneration = encoder_decoder_gqa(
    __name__, PegasusConfig, PegasusAttention, PegasusModel, PegasusForConditionalGeneration
)
