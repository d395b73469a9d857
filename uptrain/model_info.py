"""Attention geometry read from a Hugging Face config, and the KV-cache arithmetic on it.

Pure Python on a config dict: usable by `inspect`, the converter and the training metrics
without loading any weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}


@dataclass(frozen=True)
class AttentionGeometry:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    def kv_cache_bytes_per_token(self, dtype_bytes: int, num_kv_heads: int | None = None) -> int:
        """K and V for every layer: 2 × layers × kv heads × head_dim × bytes."""
        kv = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * kv * self.head_dim * dtype_bytes

    def valid_num_kv_heads(self) -> list[int]:
        """Every G this model can be pooled to: divisors of the current KV head count."""
        return [g for g in range(1, self.num_kv_heads + 1) if self.num_kv_heads % g == 0]


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UptrainError(f"{folder} is not a checkpoint: config.json is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UptrainError(f"{path} is not valid JSON: {err}") from None


def attention_geometry(config: dict, head_dim_key: str | None = "head_dim") -> AttentionGeometry:
    """Read layers, heads, KV heads and head_dim from a config dict.

    `head_dim_key` names the config field that overrides `hidden_size // heads`; None for
    architectures whose modeling code ignores such a field (StableLM).
    """
    model_type = config.get("model_type", "?")
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise UptrainError(f"config ({model_type}) has no num_attention_heads: not an attention model uptrain can convert")
    layers = config.get("num_hidden_layers")
    hidden = config.get("hidden_size")
    if not isinstance(layers, int) or not isinstance(hidden, int):
        raise UptrainError(f"config ({model_type}) lacks num_hidden_layers or hidden_size")
    kv = config.get("num_key_value_heads") or heads
    if heads % kv:
        raise UptrainError(f"config has {heads} heads and {kv} KV heads, which do not divide")
    head_dim = config.get(head_dim_key) if head_dim_key else None
    if not head_dim:
        if hidden % heads:
            raise UptrainError(f"hidden_size {hidden} is not divisible by {heads} heads")
        head_dim = hidden // heads
    return AttentionGeometry(model_type, layers, heads, kv, int(head_dim), hidden)


def config_dtype(config: dict) -> str:
    """The checkpoint's declared dtype (transformers 5 writes `dtype`, older `torch_dtype`)."""
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def rotary_dim(config: dict, head_dim: int) -> int:
    """Dims of each head that RoPE rotates (the rest pass through): head_dim × partial_rotary_factor."""
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor)
