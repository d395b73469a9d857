"""Executes whole-layer conversions (calibrated merge, similarity grouping) while streaming.

The converter asks for one output tensor at a time in file order; the first request for a
layer reads that layer's Q, K, V and O, merges them, and keeps the results until each has
been written. Memory: one layer's attention projections.

What a merge takes from the layer's calibration moment C is decided by `LayerMerger.solve`
(a `LayerSolution`: the similarity order, the calibrated merge's maps and scales, O(kv·d²)):
calibration calls it as soon as each layer's C is complete, on the device C is on, and drops C
(`pipeline.calibrate`); given moments instead (`uptrain compare` reuses them across
conversions), the merge solves each layer when it is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from uptrain import UptrainError
from uptrain.architecture import AttentionLayout
from uptrain.checkpoint.reader import SourceCheckpoint
from uptrain.convert.calibrated import (
    CrossMoments,
    LayerAttention,
    head_similarity,
    input_moment,
    permute_kv_heads,
    query_order,
    similarity_order,
)
from uptrain.convert.kv_heads import layer_geometry
from uptrain.convert.layer_tensors import (
    FIELDS,
    kv_field_name,
    merge_tensor_names,
    merged_shapes,
    read_fields,
    written_tensors,
)
from uptrain.convert.pooling import FieldContext, PoolingContext, Strategy
from uptrain.model_info import AttentionGeometry


def merges_whole_layers(strategy: Strategy, grouping: str) -> bool:
    """Whether a conversion reads each layer's Q, K, V and O together (and can use calibration):
    the strategy merges whole layers, or the grouping compares whole heads."""
    return strategy.merges_layers or grouping != "contiguous"


def whole_layer_option(strategy: Strategy, grouping: str) -> str:
    """The option that makes a conversion merge whole layers, as messages name it."""
    return f"--pooling {strategy.name}" if strategy.merges_layers else f"--grouping {grouping}"


def _per_head_module(rel: str) -> bool:
    """Whether a tensor belongs to one module per head (StableLM's `k_layernorm.norms.3.weight`):
    a path component that is a head index."""
    return any(part.isdigit() for part in rel.split("."))


def check_whole_layer_support(
    layout: AttentionLayout,
    strategy: Strategy,
    grouping: str,
    model_type: str,
    extra_tensors: dict[str, tuple[int, ...]],
    head_dim: int,
    prefix: str = "",
) -> None:
    """Refuse a layer whose attention tensors would break the merge's exactness.

    Decided from the checkpoint's tensors (`extra_tensors`: the layer's attention tensors besides
    Q, K, V, O and their biases, names relative to `prefix` → shapes), not from `model_type`:
    StableLM without qk-layernorm is a plain layout, with it one norm per head.
    """
    what = whole_layer_option(strategy, grouping)
    for name, shape in extra_tensors.items():
        if _per_head_module(name):
            # Each head's own norm would have to follow its head through renumbering and merging.
            raise UptrainError(
                f"{what} cannot carry {prefix}{name} through the merge "
                f"({model_type} per-head q/k norms); use mean, first or random with contiguous grouping"
            )
        # A norm shared by all heads over head_dim survives renumbering heads, not per-head maps
        # folded into the queries: it acts between the projection and the score, and a
        # normalisation commutes with no map but an orthogonal one (which a q norm then breaks).
        if strategy.folds_into_queries or shape != (head_dim,):
            raise UptrainError(
                f"{what} cannot carry {prefix}{name} through the merge ({model_type} q/k norms: they act "
                "after the projections, and the per-head maps folded into q_proj and o_proj do not "
                "commute with a normalisation); use mean, first or random with contiguous grouping"
            )


def whole_layer_shapes(
    tensors: dict,
    layout: AttentionLayout,
    geometry: AttentionGeometry,
    layer: int,
    g: int,
    strategy: Strategy,
    grouping: str,
) -> dict[str, tuple[int, ...]]:
    """Output shapes of the tensors one layer's merge rewrites; refuses what the merge cannot carry.

    `tensors` maps every source tensor name to its header (anything with a `.shape`).
    """
    prefix = layout.attn_prefix_in(tensors).format(layer=layer) + "."
    names = merge_tensor_names(layout)
    kept = (*names, f"{layout.o_proj}.bias", *layout.query_head_tensors)
    extra = {
        n[len(prefix) :]: tuple(tensors[n].shape)
        for n in tensors
        if n.startswith(prefix) and n[len(prefix) :] not in kept
    }
    check_whole_layer_support(layout, strategy, grouping, geometry.model_type, extra, geometry.head_dim, prefix)
    present = {rel: tuple(tensors[prefix + rel].shape) for rel in names if prefix + rel in tensors}
    shapes = {prefix + rel: shape for rel, shape in merged_shapes(present, layout, geometry, g, prefix).items()}
    if grouping == "similarity":  # renumbered heads take their query-head tensors (UMT5's bias) along
        for rel in layout.query_head_tensors:
            if prefix + rel in tensors:
                shapes[prefix + rel] = tuple(tensors[prefix + rel].shape)
    return shapes


@dataclass
class LayerSolution:
    """What one layer's whole-layer merge takes from its moment C."""

    order: list[int] | None  # similarity grouping: the source KV heads in their new order
    merge: Any  # the strategy's own solution (`Strategy.solve`; the calibrated merge's maps and scales)

    def to(self, device) -> LayerSolution:
        return LayerSolution(self.order, None if self.merge is None else self.merge.to(device))


class LayerMerger:
    """Merges one layer at a time, when the converter first asks for one of its tensors.

    `calibration` maps a layer to its moment C (a lazy mapping is read one layer at a time);
    None compares heads in weight space. `num_kv_heads`: each layer's KV heads after the merge (an
    int: every layer's). `solutions`: layers already solved (`solve`), whose moments are not needed.
    `progress`: a bar over layers (None: on terminals). `rotary_dim` and `rotary_pairs`: the dims
    of each head RoPE rotates and how they pair (`LayerAttention`).
    """

    def __init__(
        self,
        source: SourceCheckpoint,
        layout: AttentionLayout,
        geometry: AttentionGeometry,
        num_kv_heads: int | tuple[int, ...],
        strategy: Strategy,
        grouping: str,
        rotary_dim: int,
        calibration: Mapping[int, torch.Tensor] | None,
        seed: int,
        init_std: float,
        progress: bool | None = None,
        solutions: Mapping[int, LayerSolution] | None = None,
        rotary_pairs: str = "half",
    ):
        self.source, self.layout, self.geometry = source, layout, geometry
        self.solutions = dict(solutions or {})
        if isinstance(num_kv_heads, int):
            num_kv_heads = (num_kv_heads,) * geometry.num_layers
        self.allocation, self.strategy, self.grouping = tuple(num_kv_heads), strategy, grouping
        self.rotary_dim, self.rotary_pairs = rotary_dim, rotary_pairs
        self.calibration, self.seed, self.init_std = calibration, seed, init_std
        self.attn_prefix = layout.attn_prefix_in(source.tensors)
        self.kv_orders: dict[int, list[int]] = {}  # layer → source KV heads in their new order
        self._layer: int | None = None
        self._outputs: dict[str, torch.Tensor] = {}
        self._progress = progress
        self._bar: tqdm | None = None  # made at the first merge: plain conversions never show it

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        if layer != self._layer:
            if self._bar is None:
                self._bar = tqdm(
                    total=self.geometry.num_layers,
                    desc="merge",
                    unit="layer",
                    disable=None if self._progress is None else not self._progress,
                )
            self._outputs = self._merge(layer)
            self._layer = layer
            self._bar.update(1)
            if self._bar.n >= self._bar.total:
                self._bar.close()
        return self._outputs.pop(name)

    def _second_moment(self, layer: int) -> torch.Tensor | CrossMoments:
        if self.calibration is not None:
            return self.calibration[layer].to(torch.float64)
        return torch.eye(self.geometry.hidden_size + 1, dtype=torch.float64)  # weight-space similarity

    def _read_layer(self, layer: int, device: torch.device | str = "cpu") -> tuple[LayerAttention, dict]:
        """The layer's attention projections in float64 on `device`, and each tensor's stored dtype."""
        prefix = self.attn_prefix.format(layer=layer) + "."
        geo = layer_geometry(self.geometry, layer)  # the layer's own KV heads, where a source's layers differ
        dtypes = {}

        def read(rel: str) -> torch.Tensor | None:
            if prefix + rel not in self.source.tensors:
                return None
            t = self.source.read_tensor(prefix + rel)
            dtypes[rel] = t.dtype
            return t.to(device=device, dtype=torch.float64)

        attention = LayerAttention(
            **read_fields(read, self.layout, geo),
            num_heads=geo.num_heads,
            num_kv_heads=geo.num_kv_heads,
            head_dim=geo.head_dim,
            rotary_dim=self.rotary_dim,
            rotary_pairs=self.rotary_pairs,
        )
        return attention, dtypes

    def attention(self, layer: int) -> LayerAttention:
        """The layer's source attention projections (float64, on the CPU), as the merge reads them."""
        return self._read_layer(layer)[0]

    def _solve(self, attention: LayerAttention, c: torch.Tensor | CrossMoments, g: int) -> LayerSolution:
        order = None
        if self.grouping == "similarity":
            order = similarity_order(head_similarity(attention, input_moment(c)).cpu(), g)
            attention = permute_kv_heads(attention, order)
        return LayerSolution(order, self.strategy.solve(attention, g, c))

    def solved(self, layer: int) -> tuple[LayerSolution, LayerAttention]:
        """`layer`'s solution from its moment, and its source projections in the solution's head
        order (similarity grouping renumbers them): what `--value-fit output` refits."""
        attention = self.attention(layer)
        solution = self._solve(attention, self._second_moment(layer), self.allocation[layer])
        if solution.order is not None:
            attention = permute_kv_heads(attention, solution.order)
        return solution, attention

    def solve(self, layer: int, c: torch.Tensor) -> None:
        """Decide what `layer`'s merge takes from its moment `c` ([(D+1)², float64), on c's device
        (a GPU's float64 when calibration ran there), and keep it (on the CPU) for the write."""
        if self.keeps_heads(layer):
            return  # nothing to solve: `_merge` writes the layer as read
        attention, _ = self._read_layer(layer, c.device)
        self.solutions[layer] = self._solve(attention, c, self.allocation[layer]).to("cpu")

    def keeps_heads(self, layer: int) -> bool:
        """Whether `layer` keeps its source KV heads (a per-layer allocation's G = kv) under a
        whole-layer merge (calibrated): nothing to merge. Row pooling under similarity grouping
        pools as under contiguous grouping, so `random` gives a kept layer fresh heads either way."""
        return (
            self.strategy.merges_layers and self.allocation[layer] == layer_geometry(self.geometry, layer).num_kv_heads
        )

    def _merge(self, layer: int) -> dict[str, torch.Tensor]:
        prefix = self.attn_prefix.format(layer=layer) + "."
        attention, dtypes = self._read_layer(layer)
        if self.keeps_heads(layer):
            # Copied as read, not solved: with one source head per group the calibrated merge is the
            # identity only in exact arithmetic — it divides by the queries' weakest directions (Whisper
            # base's decoder self-attention at 8 of 8 heads came out with logit errors of 1e11).
            fields = {f: getattr(attention, f) for f in FIELDS}
            written = written_tensors(fields, self.layout, self.geometry.head_dim)
            as_read = self._query_head_tensors(prefix, list(range(attention.num_heads)))  # heads in their order
            return as_read | {prefix + rel: t.to(dtypes[rel]).contiguous() for rel, t in written.items()}
        g = self.allocation[layer]
        solution = self.solutions.pop(layer, None)
        if solution is None:
            solution = self._solve(attention, self._second_moment(layer), g)
        renumbered = {}
        if solution.order is not None:
            attention = permute_kv_heads(attention, solution.order)
            self.kv_orders[layer] = solution.order
            renumbered = self._query_head_tensors(prefix, query_order(solution.order, attention.n_rep))

        attention = self.strategy.pool_layer(attention, g, solution.merge, self.field_context(layer))
        fields = {f: getattr(attention, f) for f in FIELDS}
        return renumbered | {
            prefix + rel: t.to(dtypes[rel]).contiguous()
            for rel, t in written_tensors(fields, self.layout, self.geometry.head_dim).items()
        }

    def field_context(self, layer: int) -> FieldContext:
        """Each K/V field's pooling context in `layer` (row pooling of a whole layer: similarity
        grouping, or a pooling's allocation cost): the field seeded by its tensor's name."""
        prefix = self.attn_prefix.format(layer=layer) + "."

        def context(field: str) -> PoolingContext:
            role = "bias" if field.endswith("_b") else "weight"
            return PoolingContext(role, prefix + kv_field_name(self.layout, field), self.seed, self.init_std)

        return context

    def _query_head_tensors(self, prefix: str, queries: list[int]) -> dict[str, torch.Tensor]:
        """The layer's tensors indexed by query head (`AttentionLayout.query_head_tensors`, along
        their last axis), their columns in the renumbered heads' order: bits moved, none changed."""
        out = {}
        for rel in self.layout.query_head_tensors:
            if prefix + rel in self.source.tensors:
                t = self.source.read_tensor(prefix + rel)
                out[prefix + rel] = t[..., torch.tensor(queries)].contiguous()
        return out


class SiteMergers:
    """The mergers of an encoder–decoder's chosen attentions, one `LayerMerger` each: a tensor
    goes to the one whose attention module holds it."""

    def __init__(self, mergers: dict[str, LayerMerger]):
        self.mergers = mergers

    @property
    def kv_orders(self) -> dict[str, dict[int, list[int]]]:
        """Similarity grouping: per attention renumbered, layer → its source KV heads in their new order."""
        return {name: merger.kv_orders for name, merger in self.mergers.items() if merger.kv_orders}

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        for merger in self.mergers.values():
            if name.startswith(merger.attn_prefix.format(layer=layer) + "."):
                return merger.tensor(layer, name)
        raise KeyError(name)
