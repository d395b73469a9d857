"""Pooling strategies: how the heads of one group become one KV head.

A strategy is a pure function registered with `@strategy`. It receives one tensor holding
every group, shaped `[G, r, head_dim, *rest]` (r = source heads per group; rest is
`[d_model]` for weights and empty for biases and norm scales) in float32 or float64, and
returns `[G, head_dim, *rest]`. `calibrated` is registered here too but needs a whole layer
and calibration statistics; its math lives in calibrated.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Role = Literal["weight", "bias", "norm"]


@dataclass(frozen=True)
class PoolingContext:
    role: Role
    tensor_name: str  # the output tensor: makes `random` independent of processing order
    seed: int
    init_std: float


@dataclass(frozen=True)
class Strategy:
    name: str
    reference: str
    fn: Callable[[torch.Tensor, PoolingContext], torch.Tensor] | None
    # Sees a whole layer's Q, K, V, O and calibration statistics (convert/calibrated.py).
    whole_layer: bool = False


STRATEGIES: dict[str, Strategy] = {}


def strategy(name: str, reference: str):
    def register(fn):
        STRATEGIES[name] = Strategy(name, reference, fn)
        return fn

    return register


@strategy("mean", "Ainslie et al. 2023 (GQA), §2.1: mean-pool the group's head projections")
def pool_mean(heads: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    return heads.mean(dim=1)


@strategy("first", "Ainslie et al. 2023, Fig. 4 ablation: keep the first head of each group")
def pool_first(heads: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    return heads[:, 0].clone()


@strategy("random", "Ainslie et al. 2023, Fig. 4 ablation: fresh initialisation")
def pool_random(heads: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    # As transformers initialises a fresh layer: normal(0, initializer_range) weights,
    # zero biases, unit norm scales.
    shape = (heads.shape[0],) + tuple(heads.shape[2:])
    if ctx.role == "bias":
        return torch.zeros(shape, dtype=heads.dtype)
    if ctx.role == "norm":
        return torch.ones(shape, dtype=heads.dtype)
    generator = torch.Generator().manual_seed(_tensor_seed(ctx.seed, ctx.tensor_name))
    return torch.randn(shape, generator=generator, dtype=heads.dtype) * ctx.init_std


STRATEGIES["calibrated"] = Strategy(
    "calibrated",
    "closed-form K/V merge on calibration data, per-head corrections folded into q_proj "
    "rows (RoPE-safe complex scales) and o_proj columns",
    None,
    whole_layer=True,
)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def get_strategy(name: str) -> Strategy:
    from uptrain import UptrainError

    try:
        return STRATEGIES[name]
    except KeyError:
        raise UptrainError(f"unknown pooling {name!r}; available: {', '.join(STRATEGIES)}") from None


def pool_rows(
    tensor: torch.Tensor, groups: int, head_dim: int, strategy_: Strategy, ctx: PoolingContext
) -> torch.Tensor:
    """Pool a tensor whose dim 0 is `[kv_heads * head_dim]` down to `[groups * head_dim]`.

    Contiguous grouping: rows of KV head k sit at [k·d, (k+1)·d); group j takes heads
    j·r … (j+1)·r − 1. Computed in float32 (float64 for float64 sources) and cast back, so
    pooling a group of one head returns the same bits.
    """
    rows, *rest = tensor.shape
    kv_heads = rows // head_dim
    r = kv_heads // groups
    compute = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    heads = tensor.to(compute).reshape(groups, r, head_dim, *rest)
    pooled = strategy_.fn(heads, ctx)
    expected = (groups, head_dim, *rest)
    if tuple(pooled.shape) != expected:
        raise ValueError(f"strategy {strategy_.name} returned {tuple(pooled.shape)}, expected {expected}")
    return pooled.reshape(groups * head_dim, *rest).to(tensor.dtype)
