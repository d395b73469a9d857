"""What a conversion writes beside the weights that depends on the architecture: config.json's
edits (`gqa_config`) and, for uptrain's own modeling, the modeling files (`modeling_files`)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from uptrain import UptrainError
from uptrain.architecture import (
    DECODER_SELF,
    DEFAULT_ATTENTIONS,
    Architecture,
    architecture,
    find_architecture,
    modeling_of,
)
from uptrain.architecture.decilm import decilm_config, llama_config
from uptrain.model_info import per_layer_key, standard_config_names

# The package holding the modeling files; found by path so that this module need not import it.
MODELING_DIR = Path(__file__).parents[1] / "modeling"
ATTENTION_FILE = "attention.py"


KVHeads = int | tuple[int, ...]  # one attention's: G for every layer, or each layer's


def check_per_layer_layout(record: Architecture) -> None:
    """Refuse per-layer KV heads for an architecture whose output has no layout for them:
    transformers' own modeling reads one `num_key_value_heads`, and the layout engines serve
    per layer (DeciLM, `decilm.py`) is a Llama layer: the Llama family's output is written in it,
    every other native-GQA family has something that layer lacks (`per_layer_refusal`)."""
    if record.modeling is None and record.per_layer_modeling is None:
        raise UptrainError(
            f"{record.name} cannot take its own KV heads per layer: the per-layer layout engines serve "
            f"(DeciLM, a Llama layer) has no {record.per_layer_refusal}; give one G for every layer "
            "(-g, or --kv-budget with --allocation uniform)"
        )


def gqa_config(config: dict, num_kv_heads: KVHeads | Mapping[str, KVHeads]) -> dict:
    """The converted checkpoint's config.json: each converted attention's KV heads under its key
    (`num_kv_heads` maps attentions to their KV heads; an int or tuple is for those of
    DEFAULT_ATTENTIONS the model has), `num_key_value_heads` mirroring the decoder
    self-attention's; for architectures without native GQA also `model_type`, `architectures`
    and `auto_map` naming uptrain's modeling (and the standard names of n_head, n_layer, n_embd
    where the source spells them so). Every other field stays as it was.

    An attention whose layers differ (a tuple) gets its list beside its key, under
    `model_info.per_layer_key` (`num_key_value_heads_per_layer`), and the largest entry under the
    key itself (an upper bound for readers that know only the key); one G removes a list the
    source had, so a uniform conversion of a uniform source writes exactly the keys it always did."""
    config = dict(config)
    record = architecture(config.get("model_type"))
    if not isinstance(num_kv_heads, Mapping):
        num_kv_heads = dict.fromkeys([a for a in DEFAULT_ATTENTIONS if a in record.attentions], num_kv_heads)
    for attention, kv in num_kv_heads.items():
        key = record.site(attention).geometry.kv_heads_key
        if isinstance(kv, tuple) and len(set(kv)) == 1:
            kv = kv[0]
        if isinstance(kv, tuple):
            config[key], config[per_layer_key(key)] = max(kv), list(kv)
        else:
            config[key] = kv
            config.pop(per_layer_key(key), None)
    decoder = config.get(record.site(DECODER_SELF).geometry.kv_heads_key)
    if decoder is not None:
        config["num_key_value_heads"] = decoder
    config.update(record.converted_config)
    if record.modeling is None and record.per_layer_modeling is not None:
        # transformers' config holds one count: a per-layer output is written in the layout
        # engines serve (DeciLM), and a uniform one of such a checkpoint is a plain Llama again.
        per_layer = config.get(per_layer_key("num_key_value_heads"))
        return (
            llama_config(config, record.model_type)
            if per_layer is None
            else native_per_layer_config(config, tuple(per_layer))
        )
    modeling = record.modeling
    if modeling is not None:
        # GPT-2, GPT-J and BLOOM configs spell the geometry n_head, n_layer, n_embed: add the
        # standard names too (the config class maps them to the same fields), so uptrain's
        # readers of config.json (inspect, train) understand the converted checkpoint.
        config = standard_config_names(config)
        module = modeling.module
        config.update(
            model_type=modeling.model_type,
            architectures=[modeling.head_class],
            auto_map={
                "AutoConfig": f"{module}.{modeling.config_class}",
                "AutoModel": f"{module}.{modeling.model_class}",
                record.auto_class: f"{module}.{modeling.head_class}",
            },
        )
    return config


def native_per_layer_config(config: dict, kv_heads: tuple[int, ...]) -> dict:
    """The config.json of a per-layer output (`kv_heads`: each layer's KV heads, not all equal) of
    a family whose transformers modeling reads one num_key_value_heads: the Llama family's in the
    DeciLM layout engines serve (`decilm.py`), naming uptrain's modeling of it (`modeling_files`
    of "nemotron-nas"); one line for a family whose layers that layout cannot hold."""
    record = architecture(config.get("model_type"))
    check_per_layer_layout(record)
    modeling = record.per_layer_modeling
    return decilm_config(
        config, kv_heads, modeling.module, (modeling.config_class, modeling.model_class, modeling.head_class)
    )


def modeling_files(model_type: str | None) -> dict[str, Path]:
    """Files to save beside a converted checkpoint's weights: name there → source file (the
    modeling file, attention.py and the record's `siblings`). Empty where transformers' own
    modeling reads the checkpoint."""
    record = find_architecture(model_type)
    modeling = modeling_of(model_type) or (None if record is None else record.modeling)
    if modeling is None:
        return {}
    names = (f"{modeling.module}.py", ATTENTION_FILE, *(f"{m}.py" for m in modeling.siblings))
    return {name: MODELING_DIR / name for name in names}


def copy_modeling_files(model_type: str | None, folder: Path) -> None:
    """Save the modeling files a converted checkpoint of `model_type` loads with (none where
    transformers has native GQA) into `folder`."""
    for name, path in modeling_files(model_type).items():
        shutil.copyfile(path, folder / name)
