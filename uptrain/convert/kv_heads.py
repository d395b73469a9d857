"""How many KV heads each converted layer gets: what the user asked (`-g G`, `--kv-heads-per-layer`,
`--kv-budget F` with `--allocation`) resolved once, per source, into an allocation.

An allocation maps each converted attention (`decoder-self`; an encoder–decoder's `encoder`,
`decoder-self`, `cross` as `--attention` chooses) to a tuple of KV-head counts, one per layer of
that attention; uniform G is `(G,) * layers`. Everything after `resolve_allocation` (the plan, the
merges, config.json, uptrain.json) reads the allocation, never G. Pure Python: `uptrain convert`
checks its arguments with it before torch is imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from uptrain import UptrainError
from uptrain.convert.grouping import check_num_kv_heads
from uptrain.model_info import AttentionGeometry, divisors

Allocation = Mapping[str, tuple[int, ...]]  # converted attention → each layer's KV heads

# How messages and the model card name each attention.
ATTENTION_NAMES = {
    "encoder": "encoder self-attention",
    "decoder-self": "decoder self-attention",
    "cross": "cross-attention",
}

# How close a typed --kv-budget must be to a fraction an allocation gives: budgets are decimals
# (0.333333 for 1/3); the fractions of two different G lie far further apart than 1e-4, and a knapsack
# budget gains at most a ten-thousandth of the source's bytes by it.
BUDGET_TOLERANCE = 1e-4


def parse_kv_heads_per_layer(value: str) -> tuple[tuple[int, ...], ...]:
    """'8,4,4,2/4,4,2,2' → ((8, 4, 4, 2), (4, 4, 2, 2)): a comma list of each layer's KV heads per
    converted attention, several attentions' lists split by `/` in model order (encoder,
    decoder-self, cross)."""
    lists = []
    for part in value.split("/"):
        entries = [e.strip() for e in part.split(",")]
        if not all(e.isdecimal() and int(e) >= 1 for e in entries):
            raise UptrainError(
                f"--kv-heads-per-layer {value!r}: {part.strip()!r} is not a comma list of whole numbers ≥ 1 "
                "(one per layer; several attentions' lists split by /)"
            )
        lists.append(tuple(int(e) for e in entries))
    return tuple(lists)


@dataclass(frozen=True)
class KVHeadsRequest:
    """What a conversion was asked for: exactly one of one G, explicit per-layer lists, or a
    budget (a fraction of the source's KV bytes per token) spent by `allocation`."""

    num_kv_heads: int | None = None
    per_layer: tuple[tuple[int, ...], ...] | None = None
    budget: float | None = None
    allocation: str = "uniform"
    # `--cross-kv-weight R`: what one cross-attention KV head weighs in the budget, in self-attention
    # heads (the source positions cached per generated token); None: 1, as before the option.
    cross_kv_weight: float | None = None

    @classmethod
    def of(
        cls,
        num_kv_heads: int | None,
        kv_heads_per_layer: str | None,
        kv_budget: float | None,
        allocation: str,
        cross_kv_weight: float | None = None,
    ):
        """The request of a spec's keys (validated there: exactly one given)."""
        per_layer = None if kv_heads_per_layer is None else parse_kv_heads_per_layer(kv_heads_per_layer)
        return cls(num_kv_heads, per_layer, kv_budget, allocation, cross_kv_weight)

    @property
    def needs_calibration(self) -> bool:
        """Whether the allocation is measured on calibration data (`--allocation calibrated`)."""
        return self.budget is not None and self.allocation == "calibrated"


def kv_heads_problem(num_kv_heads, kv_heads_per_layer, kv_budget, allocation: str) -> str | None:
    """The spec-level rule: exactly one of -g, --kv-heads-per-layer, --kv-budget; --allocation
    only with a budget."""
    flags = {"-g": num_kv_heads, "--kv-heads-per-layer": kv_heads_per_layer, "--kv-budget": kv_budget}
    given = [flag for flag, value in flags.items() if value is not None]
    if len(given) != 1:
        said = f"{' and '.join(given)} were given" if given else "none was given"
        return f"give exactly one of -g/--num-kv-heads G, --kv-heads-per-layer LISTS or --kv-budget F ({said})"
    if allocation != "uniform" and kv_budget is None:
        return f"--allocation {allocation} spends a --kv-budget; with {given[0]} the heads are already chosen"
    return None


def cross_kv_weight_problem(kv_budget: float | None, cross_kv_weight: float | None) -> str | None:
    """`--cross-kv-weight` weighs a `--kv-budget`'s cross-attention heads; with the heads given
    (-g, --kv-heads-per-layer) it would weigh nothing, so it is refused."""
    if cross_kv_weight is not None and cross_kv_weight < 1 / CROSS_WEIGHT_DENOMINATOR:
        return (
            f"--cross-kv-weight {cross_kv_weight:g} is below {1 / CROSS_WEIGHT_DENOMINATOR:g}, the least weight the "
            "budget counts (a cross-attention head that weighs nothing would be kept whole for free)"
        )
    if cross_kv_weight is not None and kv_budget is None:
        return (
            f"--cross-kv-weight {cross_kv_weight:g} weighs cross-attention heads in a --kv-budget; "
            "with -g or --kv-heads-per-layer the heads are already chosen (drop it)"
        )
    return None


def allocation_cost_problem(allocation: str, allocation_cost: str | None) -> str | None:
    """`--allocation-cost` chooses what `--allocation calibrated` minimises; with another allocation
    it would be silently ignored, so it is refused."""
    if allocation_cost is not None and allocation != "calibrated":
        return (
            f"--allocation-cost {allocation_cost} is the cost --allocation calibrated minimises; "
            f"--allocation {allocation} chooses no heads by a cost (drop it)"
        )
    return None


def resolved_allocation_cost(allocation_cost: str | None, encoder_decoder: bool) -> str:
    """The cost a calibrated allocation minimises: the one asked for, else the model's loss with one
    layer merged (`loss`) for decoder-only models — on the reference Llama it beats uniform at every
    budget measured, the merge's share does not (docs/concepts/kv_budget.md) — and the merge's own
    loss (`merge`) for encoder–decoders, where the loss is not measured. `loss` asked of an
    encoder–decoder is refused in one line."""
    if allocation_cost is None:
        return "merge" if encoder_decoder else "loss"
    if allocation_cost == "loss" and encoder_decoder:
        raise UptrainError(
            "--allocation-cost loss measures a decoder-only model's next-token loss with each layer merged; "
            "an encoder–decoder's is its objective's, over pairs calibration does not keep "
            "(use --allocation-cost merge)"
        )
    return allocation_cost


# `--cross-kv-weight R` is taken as the nearest fraction with a denominator up to this (37.5 is 75/2,
# 0.333333 is 1/3): the knapsack counts heads in whole units, and its table grows with the denominator.
CROSS_WEIGHT_DENOMINATOR = 100


def cross_weight(cross_kv_weight: float | None) -> Fraction:
    """`--cross-kv-weight R` as the budget counts it: the nearest fraction `CROSS_WEIGHT_DENOMINATOR`
    allows; 1 without R (every head alike)."""
    if cross_kv_weight is None:
        return Fraction(1)
    return Fraction(cross_kv_weight).limit_denominator(CROSS_WEIGHT_DENOMINATOR)


def head_weights(
    geometries: Mapping[str, AttentionGeometry], chosen: Sequence[str], cross_kv_weight: float | None = None
) -> dict[str, int]:
    """What one KV head of each chosen attention weighs in a `--kv-budget`, in whole units: its
    head_dim (K and V, and the dtype, cancel out of every fraction), a cross-attention head's times
    `cross_kv_weight` R — its cache holds R source positions for every generated token the
    self-attention's holds (Whisper: 1,500 frames against some 40 tokens) —, R = p/q as
    `CROSS_WEIGHT_DENOMINATOR` allows, so cross weighs p × head_dim and the others q × head_dim.
    Without R (None), head_dim for every attention: the budget as it was."""
    ratio = cross_weight(cross_kv_weight)
    return {
        name: geometries[name].head_dim * (ratio.numerator if name == "cross" else ratio.denominator) for name in chosen
    }


def budget_units(fraction: float, source_heads: Mapping[str, Sequence[int]], weights: Mapping[str, int]) -> int:
    """The budget `fraction` (0 < F ≤ 1) of the source's KV heads × their `head_weights` summed
    over the converted attentions' layers, in those units (rounded down; a typed decimal's error is
    forgiven as `BUDGET_TOLERANCE` forgives it, so 0.1 of 80 is 8 and 0.333333 of 96 is 32)."""
    whole = sum(sum(heads) * weights[name] for name, heads in source_heads.items())
    return math.floor(fraction * whole * (1 + BUDGET_TOLERANCE))


def fitting_candidates(
    source_heads: Mapping[str, Sequence[int]], weights: Mapping[str, int], units: int
) -> dict[str, list[tuple[int, ...]]]:
    """Per attention and layer, the candidate G (divisors of the layer's source KV heads) that some
    allocation within `units` (`budget_units`) gives it: G × its head weight with one KV head in every
    other layer fits. The others can be in no allocation within the budget, so their costs are not
    measured; none for any layer when even one head per layer does not fit."""
    smallest = sum(len(heads) * weights[name] for name, heads in source_heads.items())
    return {
        name: [tuple(g for g in divisors(kv) if smallest + (g - 1) * weights[name] <= units) for kv in heads]
        for name, heads in source_heads.items()
    }


def budget_fitting(
    geometries: Mapping[str, AttentionGeometry],
    chosen: Sequence[str],
    budget: float,
    cross_kv_weight: float | None = None,
) -> dict[str, list[tuple[int, ...]]]:
    """The `fitting_candidates` of the chosen attentions within `budget` of the source's KV heads,
    each head weighed by its `head_weights`."""
    source_heads = {name: geometries[name].layer_kv_heads() for name in chosen}
    weights = head_weights(geometries, chosen, cross_kv_weight)
    return fitting_candidates(source_heads, weights, budget_units(budget, source_heads, weights))


def only_allocation(
    geometries: Mapping[str, AttentionGeometry],
    chosen: tuple[str, ...],
    budget: float,
    cross_kv_weight: float | None = None,
) -> dict[str, tuple[int, ...]] | None:
    """The allocation a `--kv-budget` leaves no choice of (e.g. 1/8 of an 8-head model's cache: one
    KV head in every layer), else None: where every layer's only `fitting_candidates` is 1, the
    smallest allocation is the one within the budget, and `--allocation calibrated` takes it
    without measuring any cost."""
    fitting = budget_fitting(geometries, chosen, budget, cross_kv_weight)
    if all(layer == (1,) for layers in fitting.values() for layer in layers):
        return {name: (1,) * len(layers) for name, layers in fitting.items()}
    return None


def layer_geometry(geometry: AttentionGeometry, layer: int) -> AttentionGeometry:
    """One layer's geometry, uniform at that layer's KV heads: what pooling one layer reads (a source
    with per-layer KV heads has K/V rows of its own size in each layer)."""
    if geometry.kv_heads_per_layer is None:
        return geometry
    return replace(geometry, num_kv_heads=geometry.kv_heads_per_layer[layer], kv_heads_per_layer=None)


def per_layer(allocation: Allocation) -> bool:
    """Whether some converted attention's layers differ in KV heads (config.json then lists them)."""
    return any(len(set(heads)) > 1 for heads in allocation.values())


def kv_fraction(
    geometries: Mapping[str, AttentionGeometry], allocation: Allocation, cross_kv_weight: float | None = None
) -> Fraction:
    """The output's KV heads × their `head_weights` (head_dim; a cross-attention head's times
    `cross_kv_weight`) summed over the converted attentions' layers, as a fraction of the source's:
    what `--kv-budget` bounds (K and V, and the dtype, cancel)."""
    weights = head_weights(geometries, tuple(allocation), cross_kv_weight)
    after = sum(sum(heads) * weights[name] for name, heads in allocation.items())
    before = sum(sum(geometries[name].layer_kv_heads()) * weights[name] for name in allocation)
    return Fraction(after, before)


def resolve_allocation(
    geometries: Mapping[str, AttentionGeometry], chosen: tuple[str, ...], request: KVHeadsRequest | int
) -> dict[str, tuple[int, ...]]:
    """Each chosen attention's KV heads per layer, every entry checked to divide that layer's
    source KV heads (and so its query heads). `geometries`: the source's attentions."""
    if isinstance(request, int):
        request = KVHeadsRequest(num_kv_heads=request)
    if request.cross_kv_weight is not None and "cross" not in chosen:
        what = "its --attention converts none" if "cross" in geometries else "the model has none"
        raise UptrainError(
            f"--cross-kv-weight {request.cross_kv_weight:g} weighs cross-attention KV heads in the budget; {what}"
        )
    if request.num_kv_heads is not None:
        return _uniform(geometries, chosen, request.num_kv_heads, "--num-kv-heads")
    if request.per_layer is not None:
        return _explicit(geometries, chosen, request.per_layer)
    if request.allocation == "calibrated":
        return calibrated_allocation(geometries, chosen, request.budget, request.cross_kv_weight)
    return _uniform_budget(geometries, chosen, request.budget, request.cross_kv_weight)


def calibrated_allocation(
    geometries: Mapping[str, AttentionGeometry],
    chosen: tuple[str, ...],
    budget: float,
    cross_kv_weight: float | None = None,
) -> dict[str, tuple[int, ...]]:
    """`--allocation calibrated`: the allocation with the least summed merge loss within the budget is
    chosen after calibration (`allocation.settle_allocation`, from the moments); until then the
    smallest allocation (one KV head per layer) stands in for the checks and the plan, and a budget
    below it is refused here, before anything is read."""
    smallest = {name: (1,) * geometries[name].num_layers for name in chosen}
    least = kv_fraction(geometries, smallest, cross_kv_weight)
    if budget < least and not math.isclose(budget, least, rel_tol=BUDGET_TOLERANCE):
        raise UptrainError(
            f"--kv-budget {budget:g} is below what any allocation reaches: 1 KV head in every layer keeps "
            f"{float(least):.6g} of the source's KV bytes (give at least that)"
        )
    return smallest


def _label(geometries: Mapping[str, AttentionGeometry], name: str) -> str:
    """' of its cross-attention' for an encoder–decoder's attention; nothing for a decoder-only model's."""
    return "" if len(geometries) == 1 else f" of its {ATTENTION_NAMES[name]}"


def _uniform(geometries, chosen, g: int, flag: str) -> dict[str, tuple[int, ...]]:
    allocation = {}
    for name in chosen:
        geo = geometries[name]
        for layer, kv in enumerate(geo.layer_kv_heads()):
            try:
                check_num_kv_heads(geo.num_heads, kv, g, flag)
            except UptrainError as err:
                where = "" if geo.kv_heads_per_layer is None else f" in layer {layer}"
                raise UptrainError(f"{err}{where}{_label(geometries, name)}") from None
        allocation[name] = (g,) * geo.num_layers
    return allocation


def _explicit(geometries, chosen, lists: tuple[tuple[int, ...], ...]) -> dict[str, tuple[int, ...]]:
    if len(lists) != len(chosen):
        raise UptrainError(
            f"--kv-heads-per-layer gives {len(lists)} list{'s' * (len(lists) != 1)} (split by /), and the conversion "
            f"converts {len(chosen)} attention{'s' * (len(chosen) != 1)} ({', '.join(chosen)}; --attention chooses): "
            "one list per converted attention, in model order"
        )
    allocation = {}
    for name, heads in zip(chosen, lists, strict=True):
        geo = geometries[name]
        if len(heads) != geo.num_layers:
            raise UptrainError(
                f"--kv-heads-per-layer {','.join(map(str, heads))}: {len(heads)} entries for the "
                f"{geo.num_layers} layers{_label(geometries, name)}; give one per layer"
            )
        for layer, (kv, g) in enumerate(zip(geo.layer_kv_heads(), heads, strict=True)):
            try:
                check_num_kv_heads(geo.num_heads, kv, g, f"--kv-heads-per-layer: layer {layer}'s")
            except UptrainError as err:
                raise UptrainError(f"{err}{_label(geometries, name)}") from None
        allocation[name] = heads
    return allocation


def _uniform_budget(geometries, chosen, budget: float, cross_kv_weight: float | None) -> dict[str, tuple[int, ...]]:
    """`--kv-budget F --allocation uniform`: the one G (dividing every chosen layer's KV heads) whose
    fraction of the source's KV bytes is F."""
    common = math.gcd(*(kv for name in chosen for kv in geometries[name].layer_kv_heads()))
    options = {}
    for g in sorted(divisors(common), reverse=True):
        allocation = {name: (g,) * geometries[name].num_layers for name in chosen}
        options[g] = kv_fraction(geometries, allocation, cross_kv_weight)
        # A budget is a decimal the user typed (0.25, 0.125, or 0.333333 as the refusal below prints
        # 1/3): equal to a G's fraction within 1e-4, far closer than any two G's fractions lie.
        if math.isclose(options[g], budget, rel_tol=BUDGET_TOLERANCE):
            return allocation
    shown = ", ".join(f"G={g}: {float(f):.6g}" for g, f in options.items())
    raise UptrainError(
        f"--kv-budget {budget:g} with --allocation uniform: no single G gives that fraction of the source's KV "
        f"bytes ({shown}); give one of those fractions, or --kv-heads-per-layer"
    )
