"""The files of a converted checkpoint besides its weights: config.json, tokenizer and
generation files, provenance (`uptrain.json`) and the model card (`README.md`)."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import uptrain
from uptrain.convert.grouping import kv_groups, query_to_kv
from uptrain.convert.pooling import Strategy
from uptrain.convert.run import ConversionPlan

# Files besides the weights that make the output a usable checkpoint.
SIDE_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                      "merges.txt", "*.model", "chat_template.*", "generation_config.json")


def write_config(src: Path, dst: Path, config: dict, num_kv_heads: int, dtype: str | None) -> None:
    # Edit the JSON itself, not a transformers config object: every other field stays as it was.
    config = dict(config, num_key_value_heads=num_kv_heads)
    if dtype is not None:
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def copy_side_files(src: Path, dst: Path, config: dict) -> None:
    for pattern in SIDE_FILE_PATTERNS:
        for path in src.glob(pattern):
            if path.is_file() and not (dst / path.name).exists():
                shutil.copy2(path, dst / path.name)
    if not (dst / "generation_config.json").exists():
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        (dst / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")


def provenance(label: str, source_files: dict[str, dict], strategy: Strategy, seed: int, plan: ConversionPlan,
                dtype: str | None) -> dict:
    geo = plan.geometry
    return {
        "uptrain_version": uptrain.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": label,
        "source_files": source_files,
        "model_type": geo.model_type,
        "pooling": strategy.name,
        "pooling_reference": strategy.reference,
        "seed": seed,
        "dtype": dtype,
        "num_attention_heads": geo.num_heads,
        "source_num_key_value_heads": geo.num_kv_heads,
        "num_key_value_heads": plan.num_kv_heads,
        "kv_groups": kv_groups(geo.num_kv_heads, plan.num_kv_heads),
        "query_to_kv": query_to_kv(geo.num_heads, plan.num_kv_heads),
    }


def model_card(p: dict) -> str:
    return f"""---
tags: [uptrain, grouped-query-attention]
---
# {p['model_type']} with {p['num_key_value_heads']} KV heads (converted by uptrain)

Converted from `{p['source']}` ({p['num_attention_heads']} query heads, \
{p['source_num_key_value_heads']} KV heads) to grouped-query attention with \
{p['num_key_value_heads']} KV heads by `{p['pooling']}` pooling of each contiguous group of \
{p['source_num_key_value_heads'] // p['num_key_value_heads']} KV heads \
(query head i reads KV head i // {p['num_attention_heads'] // p['num_key_value_heads']}).
Strategy: {p['pooling_reference']}. Seed {p['seed']}.

The weights have not been trained since conversion: uptrain them (`uptrain train`) before use.
Every other tensor is copied unchanged{'' if p['dtype'] is None else f" (cast to {p['dtype']})"}.
`uptrain.json` records the source files' digests, the grouping and the uptrain version \
({p['uptrain_version']}).
"""
