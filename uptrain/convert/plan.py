"""Plan and execute a conversion: every output tensor's name, dtype and shape is known
before any byte is written; then tensors stream source → output one at a time."""

from __future__ import annotations

import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from uptrain import UptrainError
from uptrain.convert.grouping import kv_groups
from uptrain.checkpoint.reader import COPY_CHUNK_BYTES, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, SourceCheckpoint
from uptrain.checkpoint.writer import OutputEntry, ShardWriter, tensor_bytes
from uptrain.convert.layer_merge import LayerMerger, merges_whole_layers, whole_layer_shapes
from uptrain.convert.layouts import AttentionLayout
from uptrain.convert.pooling import PoolingContext, Role, Strategy, pool_rows
from uptrain.model_info import AttentionGeometry
from uptrain.modeling import MODELING

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Planned kinds pooled on a second thread, up to a layer's K and V ahead (see _write_weights).
POOLED_KINDS = ("rows", "fused", "per_head")
COMPUTE_AHEAD = 2


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


def plan_conversion(source: SourceCheckpoint, layout: AttentionLayout, geometry: AttentionGeometry,
                    num_kv_heads: int, cast: torch.dtype | None, strategy: Strategy,
                    grouping: str = "contiguous") -> ConversionPlan:
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
        raise UptrainError(f"{what} does not support {geometry.model_type} yet; use mean, first or random "
                           "with contiguous grouping")
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
            pooled[name] = PlannedTensor(OutputEntry(name, out_dtype(name), (g * d, *rest)),
                                         [name], "rows", _role(rel))
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
                raise UptrainError(f"{name} has shape {tuple(shape)}, expected (Q {h} + K {kv} + V {kv}) × {d} = "
                                   f"{(h + 2 * kv) * d} along dim {axis}")
            shape[axis] = (h + 2 * g) * d
            pooled[name] = PlannedTensor(OutputEntry(name, out_dtype(name), tuple(shape)), [name], "fused", role,
                                         axis=axis, order=layout.fused_order)
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
                pooled[members[0]] = PlannedTensor(OutputEntry(name, out_dtype(members[0]), tensors[members[0]].shape),
                                                   members, "per_head", _role(template))

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
            plan.tensors.append(PlannedTensor(OutputEntry(layout.output_name(info.name), dtype, info.shape),
                                              [info.name], kind))
    return plan


def shard_plan(plan: ConversionPlan, max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split the plan, in order, into shards no larger than the limit (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in plan.tensors:
        if shards[-1] and size + t.out.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.out.nbytes
    return shards


def _compute(t: PlannedTensor, source: SourceCheckpoint, plan: ConversionPlan, strategy: Strategy,
             seed: int, init_std: float, merger: LayerMerger | None) -> torch.Tensor:
    geo, g = plan.geometry, plan.num_kv_heads
    ctx = PoolingContext(t.role, t.out.name, seed, init_std)
    if t.kind == "layer":
        return merger.tensor(t.layer, t.out.name).to(t.out.dtype)
    if t.kind == "cast":
        return source.read_tensor(t.sources[0]).to(t.out.dtype)
    if t.kind == "rows":
        return pool_rows(source.read_tensor(t.sources[0]), g, geo.head_dim, strategy, ctx).to(t.out.dtype)
    if t.kind == "fused":
        return pool_fused(source.read_tensor(t.sources[0]), geo, g, t.order, t.axis, strategy,
                          PoolingContext(t.role, t.out.name, seed, init_std)).to(t.out.dtype)
    if t.kind == "per_head":
        heads = torch.stack([source.read_tensor(n) for n in t.sources])  # [r, *shape]
        stacked = heads.unsqueeze(0).unsqueeze(2)  # one group, head_dim axis of size 1
        compute = torch.float64 if heads.dtype == torch.float64 else torch.float32
        return strategy.fn(stacked.to(compute), ctx).reshape(t.out.shape).to(t.out.dtype)
    raise AssertionError(t.kind)


def pool_fused(qkv: torch.Tensor, geo: AttentionGeometry, g: int, order: str, axis: int, strategy: Strategy,
               ctx: PoolingContext) -> torch.Tensor:
    """Pool the K and V heads of a fused Q/K/V tensor to `g` heads; Q keeps its bits.

    `order` "blocks": `[Q | K | V]` along `axis`; "per_group": `[kv, r + 2, d]` along `axis`
    (each KV head's r query heads, its K, its V), written back as `[g, h/g + 2, d]`.
    """
    h, kv, d = geo.num_heads, geo.num_kv_heads, geo.head_dim
    x = qkv.movedim(axis, 0)
    rest = x.shape[1:]
    if order == "blocks":
        q, k, v = x.split([h * d, kv * d, kv * d])
    else:
        heads = x.reshape(kv, h // kv + 2, d, *rest)
        q, k, v = (part.reshape(-1, *rest) for part in (heads[:, :-2], heads[:, -2], heads[:, -1]))
    k = pool_rows(k, g, d, strategy, PoolingContext(ctx.role, ctx.tensor_name + ":k", ctx.seed, ctx.init_std))
    v = pool_rows(v, g, d, strategy, PoolingContext(ctx.role, ctx.tensor_name + ":v", ctx.seed, ctx.init_std))
    if order == "blocks":
        out = torch.cat([q, k, v])
    else:
        out = torch.cat([q.reshape(g, h // g, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return out.reshape((h + 2 * g) * d, *rest).movedim(0, axis)


def write_weights(plan: ConversionPlan, source: SourceCheckpoint, folder: Path, strategy: Strategy,
                   seed: int, init_std: float, max_shard_bytes: int, progress: bool | None,
                   merger: LayerMerger) -> None:
    shards = shard_plan(plan, max_shard_bytes)
    metadata = {**{k: str(v) for k, v in source.metadata.items()}, "format": "pt"}
    names = ([SAFETENSORS_SINGLE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    chunk = bytearray(COPY_CHUNK_BYTES)
    weight_map = {}
    bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="convert",
               disable=None if progress is None else not progress)
    # Pooled K/V tensors are computed, in plan order, on a second thread while this one copies
    # the tensors between them; at most COMPUTE_AHEAD results wait in memory. Casts and
    # whole-layer merges run here: computing them ahead would hold more than one tensor
    # (or layer) at a time.
    to_compute = iter([t for t in plan.tensors if t.kind in POOLED_KINDS])
    ahead: deque[Future] = deque()

    def compute_next() -> None:
        if (t := next(to_compute, None)) is not None:
            ahead.append(worker.submit(_compute, t, source, plan, strategy, seed, init_std, merger))

    with bar, ThreadPoolExecutor(max_workers=1, thread_name_prefix="uptrain-pool") as worker:
        try:
            for _ in range(COMPUTE_AHEAD):
                compute_next()
            for shard_name, shard in zip(names, shards):
                with ShardWriter(folder / shard_name, [t.out for t in shard], metadata) as writer:
                    for t in shard:
                        writer.begin(t.out.name)
                        if t.kind == "copy":
                            source.copy_raw(t.sources[0], writer.write, chunk)
                        elif t.kind in POOLED_KINDS:
                            tensor = ahead.popleft().result()
                            compute_next()
                            writer.write(tensor_bytes(tensor))
                        else:
                            writer.write(tensor_bytes(_compute(t, source, plan, strategy, seed, init_std, merger)))
                        weight_map[t.out.name] = shard_name
                        bar.update(t.out.nbytes)
        finally:
            for future in ahead:
                future.cancel()
    if len(shards) > 1:
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
