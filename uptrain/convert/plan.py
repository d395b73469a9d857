"""The plan of a conversion: every output tensor's name, dtype, shape and source, decided
from the source's headers before any byte is written (`uptrain.convert.stream` executes it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from uptrain import UptrainError
from uptrain.checkpoint.reader import SourceCheckpoint
from uptrain.checkpoint.writer import OutputEntry
from uptrain.convert.grouping import kv_groups
from uptrain.convert.layer_merge import merges_whole_layers, whole_layer_shapes
from uptrain.convert.layouts import AttentionLayout
from uptrain.convert.pooling import Role, Strategy
from uptrain.model_info import AttentionGeometry
from uptrain.modeling_table import MODELING

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PlannedTensor:
    out: OutputEntry
    sources: list[str]
    # "copy" (same bytes), "cast", "rows" (pooled rows), "fused" (Q|K|V), "per_head",
    # "layer" (rewritten by a whole-layer merge)
    kind: str
    role: Role = "weight"
    layer: int | None = None
    # "fused" only: where Q, K and V sit in the tensor (see AttentionLayout.fused_order).
    axis: int = 0
    order: str = "blocks"


@dataclass
class ConversionPlan:
    geometry: AttentionGeometry
    num_kv_heads: int
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.out.nbytes for t in self.tensors)


def _role(rel_name: str) -> Role:
    if rel_name.endswith(".bias"):
        return "bias"
    module = rel_name.rsplit(".", 1)[0]
    return "norm" if "norm" in module else "weight"


def plan_conversion(
    source: SourceCheckpoint,
    layout: AttentionLayout,
    geometry: AttentionGeometry,
    num_kv_heads: int,
    cast: torch.dtype | None,
    strategy: Strategy,
    grouping: str = "contiguous",
) -> ConversionPlan:
    """Decide every output tensor. Raises on a K/V tensor the layout does not describe.

    When the strategy or grouping merges whole layers, each layer's Q, K, V and O tensors are
    planned as one unit for `LayerMerger`.
    """
    g, h, kv, d = num_kv_heads, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
    tensors = source.tensors
    pooled: dict[str, PlannedTensor] = {}  # keyed by the first source tensor

    def out_dtype(name: str) -> torch.dtype:
        dtype = tensors[name].dtype
        return cast if cast is not None and dtype.is_floating_point else dtype

    whole_layer = merges_whole_layers(strategy, grouping)
    if whole_layer and geometry.model_type in MODELING:
        what = f"--pooling {strategy.name}" if strategy.whole_layer else f"--grouping {grouping}"
        raise UptrainError(
            f"{what} does not support {geometry.model_type} yet; use mean, first or random with contiguous grouping"
        )
    attn_prefix = layout.attn_prefix_in(tensors)
    kv_prefixes = []
    for layer in range(geometry.num_layers):
        prefix = attn_prefix.format(layer=layer) + "."
        kv_prefixes += [prefix + m + "." for m in layout.kv_modules]
        if whole_layer:
            for name, shape in whole_layer_shapes(tensors, layout, geometry, layer, g, strategy, grouping).items():
                pooled[name] = PlannedTensor(OutputEntry(name, out_dtype(name), shape), [name], "layer", layer=layer)
            continue
        for rel in layout.kv_rows:
            name = prefix + rel
            if name not in tensors:
                if rel.endswith("_proj.weight"):
                    raise UptrainError(f"{name} is missing: checkpoint does not match the {geometry.model_type} layout")
                continue
            rows, *rest = tensors[name].shape
            if rows != kv * d:
                raise UptrainError(f"{name} has {rows} rows, expected {kv} KV heads × {d} = {kv * d}")
            pooled[name] = PlannedTensor(OutputEntry(name, out_dtype(name), (g * d, *rest)), [name], "rows", _role(rel))
        for rel, role in ((layout.fused_qkv, "weight"), (layout.fused_qkv_bias, "bias")):
            if rel is None:
                continue
            name = prefix + rel
            if name not in tensors:
                if role == "bias":
                    continue
                raise UptrainError(f"{name} is missing: checkpoint does not match the {geometry.model_type} layout")
            shape = list(tensors[name].shape)
            axis = layout.fused_axis if role == "weight" else 0
            if len(shape) <= axis or shape[axis] != (h + 2 * kv) * d:
                raise UptrainError(
                    f"{name} has shape {tuple(shape)}, expected (Q {h} + K {kv} + V {kv}) × {d} = "
                    f"{(h + 2 * kv) * d} along dim {axis}"
                )
            shape[axis] = (h + 2 * g) * d
            pooled[name] = PlannedTensor(
                OutputEntry(name, out_dtype(name), tuple(shape)),
                [name],
                "fused",
                role,
                axis=axis,
                order=layout.fused_order,
            )
        for template in layout.per_head_kv:
            heads = [prefix + template.format(head=i) for i in range(kv)]
            present = [n in tensors for n in heads]
            if not any(present):
                continue
            if not all(present):
                raise UptrainError(f"{prefix}{template}: some KV heads are missing")
            for j, group in enumerate(kv_groups(kv, g)):
                members = [heads[i] for i in group]
                name = prefix + template.format(head=j)
                pooled[members[0]] = PlannedTensor(
                    OutputEntry(name, out_dtype(members[0]), tensors[members[0]].shape),
                    members,
                    "per_head",
                    _role(template),
                )

    consumed = {s for p in pooled.values() for s in p.sources}
    for name in tensors:
        if name not in consumed and name.startswith(tuple(kv_prefixes)):
            raise UptrainError(f"unknown tensor {name} inside a K/V module; refusing to guess how to pool it")

    plan = ConversionPlan(geometry, g)
    for info in source.order():
        if info.name in pooled:
            plan.tensors.append(pooled[info.name])
        elif info.name not in consumed:
            dtype = out_dtype(info.name)
            kind = "copy" if dtype == info.dtype else "cast"
            plan.tensors.append(
                PlannedTensor(OutputEntry(layout.output_name(info.name), dtype, info.shape), [info.name], kind)
            )
    return plan
