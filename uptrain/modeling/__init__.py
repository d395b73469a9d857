"""GQA modeling for architectures whose transformers code has no `num_key_value_heads`.

Each architecture is one module here (`modeling_gpt2_gqa.py`, …) built on transformers' own
classes; `attention.py` holds the one grouped-query attention they share (`t5_family.py` what
T5's and UMT5's share besides). A converted checkpoint of such an architecture gets its own
`model_type` (e.g. "gpt2_gqa"), an `auto_map`, and a copy of its modeling file, attention.py
(and t5_family.py for those two) beside the weights; the architecture registry
(`uptrain.architecture`, its records' `modeling`) names each file and its classes.

Importing this package registers every GQA architecture the way transformers documents for
custom models:
- `AutoConfig.register` / `AutoModel.register` / `AutoModelForCausalLM.register`, so that plain
  `AutoModelForCausalLM.from_pretrained` loads a converted checkpoint;
- `register_for_auto_class` on each class, so that `save_pretrained` of a loaded model copies its
  modeling file (and the sibling files it imports) and writes `auto_map`: the saved checkpoint
  loads without uptrain, with `trust_remote_code=True`, as a converted one does.
It imports torch and transformers, which `uptrain convert` never needs: conversion reads only
the registry.
"""

from __future__ import annotations

import copy
import importlib

import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModel

from uptrain.architecture import converted_architectures, find_architecture, modeling_of
from uptrain.architecture.converted import gqa_config, native_per_layer_config


def _classes() -> dict[str, tuple[type, type, type]]:
    """Converted model_type → its (config, base model, model with its task head) classes, found
    in the module and under the names the architecture registry gives (`GQAModeling`)."""
    found = {}
    for model_type in converted_architectures():
        modeling = modeling_of(model_type)
        module = importlib.import_module(f"{__name__}.{modeling.module}")
        names = (modeling.config_class, modeling.model_class, modeling.head_class)
        found[model_type] = tuple(getattr(module, name) for name in names)
    return found


CLASSES = _classes()


def _register() -> None:
    """Register every GQA architecture with transformers' Auto classes and mark each class for
    `save_pretrained` to carry its code (see the module docstring)."""
    for model_type, (config, model, head) in CLASSES.items():
        auto_head = find_architecture(model_type).auto_class  # AutoModelForCausalLM, …ForSeq2SeqLM, …
        AutoConfig.register(config.model_type, config)
        AutoModel.register(config, model)
        getattr(transformers, auto_head).register(config, head)
        config.register_for_auto_class()
        model.register_for_auto_class("AutoModel")
        head.register_for_auto_class(auto_head)


_register()


def gqa_counterpart(model, num_kv_heads: int | tuple[int, ...]):
    """`(model class, config)` for a copy of transformers model `model` with `num_kv_heads` KV
    heads (one G, or each layer's): its own class where transformers has native GQA, uptrain's
    GQA class (same task head) where the architecture registry names one (gpt2, gpt_neox, …,
    t5, …); a Llama with its own KV heads per layer in uptrain's DeciLM modeling
    (`per_layer_counterpart`), and a DeciLM one pooled to one G in transformers' Llama again."""
    arch = find_architecture(model.config.model_type)
    modeling = None if arch is None else arch.modeling
    if modeling is None:
        if isinstance(num_kv_heads, tuple):
            return per_layer_counterpart(model, num_kv_heads)
        if modeling_of(model.config.model_type) is not None:  # a per-layer layout, to one G
            config = gqa_config(model.config.to_dict(), num_kv_heads)
            own = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
            return own, CONFIG_MAPPING[config["model_type"]].from_dict(config)
        config = copy.deepcopy(model.config)
        config.num_key_value_heads = num_kv_heads
        return type(model), config
    config_class, base, head = CLASSES[modeling.model_type]
    config = config_class.from_dict(gqa_config(model.config.to_dict(), num_kv_heads))
    # The task head decides the class: a causal LM stays a causal LM, a base model a base model.
    # The transformers class each GQA class extends is its last base (after uptrain's mixin).
    return (head if isinstance(model, head.__bases__[-1]) else base), config


def per_layer_counterpart(model, kv_heads: tuple[int, ...]):
    """`(model class, config)` for a copy of transformers model `model`, of a family whose
    modeling reads one num_key_value_heads, with layer l's KV heads `kv_heads[l]`: uptrain's
    modeling of the family's per-layer layout (a Llama: DeciLM, `modeling_decilm.py`), the same
    task head; one line for a family without one (`native_per_layer_config`)."""
    config = native_per_layer_config(model.config.to_dict(), tuple(kv_heads))
    config_class, base, head = CLASSES[config["model_type"]]
    # The task head decides the class, as in `gqa_counterpart` (DeciLM's extend Llama's).
    return (head if isinstance(model, head.__bases__[-1]) else base), config_class.from_dict(config)
