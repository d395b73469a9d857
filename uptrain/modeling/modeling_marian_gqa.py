"""Marian with grouped-query attention (`model_type` "marian_gqa"), built on transformers' Marian.

Stored form: Marian's own, with `k_proj` and `v_proj` of G·d rows, G per attention
(`encoder_decoder_gqa` in the attention file next to this one, which builds the classes).
Copied beside converted weights under this name: imports only transformers and that file.
"""

from transformers import MarianConfig
from transformers.models.marian.modeling_marian import MarianAttention, MarianModel, MarianMTModel

from .attention import encoder_decoder_gqa

MarianGQAConfig, MarianGQAAttention, MarianGQAModel, MarianGQAMTModel = encoder_decoder_gqa(
    __name__, MarianConfig, MarianAttention, MarianModel, MarianMTModel
)
