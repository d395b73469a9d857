"""Encoder–decoders: three attentions each, the encoder's self-attention ("encoder"), the
decoder's self-attention ("decoder-self") and its cross-attention ("cross"), each with its own
tensors and config keys. One record per model_type; see the package docstring."""

from __future__ import annotations

import dataclasses

from uptrain.architecture.schema import (
    DECODER_SELF,
    STACK_KV_HEADS,
    Architecture,
    AttentionLayout,
    AttentionSite,
    GQAModeling,
    StackKeys,
    TargetPrompt,
)


def _t5_site(attention: str, prefix: str, layers_key: str, layers_fallback_key: str | None = None) -> AttentionSite:
    layout = AttentionLayout(
        attn_prefix=prefix,
        q_proj="q",
        o_proj="o",
        kv_modules=("k", "v"),
        kv_rows=("k.weight", "v.weight"),
        kv_weights=("k.weight", "v.weight"),
        query_head_tensors=("relative_attention_bias.weight",),
    )
    keys = StackKeys(
        layers_key,
        "num_heads",
        STACK_KV_HEADS[attention],
        head_dim_key="d_kv",  # independent of d_model / num_heads
        layers_fallback_key=layers_fallback_key,
    )
    return AttentionSite(attention, layout, keys)


# transformers' attribute_map of each family's config class (`Architecture.key_aliases`).
T5_ALIASES = (
    ("hidden_size", "d_model"),
    ("num_attention_heads", "num_heads"),
    ("num_hidden_layers", "num_layers"),
    ("head_dim", "d_kv"),
)
BART_ALIASES = (
    ("num_attention_heads", "encoder_attention_heads"),
    ("hidden_size", "d_model"),
    ("num_hidden_layers", "encoder_layers"),
)

T5 = Architecture(
    "t5",  # also T5 v1.1 and Flan-T5 (gated-GELU feed-forward): the same attention
    "T5",
    (
        _t5_site("encoder", "encoder.block.{layer}.layer.0.SelfAttention", "num_layers"),
        _t5_site(DECODER_SELF, "decoder.block.{layer}.layer.0.SelfAttention", "num_decoder_layers", "num_layers"),
        _t5_site("cross", "decoder.block.{layer}.layer.1.EncDecAttention", "num_decoder_layers", "num_layers"),
    ),
    # t5_family.py: what T5's and UMT5's GQA modeling share.
    modeling=GQAModeling("t5_gqa", "T5GQAConfig", "T5GQAModel", "T5GQAForConditionalGeneration", ("t5_family",)),
    auto_class="AutoModelForSeq2SeqLM",
    default_objective="span_corruption",
    pipeline_tag="text2text-generation",
    init_std_key="initializer_factor",
    init_std_width_key="d_model",
    rotary=None,
    target_positions_key=None,  # relative positions: no table, no limit
    position_bias_shared=True,  # block 0's relative_attention_bias, handed on to every block
    key_aliases=T5_ALIASES,
    notes="no biases; d_kv independent of d_model / num_heads; the relative_attention_bias of block 0 "
    "(one column per query head) stays with the query heads",
)


def _bart_site(attention: str, prefix: str, side: str) -> AttentionSite:
    layout = AttentionLayout(
        attn_prefix=prefix,
        # A base model (BartModel, WhisperModel) is saved without the "model." of the task model.
        attn_prefix_alternatives=(prefix.removeprefix("model."),),
        o_proj="out_proj",
    )
    return AttentionSite(
        attention, layout, StackKeys(f"{side}_layers", f"{side}_attention_heads", STACK_KV_HEADS[attention])
    )


def bart_family(model_type: str, name: str, modeling: GQAModeling, **fields) -> Architecture:
    """A BART-like encoder–decoder: `model.encoder.layers.{i}.self_attn`, the decoder's
    `self_attn` and `encoder_attn` (cross-attention has the decoder's heads; its K and V read the
    encoder's states), separate projections with biases, head_dim = d_model // heads."""
    sites = (
        _bart_site("encoder", "model.encoder.layers.{layer}.self_attn", "encoder"),
        _bart_site(DECODER_SELF, "model.decoder.layers.{layer}.self_attn", "decoder"),
        _bart_site("cross", "model.decoder.layers.{layer}.encoder_attn", "decoder"),
    )
    fields = {
        "auto_class": "AutoModelForSeq2SeqLM",
        "default_objective": "text_infilling",
        "pipeline_tag": "text2text-generation",
        "init_std_key": "init_std",
        "target_positions_key": "max_position_embeddings",
        "source_text_positions_key": "max_position_embeddings",
        "rotary": None,
        "key_aliases": BART_ALIASES,
        "notes": "q/k/v biases; head_dim = d_model // heads",
        **fields,
    }
    return Architecture(model_type, name, sites, modeling=modeling, **fields)


def _seq2seq_modeling(model_type: str, prefix: str, head: str = "ForConditionalGeneration") -> GQAModeling:
    return GQAModeling(f"{model_type}_gqa", f"{prefix}GQAConfig", f"{prefix}GQAModel", f"{prefix}GQA{head}")


ENCODER_DECODERS: tuple[Architecture, ...] = (
    T5,
    # mT5 converts to t5_gqa (T5's classes), told not to rescale the decoder's output.
    dataclasses.replace(T5, model_type="mt5", name="mT5", converted_config=(("scale_decoder_outputs", False),)),
    # UMT5 stores its attentions under T5's names; only the position bias differs (each
    # self-attention layer's own), so it runs on classes of its own (umt5_gqa).
    dataclasses.replace(
        T5,
        model_type="umt5",
        name="UMT5",
        modeling=dataclasses.replace(_seq2seq_modeling("umt5", "UMT5"), siblings=("t5_family",)),
        position_bias_shared=False,
        notes="as T5; every self-attention layer has its own relative_attention_bias (one column per "
        "query head), which stays with the query heads",
    ),
    bart_family("bart", "BART", _seq2seq_modeling("bart", "Bart")),
    bart_family("mbart", "mBART", _seq2seq_modeling("mbart", "MBart"), target_prompt=TargetPrompt.LANGUAGE_CODES),
    bart_family(
        "marian",
        "Marian",
        _seq2seq_modeling("marian", "Marian", "MTModel"),
        default_objective="pairs",
        pipeline_tag="translation",
        target_prompt=TargetPrompt.TARGET_CODE_IN_SOURCE,
    ),
    bart_family(
        "whisper",
        "Whisper",
        _seq2seq_modeling("whisper", "Whisper"),
        auto_class="AutoModelForSpeechSeq2Seq",
        default_objective="speech_pairs",
        pipeline_tag="automatic-speech-recognition",
        source_positions_key="max_source_positions",
        source_unit="audio frame",
        source_text_positions_key=None,  # its source is audio
        target_positions_key="max_target_positions",
        target_prompt=TargetPrompt.SPEECH_TASK,
        key_aliases=(("num_key_value_heads", "encoder_attention_heads"), *BART_ALIASES),
        notes="k_proj has no bias; the encoder sees max_source_positions (1500) audio frames",
    ),
    # M2M100 (also NLLB-200's dense models, which are M2M100 checkpoints): translation.
    bart_family(
        "m2m_100",
        "M2M100",
        _seq2seq_modeling("m2m_100", "M2M100"),
        default_objective="pairs",
        pipeline_tag="translation",
        target_prompt=TargetPrompt.LANGUAGE_CODES,
    ),
    # Pegasus was pretrained on gap sentences (whole sentences masked, the target only those
    # sentences), which uptrain does not implement. text_infilling would be the nearest, but it
    # frames each block with a BOS token that Pegasus's tokenizer does not have, and it teaches
    # reconstructing the whole text. Pegasus checkpoints are used as summarizers, fine-tuned on
    # document → summary pairs: the data their users have, and what `pairs` trains on.
    bart_family(
        "pegasus",
        "Pegasus",
        _seq2seq_modeling("pegasus", "Pegasus"),
        default_objective="pairs",
        pipeline_tag="summarization",
    ),
)
