"""M2M100 with grouped-query attention (`model_type` "m2m_100_gqa"), built on transformers' M2M100.

Also NLLB-200's dense checkpoints, which are M2M100 models (scaled embeddings, sinusoidal
positions counted from the padding token: transformers' own, unchanged).

Stored form: M2M100's own, with `k_proj` and `v_proj` of G·d rows, G per attention
(`encoder_decoder_gqa` in the attention file next to this one, which builds the classes).
Copied beside converted weights under this name: imports only transformers and that file.
"""

from transformers import M2M100Config
from transformers.models.m2m_100.modeling_m2m_100 import M2M100Attention, M2M100ForConditionalGeneration, M2M100Model

from .attention import encoder_decoder_gqa

M2M100GQAConfig, M2M100GQAAttention, M2M100GQAModel, M2M100GQAForConditionalGeneration = encoder_decoder_gqa(
    __name__, M2M100Config, M2M100Attention, M2M100Model, M2M100ForConditionalGeneration
)
