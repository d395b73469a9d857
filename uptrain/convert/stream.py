"""Executing a conversion plan: each planned tensor computed (copied, cast, pooled or merged)
and streamed into bounded safetensors shards, one tensor in memory at a time."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from uptrain.checkpoint.reader import COPY_CHUNK_BYTES, SourceCheckpoint, tensor_bytes
from uptrain.checkpoint.writer import ShardedWriter
from uptrain.convert.layer_merge import LayerMerger
from uptrain.convert.plan import ConversionPlan, PlannedTensor
from uptrain.convert.pooling import PoolingContext, Strategy, pool_rows
from uptrain.model_info import AttentionGeometry

# Planned kinds pooled on a second thread, up to a layer's K and V ahead (see write_weights).
POOLED_KINDS = ("rows", "fused", "per_head")
COMPUTE_AHEAD = 2


def compute_tensor(
    t: PlannedTensor,
    source: SourceCheckpoint,
    plan: ConversionPlan,
    strategy: Strategy,
    seed: int,
    init_std: float,
    merger: LayerMerger | None,
) -> torch.Tensor:
    """The output tensor `t` of every kind but "copy" (whose bytes stream straight through)."""
    geo, g = t.geometry or plan.geometry, plan.num_kv_heads
    ctx = PoolingContext(t.role, t.out.name, seed, init_std)
    if t.kind == "layer":
        return merger.tensor(t.layer, t.out.name).to(t.out.dtype)
    if t.kind == "cast":
        return source.read_tensor(t.sources[0]).to(t.out.dtype)
    if t.kind == "rows":
        return pool_rows(source.read_tensor(t.sources[0]), g, geo.head_dim, strategy, ctx).to(t.out.dtype)
    if t.kind == "fused":
        return pool_fused(
            source.read_tensor(t.sources[0]),
            geo,
            g,
            t.order,
            t.axis,
            strategy,
            PoolingContext(t.role, t.out.name, seed, init_std),
        ).to(t.out.dtype)
    if t.kind == "per_head":
        heads = torch.stack([source.read_tensor(n) for n in t.sources])  # [r, *shape]
        stacked = heads.unsqueeze(0).unsqueeze(2)  # one group, head_dim axis of size 1
        compute = torch.float64 if heads.dtype == torch.float64 else torch.float32
        return strategy.fn(stacked.to(compute), ctx).reshape(t.out.shape).to(t.out.dtype)
    raise AssertionError(t.kind)


def pool_fused(
    qkv: torch.Tensor, geo: AttentionGeometry, g: int, order: str, axis: int, strategy: Strategy, ctx: PoolingContext
) -> torch.Tensor:
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


def write_weights(
    plan: ConversionPlan,
    source: SourceCheckpoint,
    folder: Path,
    strategy: Strategy,
    seed: int,
    init_std: float,
    max_shard_bytes: int,
    progress: bool | None,
    merger: LayerMerger,
) -> None:
    """Every planned tensor, in plan order, into shards of at most `max_shard_bytes` in `folder`."""
    metadata = {k: str(v) for k, v in source.metadata.items()}
    chunk = bytearray(COPY_CHUNK_BYTES)
    bar = tqdm(
        total=plan.total_bytes,
        unit="B",
        unit_scale=True,
        desc="convert",
        disable=None if progress is None else not progress,
    )
    # Pooled K/V tensors are computed, in plan order, on a second thread while this one copies
    # the tensors between them; at most COMPUTE_AHEAD results wait in memory. Casts and
    # whole-layer merges run here: computing them ahead would hold more than one tensor
    # (or layer) at a time.
    to_compute = iter([t for t in plan.tensors if t.kind in POOLED_KINDS])
    ahead: deque[Future] = deque()

    def compute_next() -> None:
        if (t := next(to_compute, None)) is not None:
            ahead.append(worker.submit(compute_tensor, t, source, plan, strategy, seed, init_std, merger))

    with bar, ThreadPoolExecutor(max_workers=1, thread_name_prefix="uptrain-pool") as worker:
        try:
            for _ in range(COMPUTE_AHEAD):
                compute_next()
            with ShardedWriter(folder, [t.out for t in plan.tensors], max_shard_bytes, metadata) as writer:
                for t in plan.tensors:
                    writer.begin(t.out.name)
                    if t.kind == "copy":
                        source.copy_raw(t.sources[0], writer.write, chunk)
                    elif t.kind in POOLED_KINDS:
                        tensor = ahead.popleft().result()
                        compute_next()
                        writer.write(tensor_bytes(tensor))
                    else:
                        writer.write(tensor_bytes(compute_tensor(t, source, plan, strategy, seed, init_std, merger)))
                    bar.update(t.out.nbytes)
        finally:
            for future in ahead:
                future.cancel()
