"""The plan of a conversion: every output tensor's name, dtype, shape and source, decided
from the source's headers before any byte is written (`uptrain.convert.stream` executes it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, Architecture, AttentionLayout, AttentionStack
from uptrain.checkpoint.reader import SourceCheckpoint
from uptrain.checkpoint.writer import OutputEntry
from uptrain.convert.grouping import kv_groups
from uptrain.convert.kv_heads import ATTENTION_NAMES, Allocation, layer_geometry
from uptrain.convert.layer_merge import merges_whole_layers, whole_layer_shapes
from uptrain.convert.pooling import Role, Strategy
from uptrain.convert.spec import parse_attention
from uptrain.model_info import AttentionGeometry

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
    # The source geometry of the layer a pooled tensor belongs to (an encoder–decoder's attentions
    # each have their own heads and head_dim; a per-layer source, each layer its own KV heads).
    geometry: AttentionGeometry | None = None
    num_kv_heads: int | None = None  # a pooled tensor's: its layer's KV heads in the output


@dataclass
class ConversionPlan:
    geometry: AttentionGeometry  # the decoder self-attention's (a decoder-only model's only one)
    # Each converted attention's KV heads per layer (`kv_heads.resolve_allocation`).
    allocation: Allocation
    tensors: list[PlannedTensor] = field(default_factory=list)
    # Every attention of the model and the ones whose K/V were pooled (the allocation's).
    stacks: dict[str, AttentionStack] = field(default_factory=dict)
    attention: tuple[str, ...] = (DECODER_SELF,)

    @property
    def total_bytes(self) -> int:
        return sum(t.out.nbytes for t in self.tensors)

    @property
    def encoder_decoder(self) -> bool:
        return len(self.stacks) > 1

    @property
    def config_kv_heads(self) -> int | tuple[int, ...] | dict[str, int | tuple[int, ...]]:
        """What config.json records (`gqa_config`): G (or each layer's KV heads), or an
        encoder–decoder's per attention."""
        after = self.kv_heads_after()
        return after if self.encoder_decoder else after[DECODER_SELF]

    def kv_heads_after(self) -> dict[str, int | tuple[int, ...]]:
        """Each attention's KV heads in the output: its allocation where converted, the source's
        elsewhere; one number where every layer has it, else one per layer."""
        return {
            name: _one_or_each(self.allocation[name] if name in self.allocation else stack.geometry.layer_kv_heads())
            for name, stack in self.stacks.items()
        }


def _one_or_each(heads: tuple[int, ...]) -> int | tuple[int, ...]:
    return heads[0] if len(set(heads)) == 1 else heads


def choose_attentions(
    config: dict, arch: Architecture, attention: str
) -> tuple[dict[str, AttentionStack], tuple[str, ...]]:
    """Every attention of the model and those `--attention` chooses (their KV heads:
    `kv_heads.resolve_allocation`). The default (the decoder's self- and cross-attention) means a
    decoder-only model's one attention; a list naming an attention the model lacks is refused,
    unless it is the cross-attention beside the self-attention of a decoder without one."""
    stacks = arch.stacks(config)
    named = parse_attention(attention)
    chosen = tuple(a for a in named if a in stacks)
    lacking = [a for a in named if a not in stacks]
    if not chosen or any(a != "cross" for a in lacking):
        raise UptrainError(
            f"--attention {attention}: {config.get('model_type')} is decoder-only, its one attention is "
            f"{', '.join(stacks)}"
        )
    return stacks, chosen


def _role(rel_name: str) -> Role:
    if rel_name.endswith(".bias"):
        return "bias"
    module = rel_name.rsplit(".", 1)[0]
    return "norm" if "norm" in module else "weight"


def plan_conversion(
    source: SourceCheckpoint,
    arch: Architecture,
    stacks: Mapping[str, AttentionStack],
    attention: Sequence[str],
    allocation: Allocation,
    cast: torch.dtype | None,
    strategy: Strategy,
    grouping: str = "contiguous",
) -> ConversionPlan:
    """Decide every output tensor. Raises on a K/V tensor the layout does not describe.

    `stacks` are the model's attentions (`choose_attentions`) and `attention` those whose K/V
    are pooled, each layer to its KV heads in `allocation`: every other tensor, the K/V of the
    attentions not chosen included, is copied. When the strategy or grouping merges whole layers, each layer's Q, K,
    V and O tensors are planned as one unit for `LayerMerger`.
    """
    geometry = stacks[DECODER_SELF].geometry
    tensors = source.tensors
    pooled: dict[str, PlannedTensor] = {}  # keyed by the first source tensor

    def out_dtype(name: str) -> torch.dtype:
        dtype = tensors[name].dtype
        return cast if cast is not None and dtype.is_floating_point else dtype

    by_layer = merges_whole_layers(strategy, grouping)
    if grouping == "similarity":
        for name in attention:
            _check_renumberable(tensors, arch, stacks[name], name)
    kv_prefixes = []
    for name in attention:
        stack = stacks[name]
        kv_prefixes += _plan_stack(
            tensors, stack.layout, stack.geometry, allocation[name], out_dtype, pooled, by_layer, strategy, grouping
        )

    consumed = {s for p in pooled.values() for s in p.sources}
    for name in tensors:
        if name not in consumed and name.startswith(tuple(kv_prefixes)):
            raise UptrainError(f"unknown tensor {name} inside a K/V module; refusing to guess how to pool it")

    plan = ConversionPlan(geometry, dict(allocation), stacks=dict(stacks), attention=tuple(attention))
    for info in source.order():
        if info.name in pooled:
            plan.tensors.append(pooled[info.name])
        elif info.name not in consumed:
            dtype = out_dtype(info.name)
            kind = "copy" if dtype == info.dtype else "cast"
            plan.tensors.append(
                PlannedTensor(OutputEntry(arch.output_name(info.name), dtype, info.shape), [info.name], kind)
            )
    return plan


def _check_renumberable(tensors: dict, arch: Architecture, stack: AttentionStack, name: str) -> None:
    """Refuse renumbering the heads of an attention whose query-head tensors (a position bias)
    serve every layer of its stack: each layer's heads would need the bias in its own order."""
    if not arch.position_bias_shared:
        return
    layout = stack.layout
    prefix = layout.attn_prefix_in(tensors)
    for layer in range(stack.geometry.num_layers):
        for rel in layout.query_head_tensors:
            if f"{prefix.format(layer=layer)}.{rel}" in tensors:
                raise UptrainError(
                    f"--grouping similarity cannot renumber the heads of {arch.name}'s {ATTENTION_NAMES[name]}: "
                    f"its {rel.split('.')[0]} (one column per query head, in layer {layer}) serves every layer, "
                    "whose heads similarity orders differently; use contiguous grouping, or leave it out of --attention"
                )


def _plan_stack(
    tensors: dict,
    layout: AttentionLayout,
    stack_geometry: AttentionGeometry,
    allocation: tuple[int, ...],
    out_dtype,
    pooled: dict[str, PlannedTensor],
    by_layer: bool,
    strategy: Strategy,
    grouping: str,
) -> list[str]:
    """Plan the pooled K/V tensors of one attention's every layer (layer l to `allocation[l]` KV heads)
    into `pooled`; returns the name prefixes of its K/V modules (any tensor there must have been
    planned)."""
    attn_prefix = layout.attn_prefix_in(tensors)
    kv_prefixes = []
    for layer in range(stack_geometry.num_layers):
        geometry, g = layer_geometry(stack_geometry, layer), allocation[layer]
        h, kv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
        prefix = attn_prefix.format(layer=layer) + "."
        kv_prefixes += [prefix + m + "." for m in layout.kv_modules]
        if by_layer:  # the layer's Q, K, V and O as one unit for `LayerMerger`
            for name, shape in whole_layer_shapes(tensors, layout, geometry, layer, g, strategy, grouping).items():
                pooled[name] = PlannedTensor(OutputEntry(name, out_dtype(name), shape), [name], "layer", layer=layer)
            continue
        for rel in layout.kv_rows:
            name = prefix + rel
            if name not in tensors:
                if rel in layout.kv_weights:
                    raise UptrainError(f"{name} is missing: checkpoint does not match the {geometry.model_type} layout")
                continue
            rows, *rest = tensors[name].shape
            if rows != kv * d:
                raise UptrainError(f"{name} has {rows} rows, expected {kv} KV heads × {d} = {kv * d}")
            pooled[name] = PlannedTensor(
                OutputEntry(name, out_dtype(name), (g * d, *rest)),
                [name],
                "rows",
                _role(rel),
                geometry=geometry,
                num_kv_heads=g,
            )
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
                geometry=geometry,
                num_kv_heads=g,
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
                    geometry=geometry,
                    num_kv_heads=g,
                )
    return kv_prefixes
