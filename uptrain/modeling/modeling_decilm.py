"""Llama with each layer's own KV heads, in the DeciLM / Nemotron-NAS layout (`model_type`
"nemotron-nas"), built on transformers' Llama.

The layout is the one engines serve: vLLM's `DeciLMForCausalLM` and llama.cpp's GGUF converter
(`DeciModel`) read `block_configs`, one entry per layer, and so does this file, so that the three
build the same model:
- `attention.n_heads_in_group`: query heads per KV head; the layer has
  `num_attention_heads // n_heads_in_group` KV heads;
- `ffn.ffn_mult`: an MLP of `int(2 · ffn_mult · hidden_size / 3)` columns rounded up to a
  multiple of 256 (the engines' arithmetic), or `ffn.intermediate_size`: that many columns.
`num_key_value_heads` is the largest layer's (an upper bound for readers that know one count),
and `num_key_value_heads_per_layer`, where present, must list what `block_configs` gives. Layers
without attention or MLP (`no_op`, `replace_with_linear` in published Nemotron-NAS models) are
not built here: those models load with their own code.

Each layer is transformers' own `LlamaDecoderLayer`, built from a copy of the config with that
layer's KV heads and MLP width: its attention reshapes K and V with -1 heads and repeats them by
its own `num_key_value_groups`, so the KV cache holds each layer's heads. The tensor names are
Llama's. Copied beside converted weights under this name: imports only torch, transformers and
the attention file next to it (for what 4.x and 5.x configs differ in).
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

from .attention import TRANSFORMERS_4, rope_for_4x

# The engines round the MLP width they build from `ffn_mult` up to a multiple of this.
FFN_MULTIPLE = 256


class Settings(dict):
    """One `block_configs` entry, or its `attention` / `ffn`: a dict (config.json writes it as it
    is) whose keys read as attributes too, the way vLLM reads them (`block.attention.no_op`,
    `hasattr(block.ffn, "ffn_mult")`): vLLM loads this config class with `trust_remote_code`."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def ffn_width(ffn: dict, hidden_size: int) -> int:
    """The MLP width of one block's `ffn`, as the engines compute it."""
    if "ffn_mult" in ffn:
        width = int(2 * ffn["ffn_mult"] * hidden_size / 3)
        return -(-width // FFN_MULTIPLE) * FFN_MULTIPLE
    return ffn["intermediate_size"]


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    block_configs: list | None = None
    num_key_value_heads_per_layer: list | None = None

    if TRANSFORMERS_4:  # configs built by `__init__(**kwargs)`

        def __init__(self, block_configs=None, num_key_value_heads_per_layer=None, **kwargs):
            # transformers 5 writes the rotary settings only in rope_parameters, which 4.x ignores.
            super().__init__(**rope_for_4x(kwargs, theta="rope_theta"))
            self.block_configs = block_configs
            self.num_key_value_heads_per_layer = num_key_value_heads_per_layer
            self._read_blocks()
    else:  # transformers 5 builds configs as dataclasses: fields, then `__post_init__`

        def __post_init__(self, **kwargs):
            super().__post_init__(**kwargs)
            self._read_blocks()

    def _read_blocks(self) -> None:
        """Check `block_configs` (None: every layer Llama's, `num_key_value_heads` and
        `intermediate_size`) and make its entries read as attributes (`Settings`)."""
        if self.block_configs is None:
            return
        if len(self.block_configs) != self.num_hidden_layers:
            raise ValueError(f"block_configs has {len(self.block_configs)} entries for {self.num_hidden_layers} layers")
        blocks = []
        for index, block in enumerate(self.block_configs):
            attention, ffn = Settings(block.get("attention", {})), Settings(block.get("ffn", {}))
            if any(part.get(flag) for part in (attention, ffn) for flag in ("no_op", "replace_with_linear")):
                raise ValueError(
                    f"block_configs[{index}] has no attention or MLP (no_op / replace_with_linear), which "
                    "uptrain's DeciLM modeling does not build: load this model with its own code"
                )
            group = attention.get("n_heads_in_group")
            if not isinstance(group, int) or group < 1 or self.num_attention_heads % group:
                raise ValueError(
                    f"block_configs[{index}].attention.n_heads_in_group {group!r} does not divide "
                    f"{self.num_attention_heads} heads"
                )
            if "ffn_mult" not in ffn and "intermediate_size" not in ffn:
                raise ValueError(f"block_configs[{index}].ffn has neither ffn_mult nor intermediate_size")
            blocks.append(Settings(block, attention=attention, ffn=ffn))
        self.block_configs = blocks
        per_layer = [self.layer_kv_heads(layer) for layer in range(self.num_hidden_layers)]
        if self.num_key_value_heads_per_layer is not None and list(self.num_key_value_heads_per_layer) != per_layer:
            raise ValueError(
                f"num_key_value_heads_per_layer {self.num_key_value_heads_per_layer} is not the KV heads "
                f"block_configs gives, {per_layer}"
            )
        # The one count transformers' Llama code (and any reader of one count) sees: the bound.
        self.num_key_value_heads = max(per_layer)

    def layer_kv_heads(self, layer: int) -> int:
        if self.block_configs is None:
            return self.num_key_value_heads
        return self.num_attention_heads // self.block_configs[layer]["attention"]["n_heads_in_group"]

    def layer_intermediate_size(self, layer: int) -> int:
        if self.block_configs is None:
            return self.intermediate_size
        return ffn_width(self.block_configs[layer]["ffn"], self.hidden_size)


def decoder_layer(config: DeciLMConfig, layer: int) -> LlamaDecoderLayer:
    """transformers' Llama layer with layer `layer`'s KV heads and MLP width."""
    own = copy.copy(config)
    own.num_key_value_heads = config.layer_kv_heads(layer)
    own.intermediate_size = config.layer_intermediate_size(layer)
    built = LlamaDecoderLayer(own, layer)
    # The modules keep the model's config, not the copy: the attention reads the backend from
    # it at every call, which `set_attn_implementation` changes on the model's config only.
    for module in built.modules():
        if getattr(module, "config", None) is own:
            module.config = config
    return built


class DeciLMModel(LlamaModel):
    config_class = DeciLMConfig

    def __init__(self, config: DeciLMConfig):
        super().__init__(config)
        # transformers' init built every layer with num_key_value_heads (the largest): rebuilt
        # per layer, then initialised as Llama's weights are.
        self.layers = nn.ModuleList([decoder_layer(config, layer) for layer in range(config.num_hidden_layers)])
        self.post_init()


class DeciLMForCausalLM(LlamaForCausalLM):
    config_class = DeciLMConfig

    def __init__(self, config: DeciLMConfig):
        super().__init__(config)
        self.model = DeciLMModel(config)
        self.post_init()
