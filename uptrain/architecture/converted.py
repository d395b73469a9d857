"""What a conversion writes beside the weights that depends on the architecture: config.json's
edits (`gqa_config`) and, for uptrain's own modeling, the modeling files (`modeling_files`)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, DEFAULT_ATTENTIONS, Architecture, architecture, find_architecture
from uptrain.model_info import per_layer_key, standard_config_names

# The package holding the modeling files; found by path so that this module need not import it.
MODELING_DIR = Path(__file__).parents[1] / "modeling"
ATTENTION_FILE = "attention.py"


KVHeads = int | tuple[int, ...]  # one attention's: G for every layer, or each layer's


def check_per_layer_layout(record: Architecture) -> None:
    """Refuse per-layer KV heads for an architecture whose output has no layout for them:
    transformers' own modeling (llama, mistral, …) reads one `num_key_value_heads`."""
    if record.modeling is None:
        raise UptrainError(
            f"per-layer KV heads for {record.model_type} need uptrain's per-layer layout (not yet built); "
            "give one G for every layer (-g, or --kv-budget with --allocation uniform)"
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


def modeling_files(model_type: str | None) -> dict[str, Path]:
    """Files to save beside a converted checkpoint's weights: name there → source file (the
    modeling file, attention.py and the record's `siblings`). Empty where transformers' own
    modeling reads the checkpoint."""
    record = find_architecture(model_type)
    if record is None or record.modeling is None:
        return {}
    names = (f"{record.modeling.module}.py", ATTENTION_FILE, *(f"{m}.py" for m in record.modeling.siblings))
    return {name: MODELING_DIR / name for name in names}


def copy_modeling_files(model_type: str | None, folder: Path) -> None:
    """Save the modeling files a converted checkpoint of `model_type` loads with (none where
    transformers has native GQA) into `folder`."""
    for name, path in modeling_files(model_type).items():
        shutil.copyfile(path, folder / name)
