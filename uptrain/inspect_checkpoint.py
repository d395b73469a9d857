"""`uptrain inspect`: a checkpoint's attention layout and what each G would save in KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

from uptrain import UptrainError
from uptrain.checkpoint.reader import SourceCheckpoint
from uptrain.convert.layouts import LAYOUTS, config_geometry
from uptrain.checkpoint.source import resolve_source
from uptrain.model_info import DTYPE_BYTES, config_dtype, read_config
from uptrain.options import Schema, option

TP_DEGREES = (2, 4, 8)


@dataclass(kw_only=True)
class InspectOptions(Schema):
    """`uptrain inspect`."""

    src: str = option(positional=True, help="checkpoint folder or Hub id")
    context: int = option(4096, help="tokens per sequence")
    batch: int = option(1, help="sequences")
    dtype: str | None = option(None, help="cache dtype (default: the checkpoint's dtype)")
    json: bool = option(False, help="machine-readable output")


def inspect_checkpoint(src: str, context: int = 4096, batch: int = 1, dtype: str | None = None) -> dict:
    """The report of `uptrain inspect` as a dict (the --json output)."""
    for name, value in (("--context", context), ("--batch", batch)):
        if value < 1:
            raise UptrainError(f"{name} must be at least 1 (got {value})")
    resolved = resolve_source(src)
    folder, label = resolved.folder, resolved.label
    config = read_config(folder)
    model_type = config.get("model_type")
    geo = config_geometry(config)
    dtype = dtype or config_dtype(config)
    if dtype not in DTYPE_BYTES:
        raise UptrainError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    dtype_bytes = DTYPE_BYTES[dtype]
    try:
        weights = SourceCheckpoint(folder)
        parameters = sum(math.prod(t.shape) for t in weights.tensors.values())
        weights.close()
    except UptrainError:  # pickle-only or weightless folders: the layout is still worth showing
        parameters = None
    current = geo.kv_cache_bytes_per_token(dtype_bytes)
    options = []
    for g in geo.valid_num_kv_heads():
        per_token = geo.kv_cache_bytes_per_token(dtype_bytes, g)
        options.append({
            "num_kv_heads": g,
            "group_size": geo.num_heads // g,
            "kv_cache_bytes_per_token": per_token,
            "kv_cache_bytes": per_token * context * batch,
            "saving": 1 - per_token / current,
            "tensor_parallel_degrees": [tp for tp in TP_DEGREES if g % tp == 0],
        })
    return {
        "source": label,
        "model_type": model_type,
        "convertible": model_type in LAYOUTS,
        "num_layers": geo.num_layers,
        "num_attention_heads": geo.num_heads,
        "num_key_value_heads": geo.num_kv_heads,
        "head_dim": geo.head_dim,
        "hidden_size": geo.hidden_size,
        "parameters": parameters,
        "dtype": dtype,
        "context": context,
        "batch": batch,
        "kv_cache_bytes_per_token": current,
        "kv_cache_bytes": current * context * batch,
        "options": options,
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_report(info: dict) -> str:
    params = "unknown" if info["parameters"] is None else f"{info['parameters']:,}"
    lines = [
        f"source        {info['source']}",
        f"architecture  {info['model_type']}" + ("" if info["convertible"] else "  (not convertible by uptrain yet)"),
        f"layers        {info['num_layers']}",
        f"heads         {info['num_attention_heads']} query, {info['num_key_value_heads']} KV, head_dim {info['head_dim']}",
        f"parameters    {params}",
        f"KV cache      {human_bytes(info['kv_cache_bytes_per_token'])} per token, "
        f"{human_bytes(info['kv_cache_bytes'])} for {info['context']} tokens × batch {info['batch']} ({info['dtype']})",
        "",
        f"{'G':>4} {'q/kv':>5} {'per token':>11} {'total':>11} {'saving':>7}  TP degrees it divides",
    ]
    for o in info["options"]:
        tp = ", ".join(map(str, o["tensor_parallel_degrees"])) or "-"
        lines.append(f"{o['num_kv_heads']:>4} {o['group_size']:>5} {human_bytes(o['kv_cache_bytes_per_token']):>11} "
                     f"{human_bytes(o['kv_cache_bytes']):>11} {o['saving']:>7.1%}  {tp}")
    return "\n".join(lines)
