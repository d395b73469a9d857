"""One conversion, derived once, run by both entry points: the checkpoint path and `convert_model`.

`conversion_for` decides from a source's config everything a conversion does to it — the
architecture, the attentions pooled and G checked against each, the strategy's own checks;
`Conversion.planned` adds the plan of every output tensor from the source's tensor headers
(plan.py); `Conversion.compute` computes each planned tensor from any `TensorSource`.
The checkpoint path (`pipeline`: safetensors shards in, a shard writer out, stream.py) and
`convert_model` (`in_memory`: a state dict in, a new model out) differ only in where tensors
come from and where they go, so their weights are equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from uptrain.architecture import DECODER_SELF, Architecture, AttentionStack, architecture
from uptrain.architecture.converted import check_per_layer_layout
from uptrain.convert.calibration_seq2seq import site_moments
from uptrain.convert.kv_heads import (
    Allocation,
    KVHeadsRequest,
    head_weights,
    only_allocation,
    per_layer,
    resolve_allocation,
)
from uptrain.convert.layer_merge import LayerMerger, LayerSolution, SiteMergers, merges_whole_layers
from uptrain.convert.layer_tensors import join_qkv, split_qkv
from uptrain.convert.plan import ConversionPlan, PlannedTensor, choose_attentions, plan_conversion
from uptrain.convert.pooling import PoolingContext, RowPooling, Strategy, pool_rows
from uptrain.model_info import AttentionGeometry


class TensorHeader(Protocol):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class TensorSource(Protocol):
    """Where a conversion reads tensors: a checkpoint's shards (`SourceCheckpoint`) or a model's
    state dict (`in_memory.StateDictSource`)."""

    tensors: Mapping[str, TensorHeader]

    def order(self) -> list[TensorHeader]: ...

    def read_tensor(self, name: str) -> torch.Tensor: ...


@dataclass
class Calibration:
    """Per-layer second moments of the attention input, augmented with a constant 1
    ((hidden + 1)², see `uptrain.convert.calibration`), and a description for provenance.

    `solved`: what `calibrate` decided from each layer's moment as soon as it was complete (the
    moments themselves are then empty); it holds for the conversion it was made for (`solved_for`),
    whereas moments serve any conversion of the source."""

    moments: Mapping[int, torch.Tensor]
    info: dict = field(default_factory=dict)
    solved: Mapping[int, LayerSolution] = field(default_factory=dict)
    solved_for: tuple | None = None
    # `--allocation calibrated`: per converted attention, per layer, each candidate G's cost
    # (`allocation.py`), what chose the allocation; None otherwise.
    allocation_costs: dict[str, list[dict[int, float]]] | None = None
    allocation_cost: str | None = None  # which cost that is: "loss" (measured) or "merge"
    # `--value-fit output` (encoder–decoders): per attention, layer → its merge with the values refit
    # (`pipeline.fit_values`), for the conversion `solved_for` names; None: not refit.
    site_solved: dict[str, dict[int, LayerSolution]] | None = None


@dataclass(frozen=True)
class Conversion:
    """What a conversion does to one source. `plan` is None until `planned`."""

    config: dict
    arch: Architecture
    strategy: Strategy
    grouping: str
    allocation: Allocation  # each pooled attention's KV heads per layer (`kv_heads.resolve_allocation`)
    seed: int
    stacks: Mapping[str, AttentionStack]
    attention: tuple[str, ...]  # the attentions whose K/V are pooled
    plan: ConversionPlan | None = None
    # `--allocation calibrated`'s budget until calibration chooses the allocation (`allocation.py`,
    # `settle_allocation`); meanwhile `allocation` is the smallest (one KV head per layer).
    pending_budget: float | None = None
    # `--allocation calibrated` at a budget that leaves one allocation (`kv_heads.only_allocation`):
    # taken as it is, no cost measured (uptrain.json and the card say so).
    allocation_forced: bool = False
    # `--cross-kv-weight`: a cross-attention KV head's weight in the budget (`kv_heads.head_weights`).
    cross_kv_weight: float | None = None

    @property
    def head_weights(self) -> dict[str, int]:
        """What one KV head of each converted attention weighs in the budget (`kv_heads.head_weights`)."""
        geometries = {name: self.stacks[name].geometry for name in self.attention}
        return head_weights(geometries, self.attention, self.cross_kv_weight)

    @property
    def geometry(self) -> AttentionGeometry:
        """The decoder self-attention's (a decoder-only model's one attention)."""
        return self.stacks[DECODER_SELF].geometry

    @property
    def init_std(self) -> float:
        return self.arch.init_std(self.config)

    def uses_calibration(self, data_given: bool) -> bool:
        """Whether the conversion reads calibration statistics: when its strategy needs them, and
        for a whole-layer grouping when calibration data is given (without it, heads are
        compared in weight space); and always to choose a calibrated allocation."""
        return (
            self.strategy.needs_calibration
            or self.pending_budget is not None
            or (merges_whole_layers(self.strategy, self.grouping) and data_given)
        )

    def planned(self, source: TensorSource, cast: torch.dtype | None = None) -> Conversion:
        """This conversion with the plan of every output tensor of `source` (`cast`: the
        floating-point dtype of the output, None: the source's)."""
        plan = plan_conversion(
            source, self.arch, self.stacks, self.attention, self.allocation, cast, self.strategy, self.grouping
        )
        return replace(self, plan=plan)

    def merger(
        self, source: TensorSource, calibration: Calibration | None, progress: bool | None = None
    ) -> LayerMerger | SiteMergers:
        """The merger of whole layers (used only by a plan with whole-layer tensors): a
        decoder-only model's one attention's, or one per chosen attention of an encoder–decoder
        (each reading its own moments, `calibration_seq2seq.site_moments`)."""
        if not self.arch.encoder_decoder:
            moments = calibration.moments if calibration else None
            return self._site_merger(
                DECODER_SELF, source, moments, calibration.solved if calibration else None, progress
            )
        refit = (calibration.site_solved if calibration else None) or {}
        return SiteMergers(
            {
                name: self._site_merger(
                    name,
                    source,
                    site_moments(calibration.moments, name) if calibration else None,
                    refit.get(name),
                    progress,
                )
                for name in self.attention
            }
        )

    def _site_merger(self, name: str, source: TensorSource, moments, solutions, progress) -> LayerMerger:
        stack = self.stacks[name]
        return LayerMerger(
            source,
            stack.layout,
            stack.geometry,
            self.allocation[name],
            self.strategy,
            self.grouping,
            self.arch.rotary_dims(self.config, stack.geometry.head_dim),
            moments,
            self.seed,
            self.init_std,
            progress,
            solutions=solutions,
            rotary_pairs=self.arch.rotary.pairs if self.arch.rotary is not None else "half",
        )

    def compute(self, t: PlannedTensor, source: TensorSource, merger: LayerMerger) -> torch.Tensor:
        """The output tensor `t` of every kind but "copy" (whose bytes a writer may stream straight through)."""
        geo, g = t.geometry, t.num_kv_heads  # the layer's source geometry and output KV heads
        ctx = PoolingContext(t.role, t.out.name, self.seed, self.init_std)
        if t.kind == "layer":
            return merger.tensor(t.layer, t.out.name).to(t.out.dtype)
        if t.kind == "cast":
            return source.read_tensor(t.sources[0]).to(t.out.dtype)
        # The remaining kinds are planned only for row pooling (whole-layer plans use "layer").
        if t.kind == "rows":
            return pool_rows(source.read_tensor(t.sources[0]), g, geo.head_dim, self.strategy, ctx).to(t.out.dtype)
        if t.kind == "fused":
            return pool_fused(source.read_tensor(t.sources[0]), geo, g, t.order, t.axis, self.strategy, ctx).to(
                t.out.dtype
            )
        if t.kind == "per_head":
            heads = torch.stack([source.read_tensor(n) for n in t.sources])  # [r, *shape]
            stacked = heads.unsqueeze(0).unsqueeze(2)  # one group, head_dim axis of size 1
            compute = torch.float64 if heads.dtype == torch.float64 else torch.float32
            return self.strategy.fn(stacked.to(compute), ctx).reshape(t.out.shape).to(t.out.dtype)
        raise AssertionError(t.kind)


def conversion_for(
    config: dict, kv_heads: KVHeadsRequest | int, strategy: Strategy, grouping: str, attention: str, seed: int
) -> Conversion:
    """Every check a source's config decides (its architecture, the attentions `attention`
    chooses and each layer's KV heads against them, the strategy's own), before any tensor is
    read. `kv_heads`: what was asked for (one G, per-layer lists or a budget), resolved here once."""
    arch = architecture(config.get("model_type"))
    stacks, chosen = choose_attentions(config, arch, attention)
    geometries = {name: stack.geometry for name, stack in stacks.items()}
    allocation = resolve_allocation(geometries, chosen, kv_heads)
    pending = kv_heads.budget if isinstance(kv_heads, KVHeadsRequest) and kv_heads.needs_calibration else None
    # A budget with one allocation within it needs no cost to choose it (nor the calibration that measures one).
    weight = kv_heads.cross_kv_weight if isinstance(kv_heads, KVHeadsRequest) else None
    forced = pending is not None and (only := only_allocation(geometries, chosen, pending, weight)) is not None
    if forced:
        allocation, pending = only, None
    if per_layer(allocation) or pending is not None:  # a calibrated allocation may give layers their own heads
        check_per_layer_layout(arch)
    strategy.check_source(config, arch)
    planning = {"pending_budget": pending, "allocation_forced": forced, "cross_kv_weight": weight}
    return Conversion(config, arch, strategy, grouping, allocation, seed, stacks, chosen, **planning)


def pool_fused(
    qkv: torch.Tensor,
    geo: AttentionGeometry,
    g: int,
    order: str,
    axis: int,
    strategy: RowPooling,
    ctx: PoolingContext,
) -> torch.Tensor:
    """Pool the K and V heads of a fused Q/K/V tensor to `g` heads; Q keeps its bits.

    `order` "blocks": `[Q | K | V]` along `axis`; "per_group": `[kv, r + 2, d]` along `axis`
    (each KV head's r query heads, its K, its V), written back as `[g, h/g + 2, d]`.
    """
    h, kv, d = geo.num_heads, geo.num_kv_heads, geo.head_dim
    q, k, v = split_qkv(qkv, h, kv, d, order, axis)
    k = pool_rows(k, g, d, strategy, PoolingContext(ctx.role, ctx.tensor_name + ":k", ctx.seed, ctx.init_std))
    v = pool_rows(v, g, d, strategy, PoolingContext(ctx.role, ctx.tensor_name + ":v", ctx.seed, ctx.init_std))
    return join_qkv(q, k, v, d, order, axis)
