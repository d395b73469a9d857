"""The strategy registry: how the heads of one group become one KV head. Two kinds.

Row pooling (`mean`, `first`, `random`): a pure function registered with `@pooling`. It
receives one tensor holding every group, shaped `[G, r, head_dim, *rest]` (r = source heads per
group; rest is `[d_model]` for weights and empty for biases and norm scales) in float32 or
float64, and returns `[G, head_dim, *rest]`. It sees one K/V tensor at a time.

Whole-layer strategies (`calibrated`): a `WholeLayerStrategy` registered with `register`. It
sees one layer's Q, K, V and O at once and folds per-head corrections into `q_proj` rows and
`o_proj` columns. It declares what it needs (calibration statistics, a source without
`clip_qkv`) and produces, per layer, a solution from the layer's calibration moment (`solve`)
and the merged layer from the solution (`apply`); its math lives in calibrated.py.

Both kinds answer the same questions — `needs_calibration`, `merges_layers`,
`folds_into_queries`, `check_source` — and `pool_layer` merges one layer's attention, so callers
ask the strategy rather than branch on its kind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from uptrain.architecture import Architecture
from uptrain.convert.calibrated import CrossMoments, LayerAttention, apply_calibrated, solve_calibrated

Role = Literal["weight", "bias", "norm"]


@dataclass(frozen=True)
class PoolingContext:
    role: Role
    tensor_name: str  # the output tensor: makes `random` independent of processing order
    seed: int
    init_std: float


# A layer's context for each K/V field of `LayerAttention` ('k_w', 'v_b', …): the tensor's name.
FieldContext = Callable[[str], PoolingContext]


@dataclass(frozen=True)
class RowPooling:
    """A per-row strategy: `fn(heads [G, r, d, *rest], ctx) -> [G, d, *rest]`."""

    name: str
    reference: str
    fn: Callable[[torch.Tensor, PoolingContext], torch.Tensor]

    needs_calibration = False  # uses no statistics of the source's activations
    merges_layers = False  # pools each K/V tensor on its own
    folds_into_queries = False  # leaves Q and O as they are

    def check_source(self, config: dict, arch: Architecture) -> None:
        """Row pooling converts any source the layout describes."""

    def solve(self, attention: LayerAttention, groups: int, moment: torch.Tensor) -> None:
        """Row pooling takes nothing from calibration moments."""
        return None

    def pool_layer(
        self, attention: LayerAttention, groups: int, solution: None, context: FieldContext
    ) -> LayerAttention:
        """A layer's K and V rows pooled tensor by tensor (whole-layer merges with a grouping
        other than contiguous read the layer together and pool it here)."""
        pooled = {}
        for field in ("k_w", "k_b", "v_w", "v_b"):
            t = getattr(attention, field)
            if t is not None:
                pooled[field] = pool_rows(t, groups, attention.head_dim, self, context(field))
        return replace(attention, num_kv_heads=groups, **pooled)


@dataclass(frozen=True)
class MergeCard:
    """What the model card knows of a whole-layer merge, for the strategy to say what it did
    (`WholeLayerStrategy.card_text`): the model's record, the names of the layer's projections
    (`q`, `o`; `rewritten`: the query, key and value projections the merge rewrites, named for the
    card), what calibration read, what it kept of the forward passes, which attentions were merged, and the
    output dtype's note."""

    arch: Architecture
    q: str
    o: str
    rewritten: str  # "`q_proj`, `k_proj` and `v_proj` (weights and biases)"
    calibration: str  # "32,768 tokens of `text.txt`"
    moments: str  # "the second moment of each layer's attention input was kept"
    merged: str  # "every layer", "each pooled attention"
    cast: str  # " (cast to bfloat16)", or ""


class WholeLayerStrategy:
    """A strategy that merges one layer's Q, K, V and O together.

    Subclasses set `name` and `reference` and implement `solve` (what the merge takes from a
    layer's moment C), `apply` (the merged layer from its weights and that solution) and
    `card_text` (what the merge rewrote, for the model card)."""

    name: str
    reference: str
    # The merge is solved from each layer's calibration moment: it needs calibration data, read
    # through the family's objective (Whisper's targets framed by --language / --speech-task).
    needs_calibration = True
    merges_layers = True
    folds_into_queries = True  # per-head maps land in q_proj rows and o_proj columns

    def check_source(self, config: dict, arch: Architecture) -> None:
        """OLMo and MPT can clamp q, k and v element-wise after the projections (`clip_qkv`,
        where `arch.clip_qkv_key` says): per-head maps folded into q_proj and o_proj do not
        commute with a clamp (renumbering whole heads, as similarity grouping does, does)."""
        from uptrain import UptrainError

        clip = arch.clip_qkv(config)
        if clip is not None:
            raise UptrainError(
                f"--pooling {self.name} cannot merge a model with {arch.clip_qkv_key} ({clip}): "
                "the clamp does not commute with the merge; use mean, first or random (with "
                "--grouping similarity if you like)"
            )

    def solve(self, attention: LayerAttention, groups: int, moment: torch.Tensor) -> Any:
        raise NotImplementedError

    def apply(self, attention: LayerAttention, groups: int, solution: Any) -> LayerAttention:
        raise NotImplementedError

    def card_text(self, card: MergeCard) -> str:
        """The model card's paragraph on what the merge did and which tensors it rewrote. This one
        says only what every whole-layer merge shares; a strategy that knows more says more."""
        text = f"`{self.name}` merge ({self.reference}) of {card.merged}, from the whole layer{card.cast}."
        if self.needs_calibration:
            text += f" Calibration read {card.calibration}; {card.moments}."
        return text

    def pool_layer(
        self, attention: LayerAttention, groups: int, solution: Any, context: FieldContext
    ) -> LayerAttention:
        """The merged layer (`context` names tensors for row pooling; a merge has no use for it)."""
        return self.apply(attention, groups, solution)


Strategy = RowPooling | WholeLayerStrategy
STRATEGIES: dict[str, Strategy] = {}


def pooling(name: str, reference: str):
    """Register a row-pooling function under `name` (`reference`: where it comes from)."""

    def register_fn(fn):
        STRATEGIES[name] = RowPooling(name, reference, fn)
        return fn

    return register_fn


def register(strategy: WholeLayerStrategy) -> WholeLayerStrategy:
    """Register a whole-layer strategy under its name."""
    STRATEGIES[strategy.name] = strategy
    return strategy


@pooling("mean", "Ainslie et al. 2023 (GQA), §2.1: mean-pool the group's head projections")
def pool_mean(heads: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    return heads.mean(dim=1)


@pooling("first", "Ainslie et al. 2023, Fig. 4 ablation: keep the first head of each group")
def pool_first(heads: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    return heads[:, 0].clone()


@pooling("random", "Ainslie et al. 2023, Fig. 4 ablation: fresh initialisation")
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


class CalibratedMerge(WholeLayerStrategy):
    """Closed-form K/V merge from each layer's calibration moment (convert/calibrated.py)."""

    name = "calibrated"
    reference = (
        "closed-form K/V merge on calibration data, per-head maps folded into the query rows "
        "(complex scales on rotary pairs) and the output projection's columns"
    )

    def solve(self, attention: LayerAttention, groups: int, moment: torch.Tensor | CrossMoments):
        if isinstance(moment, CrossMoments):  # cross-attention's, or attention-weighted moments
            return solve_calibrated(attention, groups, moment.keys_values, moment.queries, moment.values)
        return solve_calibrated(attention, groups, moment)

    def apply(self, attention: LayerAttention, groups: int, solution) -> LayerAttention:
        return apply_calibrated(attention, groups, solution)

    def card_text(self, card: MergeCard) -> str:
        maps = _merge_maps_text(card.arch, card.q, card.o)
        return (
            f"`{self.name}` merge: the source model was run over {card.calibration} and {card.moments}. From it, "
            f"{maps}. So {card.rewritten} and the `{card.o}` weights of {card.merged} are rewritten; every other "
            f"tensor is copied unchanged{card.cast}."
        )


def _merge_maps_text(arch: Architecture, q: str, o: str) -> str:
    """What the calibrated merge gives each group: shared V and K projections, with per-head maps
    folded into `o` and `q`; the key maps are what rotary positions leave free (a scale per
    frequency pair on rotated dims, any d×d map elsewhere)."""
    if arch.rotary is None:
        key_maps = f"with a per-head d×d map folded into that head's `{q}` rows"
    else:
        key_maps = (
            f"with a per-head scale for each RoPE frequency pair (and a map of the dims a partial rotary "
            f"embedding leaves unrotated) folded into that head's `{q}` rows"
        )
    return (
        f"each group got one shared V projection, with a per-head d×d map folded into that head's `{o}` "
        f"columns, and one shared K projection, {key_maps}"
    )


register(CalibratedMerge())


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
    tensor: torch.Tensor, groups: int, head_dim: int, strategy_: RowPooling, ctx: PoolingContext
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
