"""GQA modeling for architectures whose transformers code has no `num_key_value_heads`.

Each architecture is one module here (`modeling_gpt2_gqa.py`, …) built on transformers' own
classes; `attention.py` holds the one grouped-query attention they share. A converted
checkpoint of such an architecture gets its own `model_type` (e.g. "gpt2_gqa"), an `auto_map`,
and a copy of its modeling file and attention.py beside the weights (`uptrain.modeling_table`).

Importing this package registers every GQA architecture the way transformers documents for
custom models:
- `AutoConfig.register` / `AutoModel.register` / `AutoModelForCausalLM.register`, so that plain
  `AutoModelForCausalLM.from_pretrained` loads a converted checkpoint;
- `register_for_auto_class` on each class, so that `save_pretrained` of a loaded model copies its
  modeling file (and the attention.py it imports) and writes `auto_map`: the saved checkpoint
  loads without uptrain, with `trust_remote_code=True`, as a converted one does.
It imports torch and transformers, which `uptrain convert` never needs: conversion reads only
`uptrain.modeling_table`.
"""

from __future__ import annotations

import copy

import transformers
from transformers import AutoConfig, AutoModel

from uptrain.modeling.modeling_bart_gqa import BartGQAConfig, BartGQAForConditionalGeneration, BartGQAModel
from uptrain.modeling.modeling_bloom_gqa import BloomGQAConfig, BloomGQAForCausalLM, BloomGQAModel
from uptrain.modeling.modeling_gpt2_gqa import GPT2GQAConfig, GPT2GQAForCausalLM, GPT2GQAModel
from uptrain.modeling.modeling_gpt_neo_gqa import GPTNeoGQAConfig, GPTNeoGQAForCausalLM, GPTNeoGQAModel
from uptrain.modeling.modeling_gpt_neox_gqa import GPTNeoXGQAConfig, GPTNeoXGQAForCausalLM, GPTNeoXGQAModel
from uptrain.modeling.modeling_gptj_gqa import GPTJGQAConfig, GPTJGQAForCausalLM, GPTJGQAModel
from uptrain.modeling.modeling_marian_gqa import MarianGQAConfig, MarianGQAModel, MarianGQAMTModel
from uptrain.modeling.modeling_mbart_gqa import MBartGQAConfig, MBartGQAForConditionalGeneration, MBartGQAModel
from uptrain.modeling.modeling_opt_gqa import OPTGQAConfig, OPTGQAForCausalLM, OPTGQAModel
from uptrain.modeling.modeling_t5_gqa import T5GQAConfig, T5GQAForConditionalGeneration, T5GQAModel
from uptrain.modeling.modeling_whisper_gqa import (
    WhisperGQAConfig,
    WhisperGQAForConditionalGeneration,
    WhisperGQAModel,
)
from uptrain.modeling_table import gqa_config, modeling_for

# Converted model_type → its (config, base model, model with its task head) classes.
CLASSES = {
    config.model_type: (config, model, causal_lm)
    for config, model, causal_lm in (
        (GPT2GQAConfig, GPT2GQAModel, GPT2GQAForCausalLM),
        (GPTNeoXGQAConfig, GPTNeoXGQAModel, GPTNeoXGQAForCausalLM),
        (OPTGQAConfig, OPTGQAModel, OPTGQAForCausalLM),
        (GPTJGQAConfig, GPTJGQAModel, GPTJGQAForCausalLM),
        (BloomGQAConfig, BloomGQAModel, BloomGQAForCausalLM),
        (GPTNeoGQAConfig, GPTNeoGQAModel, GPTNeoGQAForCausalLM),
        (T5GQAConfig, T5GQAModel, T5GQAForConditionalGeneration),
        (BartGQAConfig, BartGQAModel, BartGQAForConditionalGeneration),
        (MBartGQAConfig, MBartGQAModel, MBartGQAForConditionalGeneration),
        (MarianGQAConfig, MarianGQAModel, MarianGQAMTModel),
        (WhisperGQAConfig, WhisperGQAModel, WhisperGQAForConditionalGeneration),
    )
}


def _register() -> None:
    """Register every GQA architecture with transformers' Auto classes and mark each class for
    `save_pretrained` to carry its code (see the module docstring)."""
    for config, model, head in CLASSES.values():
        auto_head = modeling_for(config.model_type).auto_class  # AutoModelForCausalLM, …ForSeq2SeqLM, …
        AutoConfig.register(config.model_type, config)
        AutoModel.register(config, model)
        getattr(transformers, auto_head).register(config, head)
        config.register_for_auto_class()
        model.register_for_auto_class("AutoModel")
        head.register_for_auto_class(auto_head)


_register()


def gqa_counterpart(model, num_kv_heads: int):
    """`(model class, config)` for a copy of transformers model `model` with `num_kv_heads` KV
    heads: its own class where transformers has native GQA, uptrain's GQA class (same task
    head) for gpt2, gpt_neox, opt, gptj and bloom."""
    modeling = modeling_for(model.config.model_type)
    if modeling is None:
        config = copy.deepcopy(model.config)
        config.num_key_value_heads = num_kv_heads
        return type(model), config
    config_class, base, head = CLASSES[modeling.model_type]
    config = config_class.from_dict(gqa_config(model.config.to_dict(), num_kv_heads))
    # The task head decides the class: a causal LM stays a causal LM, a base model a base model.
    # The transformers class each GQA class extends is its last base (after uptrain's mixin).
    return (head if isinstance(model, head.__bases__[-1]) else base), config
