"""mBART with grouped-query attention (`model_type` "mbart_gqa"), built on transformers' mBART.

Stored form: mBART's own, with `k_proj` and `v_proj` of G·d rows, G per attention
(`encoder_decoder_gqa` in the attention file next to this one, which builds the classes).
Copied beside converted weights under this name: imports only transformers and that file.
"""

from transformers import MBartConfig
from transformers.models.mbart.modeling_mbart import MBartAttention, MBartForConditionalGeneration, MBartModel

from .attention import encoder_decoder_gqa

MBartGQAConfig, MBartGQAAttention, MBartGQAModel, MBartGQAForConditionalGeneration = encoder_decoder_gqa(
    __name__, MBartConfig, MBartAttention, MBartModel, MBartForConditionalGeneration
)
