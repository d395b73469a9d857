"""`--allocation calibrated`: each layer's KV heads chosen, within a KV budget, by what its merge loses.

Two steps, both exact for what they decide:

1. **Costs.** For each converted attention, each layer l and each candidate G (the divisors of
   that layer's source KV heads) the calibrated merge to G is scored on the calibration data
   by the error it leaves (`calibrated.merge_loss`): its value half is the output error
   Σ_q E‖O_q (M_s W − W_s) x̃‖², its key half the logit error Σ_q E[(q_qᵀ Δk_s)²] — the two
   quantities the merge minimises, at their minimum. Both are sums of the eigenvalues the merge
   drops, so they come in closed form from the moments calibration already accumulates: no
   forward pass beyond the one calibration pass, |divisors| eigenvalue problems per layer.
   That is the cost of `--pooling calibrated`. Another pooling is priced for itself
   (`calibrated.pooled_loss`): the error its pooled heads leave, no map, in the same two terms,
   weighting and energies — an allocation is only as good as its cost is of the pooling applied
   (on the reference T5, mean pooling allocated by the merge's cost was worse than uniform).
   The alternative — the model's loss with layer l alone merged to G (`--allocation-cost loss`,
   `layer_loss.layer_alone_costs`, the default for decoder-only models) — asks up to L × (|divisors| − 1)
   forward passes of the whole model over the calibration blocks; it is the quantity the
   allocation stands for, and on the reference Llama it allocates better (below), at that price.
   `settle_allocation` takes its table as `costs`. Either cost is measured only for the G some
   allocation within the budget can give the layer (`budget_candidates`); a budget that leaves
   one allocation is taken without any (`kv_heads.only_allocation`, `Conversion.allocation_forced`).

   The cost is **relative**: each half is divided by what that layer's attention carries of it
   (the value half by Σ_q E‖O_q W_s x̃‖², the key half by the logits' energy Σ_q E[(q_qᵀ k_s)²]),
   and the layer's cost is their sum — the share of its attention's signal the merge loses.
   Absolute errors are not comparable across layers: the residual stream's scale grows with
   depth and every layer reads it through a norm, so the same absolute error weighs less deep
   in the model, and logits and outputs are not in the same units at all. A share is
   dimensionless and the same whatever the layer's scale. Measured on the shipped reference
   Llama (docs/concepts/kv_budget.md, with the command): better than uniform at 1/4 of the
   cache, worse at 1/2 — the logits' share, which dominates, overstates what some layers' key
   errors do to the model; allocating by the model's loss with one layer merged beats uniform
   at both, hence `loss` is the default where it can be measured.

2. **The knapsack** (`choose_allocation`): the allocation with the least summed cost whose
   KV heads × head_dim, summed over every converted attention's layers, fit the budget —
   solved exactly by dynamic programming over layers × budget, the budget counted in units of
   the gcd of the head dims. Ties (equal summed cost) go to the smaller cache, then to the
   allocation whose first differing layer has fewer heads; so a choice is a pure function of
   the costs, and layers where merging loses nothing (G = source heads costs exactly 0) are
   never given heads the budget does not need.

Cost: one calibration pass as `calibrated` pooling runs it (layer by layer), every layer's moment
kept (spilled to a temporary file: no layer's G is known before the last is calibrated); then per
layer and candidate G the merge's eigenvalues (no maps, but the same eigenproblems: about one
solve per candidate); the knapsack is O(layers · budget units · |divisors|), milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF
from uptrain.convert.calibrated import (
    CrossMoments,
    LayerAttention,
    MergeLoss,
    head_similarity,
    input_moment,
    merge_loss,
    permute_kv_heads,
    pooled_loss,
    similarity_order,
)
from uptrain.convert.conversion import Calibration, Conversion, TensorSource
from uptrain.convert.kv_heads import budget_fitting, budget_units
from uptrain.convert.layer_merge import SiteMergers
from uptrain.convert.pooling import FieldContext, Strategy
from uptrain.model_info import divisors

# Per converted attention (model order: encoder, decoder-self, cross), per layer, G → cost.
Costs = Mapping[str, Sequence[Mapping[int, float]]]
Allocation = dict[str, tuple[int, ...]]


def relative_cost(loss: MergeLoss) -> float:
    """The share of the layer's attention signal its merge loses (module docstring): the value
    output's share plus the logits' share, each in [0, 1]; 0 for a layer carrying nothing."""
    share = 0.0
    for lost, whole in ((loss.values, loss.values_energy), (loss.keys, loss.keys_energy)):
        if whole > 0:
            share += lost / whole
    return share


def layer_losses(
    attention: LayerAttention,
    moment: torch.Tensor | CrossMoments,
    candidates: Sequence[int] | None = None,
    grouping: str = "contiguous",
    pooling: Strategy | None = None,
    context: FieldContext | None = None,
) -> dict[int, MergeLoss]:
    """What the conversion's pooling (default: the calibrated merge) of one layer loses at each
    candidate G (default: every divisor of its KV heads), from the layer's moment as
    `CalibratedMerge.solve` reads it; with `similarity` grouping, of the heads as that grouping
    orders them for each G. A row pooling (`mean`, `first`, `random`: `context` seeds its fields as
    the conversion's merger does) is priced by what its pooled heads leave (`pooled_loss`), in the
    calibrated merge's terms and weighting, so that the cost is the pooling's that will be applied."""
    if isinstance(moment, CrossMoments):  # cross-attention's, or attention-weighted moments
        c, c_query, c_values = moment.keys_values, moment.queries, moment.values
    else:
        c, c_query, c_values = moment, None, None
    groups = divisors(attention.num_kv_heads) if candidates is None else candidates
    similarity = head_similarity(attention, input_moment(moment)).cpu() if grouping == "similarity" else None
    losses = {}
    for g in groups:
        ordered = attention if similarity is None else permute_kv_heads(attention, similarity_order(similarity, g))
        if pooling is None or pooling.merges_layers:
            losses[g] = merge_loss(ordered, g, c, c_query, c_values)
        else:
            losses[g] = pooled_loss(ordered, pooling.pool_layer(ordered, g, None, context), c, c_query, c_values)
    return losses


def layer_costs(
    attention: LayerAttention,
    moment: torch.Tensor | CrossMoments,
    candidates: Sequence[int] | None = None,
    grouping: str = "contiguous",
    pooling: Strategy | None = None,
    context: FieldContext | None = None,
) -> dict[int, float]:
    """Each candidate G's cost for one layer (`relative_cost` of `layer_losses`, same arguments)."""
    losses = layer_losses(attention, moment, candidates, grouping, pooling, context)
    return {g: relative_cost(loss) for g, loss in losses.items()}


@dataclass(frozen=True)
class _Best:
    """The best choice for the layers from some index on, within some budget: ordered by
    (cost, units, heads) — least cost, then the smaller cache, then fewer heads earliest."""

    cost: float
    units: int
    heads: tuple[int, ...]

    def key(self) -> tuple:
        return (self.cost, self.units, self.heads)


def choose_allocation(costs: Costs, weights: Mapping[str, int], budget: int) -> Allocation:
    """The allocation (per attention, each layer's G) of least summed cost with
    Σ G_l × weight ≤ `budget` over every attention's layers; ties as the module docstring says.
    `costs[attention][l]` maps each candidate G of layer l to its cost; `weights[attention]` is what
    one KV head of that attention weighs (`kv_heads.head_weights`: its head_dim, a cross-attention
    head's times `--cross-kv-weight`). Refuses, in one line, a budget that no allocation meets."""
    names = list(costs)
    layers = [(name, layer) for name in names for layer in costs[name]]
    unit = math.gcd(*(weights[name] for name in names)) if names else 1
    capacity = budget // unit
    smallest = sum(min(options) * weights[name] for name, options in layers)
    if smallest > budget:
        raise UptrainError(
            f"a KV budget of {budget} (KV heads × their weights, summed over the layers) is below the smallest "
            f"allocation, 1 KV head per layer ({smallest})"
        )
    # best[w]: the best choice for layers i … end within w units, built from the last layer back,
    # so that extending a suffix by layer i's choice keeps the (cost, units, heads) order.
    best: list[_Best | None] = [_Best(0.0, 0, ())] * (capacity + 1)
    for name, options in reversed(layers):
        weight = weights[name] // unit
        step: list[_Best | None] = []
        for w in range(capacity + 1):
            found = None
            for g in sorted(options):
                rest = w - g * weight
                if rest < 0 or best[rest] is None:
                    continue
                tail = best[rest]
                candidate = _Best(options[g] + tail.cost, g * weight + tail.units, (g, *tail.heads))
                if found is None or candidate.key() < found.key():
                    found = candidate
            step.append(found)
        best = step
    chosen = best[capacity]
    assert chosen is not None  # the smallest allocation fits (checked above)
    out, start = {}, 0
    for name in names:
        count = len(costs[name])
        out[name] = chosen.heads[start : start + count]
        start += count
    return out


def allocate(
    costs: Costs, source_heads: Mapping[str, Sequence[int]], weights: Mapping[str, int], fraction: float
) -> Allocation:
    """`choose_allocation` within `fraction` of the source's KV bytes (`--kv-budget F`); a budget
    below one KV head per layer is refused in one line naming the smallest fraction reachable."""
    whole = sum(sum(heads) * weights[name] for name, heads in source_heads.items())
    smallest = sum(len(heads) * weights[name] for name, heads in source_heads.items())
    units = budget_units(fraction, source_heads, weights)
    if units < smallest:
        raise UptrainError(
            f"--kv-budget {fraction:g} is below what any allocation reaches: 1 KV head in every layer keeps "
            f"{smallest / whole:.4g} of the source's KV bytes (give at least that)"
        )
    return choose_allocation(costs, weights, units)


def budget_candidates(conversion: Conversion) -> dict[str, list[tuple[int, ...]]]:
    """Per converted attention and layer, the candidate G whose cost `--allocation calibrated`
    measures: those some allocation within `conversion.pending_budget` can give the layer
    (`kv_heads.fitting_candidates`, in the knapsack's units); the rest could never be chosen.
    Without a pending budget, the whole cache's: every divisor."""
    budget = 1.0 if conversion.pending_budget is None else conversion.pending_budget
    geometries = {name: conversion.stacks[name].geometry for name in conversion.attention}
    return budget_fitting(geometries, conversion.attention, budget, conversion.cross_kv_weight)


def calibration_costs(
    conversion: Conversion, source: TensorSource, moments: Mapping
) -> dict[str, list[dict[int, float]]]:
    """Each converted attention's `layer_costs` for the `budget_candidates`, of the conversion's own
    pooling (its strategy, grouping and seed), layer by layer, from
    calibration moments kept whole (`calibrate(..., keep_moments=True)`, `collect_attention_moments`,
    or an encoder–decoder's `collect_seq2seq_moments`): each layer's projections are read from
    `source` as its merge reads them, one layer at a time."""
    merger = conversion.merger(source, Calibration(moments))
    mergers = merger.mergers if isinstance(merger, SiteMergers) else {DECODER_SELF: merger}
    candidates = budget_candidates(conversion)
    return {
        name: [
            layer_costs(
                site.attention(layer),
                site.calibration[layer],
                candidates[name][layer],
                conversion.grouping,
                conversion.strategy,
                site.field_context(layer),
            )
            for layer in range(site.geometry.num_layers)
        ]
        for name, site in mergers.items()
    }


def settle_allocation(
    conversion: Conversion,
    source: TensorSource,
    moments: Mapping,
    cast: torch.dtype | None = None,
    costs: Costs | None = None,
) -> tuple[Conversion, dict[str, list[dict[int, float]]]]:
    """`--allocation calibrated` decided: the conversion with the allocation of least summed cost
    within its budget (`conversion.pending_budget`), planned again for it (`cast`: the output's
    dtype, as `Conversion.planned`), and the cost table that chose it: `costs` when given (the
    measured cost, `layer_loss.layer_alone_costs`), else the merge's (`calibration_costs`)."""
    if costs is None and not moments:  # a calibration run without keep_moments
        raise UptrainError(
            "--allocation calibrated chooses each layer's KV heads from calibration moments kept whole "
            "(calibrate(..., keep_moments=True)); this calibration has none"
        )
    costs = calibration_costs(conversion, source, moments) if costs is None else {k: list(v) for k, v in costs.items()}
    source_heads = {name: conversion.stacks[name].geometry.layer_kv_heads() for name in conversion.attention}
    chosen = allocate(costs, source_heads, conversion.head_weights, conversion.pending_budget)
    return replace(conversion, allocation=chosen, pending_budget=None).planned(source, cast), costs
