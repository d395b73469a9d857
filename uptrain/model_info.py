"""Attention geometry read from a Hugging Face config, and the KV-cache arithmetic on it.

Pure Python on a config dict: usable by `inspect`, the converter and the training metrics
without loading any weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from pathlib import Path

from uptrain import UptrainError
from uptrain.strict_json import read_json

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
# Layers, heads and widths beyond any real model are refused: it keeps every computation on
# them (the divisors of the KV heads, for one) instant, whatever a config says.
MAX_COUNT = 2**40


@dataclass(frozen=True)
class AttentionGeometry:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int  # per-layer: the largest layer's (the config's scalar key, an upper bound)
    head_dim: int
    hidden_size: int
    # Each layer's KV heads where the layers differ (config `<kv_heads_key>_per_layer`); None = uniform.
    kv_heads_per_layer: tuple[int, ...] | None = None

    def layer_kv_heads(self) -> tuple[int, ...]:
        """Each layer's KV heads, uniform or not."""
        return self.kv_heads_per_layer or (self.num_kv_heads,) * self.num_layers

    def kv_cache_bytes_per_token(self, dtype_bytes: int, num_kv_heads: int | None = None) -> int:
        """K and V summed layer by layer: 2 × Σ_l kv_l × head_dim × bytes. `num_kv_heads` asks
        what every layer at that one G would hold instead."""
        per_layer = self.layer_kv_heads() if num_kv_heads is None else (num_kv_heads,) * self.num_layers
        return 2 * sum(per_layer) * self.head_dim * dtype_bytes

    def valid_num_kv_heads(self) -> list[int]:
        """Every single G this model can be pooled to: the divisors of every layer's KV heads."""
        return divisors(math.gcd(*self.layer_kv_heads()))


def per_layer_key(kv_heads_key: str) -> str:
    """The config key of an attention's per-layer KV heads, beside its scalar `kv_heads_key`
    (`num_key_value_heads_per_layer`, `cross_attention_num_key_value_heads_per_layer`, …)."""
    return kv_heads_key + "_per_layer"


def layer_kv_heads(config: dict, kv_heads_key: str, layers: int, heads: int | None = None) -> tuple[int, ...]:
    """Each of `layers` layers' KV heads of one attention: the list under `per_layer_key(kv_heads_key)`
    when the config has one, else the scalar `kv_heads_key` repeated. `heads` is that attention's
    query heads: what an absent scalar means (no GQA) and what every entry must divide. A list is
    checked: whole numbers ≥ 1, one per layer, its largest equal to the scalar (which readers that
    know only the scalar take as an upper bound)."""
    model_type = config.get("model_type", "?")
    key = per_layer_key(kv_heads_key)
    listed = config.get(key)
    if config.get(kv_heads_key) is None and listed is None:
        if heads is None:
            raise UptrainError(f"config ({model_type}) has no {kv_heads_key}")
        return (heads,) * layers  # no GQA
    if listed is None:
        return (_count(config, kv_heads_key, model_type),) * layers
    if not isinstance(listed, list) or len(listed) != layers:
        raise UptrainError(f"config ({model_type}): {key} is {show(listed)}; it must list {layers} layers' KV heads")
    for value in listed:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_COUNT:
            raise UptrainError(f"config ({model_type}): {key} holds {show(value)}, not a whole number of KV heads ≥ 1")
        if heads is not None and heads % value:
            raise UptrainError(
                f"config ({model_type}): {key} holds {value} KV heads, which do not divide {heads} heads"
            )
    # A list alone is read as the modeling reads it: the scalar is its largest entry.
    scalar = max(listed) if config.get(kv_heads_key) is None else _count(config, kv_heads_key, model_type)
    if max(listed) != scalar:
        raise UptrainError(f"config ({model_type}): {key}'s largest entry {max(listed)} is not {kv_heads_key} {scalar}")
    return tuple(listed)


def _uniform_or_none(per_layer: tuple[int, ...]) -> tuple[int, ...] | None:
    """AttentionGeometry.kv_heads_per_layer: None when every layer has the same KV heads."""
    return None if len(set(per_layer)) == 1 else per_layer


def divisors(n: int) -> list[int]:
    """The divisors of n ≥ 1, ascending. Factors n by trial division up to the square root of
    what is left, so n ≤ MAX_COUNT takes milliseconds (looping over 1…n would take hours)."""
    factors: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    found = [1]
    for p, k in factors.items():
        found = [d * p**e for d in found for e in range(k + 1)]
    return sorted(found)


def read_config(folder: str | Path) -> dict:
    """config.json of a checkpoint folder, with the shape of every field uptrain reads checked:
    a malformed config is one UptrainError, not a traceback somewhere later."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UptrainError(f"{folder} is not a checkpoint: config.json is missing")
    config = read_json(path, unique_keys=False)  # as transformers reads it: the last of a repeated key
    if not isinstance(config, dict):
        raise UptrainError(f"{path} is not a config: it holds a JSON {type(config).__name__}, not an object")
    if not isinstance(config.get("model_type", ""), str):
        raise UptrainError(f"{path}: model_type is {show(config['model_type'])}, not a name")
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(config.get(key) or {}, dict):
            raise UptrainError(f"{path}: {key} is {show(config[key])}, not a mapping")
    for where in (config, config.get("rope_parameters") or {}):
        _check_real(where, "partial_rotary_factor", path, lambda v: 0 < v <= 1, "a number in (0, 1]")
    # The init std, as each layout names it (OPT, BART, Whisper: init_std; T5: initializer_factor × d_model^-½).
    for key in ("initializer_range", "init_std", "initializer_factor"):
        _check_real(config, key, path, lambda v: 0 <= v < math.inf, "a finite number ≥ 0")
    return config


def config_positions(config: dict, key: str | None, label: str) -> int | None:
    """`config[key]`, the number of positions a model has, checked to be a whole number; None
    where `key` is None or the config does not set it (no position table: no limit)."""
    limit = config.get(key) if key is not None else None
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise UptrainError(f"{label}: config.json's {key} is {show(limit)}, not a whole number of positions")
    return limit


def show(value, limit: int = 60) -> str:
    """A value from a user's file for a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _check_real(mapping: dict, key: str, path: Path, valid, expected: str) -> None:
    """`mapping[key]`, when present, is a real number for which `valid` holds."""
    value = mapping.get(key)
    if value is not None and (not isinstance(value, Real) or isinstance(value, bool) or not valid(value)):
        raise UptrainError(f"{path}: {key} is {show(value)}; it must be {expected}")


def _count(config: dict, key: str, model_type: str) -> int:
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_COUNT:
        raise UptrainError(
            f"config ({model_type}): {key} is {show(value)}; it must be a whole number from 1 to "
            f"2**{MAX_COUNT.bit_length() - 1}"
        )
    return value


# Older configs name the geometry as their transformers class's `attribute_map` does:
# GPT-2 and GPT-J (n_head, n_layer, n_embd), BLOOM (n_head, n_layer, n_embed, hidden_size).
CONFIG_ALIASES: dict[str, tuple[str, ...]] = {
    "num_attention_heads": ("n_head",),
    "num_hidden_layers": ("n_layer",),
    "hidden_size": ("n_embd", "n_embed"),
}


def standard_config_names(config: dict) -> dict:
    """`config` with num_attention_heads, num_hidden_layers and hidden_size filled in from
    their older spellings where they are missing; every other field as it was."""
    filled = dict(config)
    for name, aliases in CONFIG_ALIASES.items():
        if filled.get(name) is None:
            for alias in aliases:
                if config.get(alias) is not None:
                    filled[name] = config[alias]
                    break
    return filled


def attention_geometry(config: dict, head_dim_key: str | None = "head_dim") -> AttentionGeometry:
    """Read layers, heads, KV heads and head_dim from a config dict.

    `head_dim_key` names the config field that overrides `hidden_size // heads`; None for
    architectures whose modeling code ignores such a field (StableLM).
    """
    config = standard_config_names(config)  # GPT-2, GPT-J, BLOOM spell them n_head, n_layer, …
    model_type = config.get("model_type", "?")
    if config.get("num_attention_heads") is None:
        raise UptrainError(
            f"config ({model_type}) has no num_attention_heads: not an attention model uptrain can convert"
        )
    if config.get("num_hidden_layers") is None or config.get("hidden_size") is None:
        raise UptrainError(f"config ({model_type}) lacks num_hidden_layers or hidden_size")
    heads = _count(config, "num_attention_heads", model_type)
    layers = _count(config, "num_hidden_layers", model_type)
    hidden = _count(config, "hidden_size", model_type)
    kv = heads if config.get("num_key_value_heads") is None else _count(config, "num_key_value_heads", model_type)
    if heads % kv:
        raise UptrainError(f"config has {heads} heads and {kv} KV heads, which do not divide")
    each = layer_kv_heads(config, "num_key_value_heads", layers, heads)
    kv, per_layer = max(each), _uniform_or_none(each)  # a list alone: its largest, as the modeling reads it
    if head_dim_key and config.get(head_dim_key) is not None:
        head_dim = _count(config, head_dim_key, model_type)
    else:
        if hidden % heads:
            raise UptrainError(f"hidden_size {hidden} is not divisible by {heads} heads")
        head_dim = hidden // heads
    return AttentionGeometry(model_type, layers, heads, kv, head_dim, hidden, per_layer)


def stack_geometry(
    config: dict,
    *,
    layers_key: str,
    heads_key: str,
    kv_heads_key: str,
    head_dim_key: str | None,
    hidden_key: str,
    layers_fallback_key: str | None = None,
) -> AttentionGeometry:
    """The geometry of one attention of an encoder–decoder (its encoder, decoder self-attention
    or cross-attention), from the config keys its architecture names it by: T5 `num_heads`,
    `d_kv`, `num_layers` / `num_decoder_layers`; BART and Whisper `encoder_attention_heads`,
    `decoder_layers`, … with head_dim = d_model // heads. KV heads come from `kv_heads_key`
    (a converted checkpoint's `decoder_num_key_value_heads`, …); absent, they are the query heads."""
    model_type = config.get("model_type", "?")
    if config.get(layers_key) is None and layers_fallback_key is not None:
        layers_key = layers_fallback_key  # T5: num_decoder_layers defaults to num_layers
    for key in (layers_key, heads_key, hidden_key):
        if config.get(key) is None:
            raise UptrainError(f"config ({model_type}) has no {key}: not a {model_type} config uptrain can read")
    heads = _count(config, heads_key, model_type)
    layers = _count(config, layers_key, model_type)
    hidden = _count(config, hidden_key, model_type)
    kv = heads if config.get(kv_heads_key) is None else _count(config, kv_heads_key, model_type)
    if heads % kv:
        raise UptrainError(f"config has {heads} heads and {kv} KV heads ({kv_heads_key}), which do not divide")
    each = layer_kv_heads(config, kv_heads_key, layers, heads)
    kv, per_layer = max(each), _uniform_or_none(each)  # a list alone: its largest, as the modeling reads it
    if head_dim_key is not None:
        if config.get(head_dim_key) is None:
            raise UptrainError(f"config ({model_type}) has no {head_dim_key}")
        head_dim = _count(config, head_dim_key, model_type)  # T5's d_kv: independent of d_model / heads
    else:
        if hidden % heads:
            raise UptrainError(f"{hidden_key} {hidden} is not divisible by {heads} heads ({heads_key})")
        head_dim = hidden // heads
    return AttentionGeometry(model_type, layers, heads, kv, head_dim, hidden, per_layer)


def config_dtype(config: dict) -> str:
    """The checkpoint's declared dtype (transformers 5 writes `dtype`, older `torch_dtype`)."""
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def rotary_dim(config: dict, head_dim: int) -> int:
    """Dims of each head that RoPE rotates (the rest pass through): head_dim × partial_rotary_factor."""
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor)
