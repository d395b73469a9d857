"""Plan and execute a conversion: every output tensor's name, dtype and shape is known
before any byte is written; then tensors stream source → output one at a time."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

import uptrain
from uptrain import UptrainError
from uptrain.convert.grouping import check_num_kv_heads, kv_groups, query_to_kv
from uptrain.convert.hashing import HASH_CHOICES, BackgroundHasher
from uptrain.convert.io import (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, COPY_CHUNK_BYTES, OutputEntry,
                                ShardWriter, SourceCheckpoint, tensor_bytes)
from uptrain.convert.layer_merge import (GROUPINGS, LayerMerger, check_whole_layer_support,
                                         layer_tensor_names, merges_whole_layers)
from uptrain.convert.layouts import AttentionLayout, layout_for
from uptrain.convert.pooling import PoolingContext, Role, Strategy, get_strategy, pool_rows
from uptrain.fsutil import atomic_directory, check_output_path
from uptrain.model_info import AttentionGeometry, attention_geometry, read_config, rotary_dim

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Planned kinds pooled on a second thread, up to a layer's K and V ahead (see _write_weights).
POOLED_KINDS = ("rows", "fused", "per_head")
COMPUTE_AHEAD = 2
# Files besides the weights that make the output a usable checkpoint.
SIDE_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                      "merges.txt", "*.model", "chat_template.*", "generation_config.json")


@dataclass
class PlannedTensor:
    out: OutputEntry
    sources: list[str]
    # "copy" (same bytes), "cast", "rows" (pooled rows), "fused" (Q|K|V), "per_head",
    # "layer" (rewritten by a whole-layer merge)
    kind: str
    role: Role = "weight"
    layer: int | None = None


@dataclass
class ConversionPlan:
    geometry: AttentionGeometry
    num_kv_heads: int
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.out.nbytes for t in self.tensors)


def parse_size(size: int | str) -> int:
    """'5GB' → 5·10⁹, '500MiB' → 500·2²⁰, 1000 → 1000 (bytes)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size, re.IGNORECASE)
    if not m:
        raise UptrainError(f"cannot read size {size!r}; use e.g. 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


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
    kv_prefixes = []
    for layer in range(geometry.num_layers):
        prefix = layout.attn_prefix.format(layer=layer) + "."
        kv_prefixes += [prefix + m + "." for m in layout.kv_modules]
        if whole_layer:
            _plan_whole_layer(pooled, tensors, layout, geometry, layer, g, out_dtype, strategy, grouping)
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
        if layout.fused_qkv:
            name = prefix + layout.fused_qkv
            if name not in tensors:
                raise UptrainError(f"{name} is missing: checkpoint does not match the {geometry.model_type} layout")
            rows, *rest = tensors[name].shape
            if rows != (h + 2 * kv) * d:
                raise UptrainError(f"{name} has {rows} rows, expected (Q {h} + K {kv} + V {kv}) × {d}")
            pooled[name] = PlannedTensor(OutputEntry(name, out_dtype(name), ((h + 2 * g) * d, *rest)),
                                         [name], "fused", _role(layout.fused_qkv))
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
            plan.tensors.append(PlannedTensor(OutputEntry(info.name, dtype, info.shape), [info.name], kind))
    return plan


def _plan_whole_layer(pooled: dict, tensors: dict, layout: AttentionLayout, geometry: AttentionGeometry,
                      layer: int, g: int, out_dtype, strategy: Strategy, grouping: str) -> None:
    prefix = layout.attn_prefix.format(layer=layer) + "."
    names = layer_tensor_names(layout)
    extra = {n: tensors[n].shape for n in tensors
             if n.startswith(prefix) and n[len(prefix):] not in names and not n.endswith(f"{layout.o_proj}.bias")}
    check_whole_layer_support(layout, strategy, grouping, geometry.model_type, extra, geometry.head_dim)
    for rel, field in names.items():
        name = prefix + rel
        if name not in tensors:
            if field.endswith("_w"):
                raise UptrainError(f"{name} is missing: checkpoint does not match the {geometry.model_type} layout")
            continue
        shape = tensors[name].shape
        heads = geometry.num_kv_heads if field[0] in "kv" else geometry.num_heads
        width = shape[1] if field == "o_w" else shape[0]  # o_proj's columns are per head
        if width != heads * geometry.head_dim:
            raise UptrainError(f"{name} has shape {tuple(shape)}, expected {heads} heads × {geometry.head_dim}")
        if field[0] in "kv":
            shape = (g * geometry.head_dim, *shape[1:])
        pooled[name] = PlannedTensor(OutputEntry(name, out_dtype(name), shape), [name], "layer", layer=layer)


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
        qkv = source.read_tensor(t.sources[0])
        q_rows, kv_rows = geo.num_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
        k = pool_rows(k, g, geo.head_dim, strategy, PoolingContext(t.role, t.out.name + ":k", seed, init_std))
        v = pool_rows(v, g, geo.head_dim, strategy, PoolingContext(t.role, t.out.name + ":v", seed, init_std))
        return torch.cat([q, k, v]).to(t.out.dtype)
    if t.kind == "per_head":
        heads = torch.stack([source.read_tensor(n) for n in t.sources])  # [r, *shape]
        stacked = heads.unsqueeze(0).unsqueeze(2)  # one group, head_dim axis of size 1
        compute = torch.float64 if heads.dtype == torch.float64 else torch.float32
        return strategy.fn(stacked.to(compute), ctx).reshape(t.out.shape).to(t.out.dtype)
    raise AssertionError(t.kind)


def resolve_source(src: str | Path) -> tuple[Path, str]:
    """A local folder, or a Hub id fetched (or found in the cache when offline)."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise UptrainError(f"{src} is not a checkpoint folder")
        return path.absolute(), str(path.absolute())
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)) and not str(src).startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            local = snapshot_download(str(src), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                                "tokenizer*", "*.jinja"])
        except Exception as err:
            offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
            raise UptrainError(f"{src} is not a local folder and could not be fetched from the Hub{offline}: "
                               f"{type(err).__name__}") from None
        return Path(local), str(src)
    raise UptrainError(f"{src} does not exist")


def convert_checkpoint(src: str | Path, out: str | Path, num_kv_heads: int, pooling: str = "mean",
                       seed: int = 0, dtype: str | None = None, max_shard_size: int | str = "5GB",
                       overwrite: bool = False, allow_pickle: bool = False, progress: bool | None = None,
                       grouping: str = "contiguous", calibration: dict[int, torch.Tensor] | None = None,
                       calibration_info: dict | None = None, source_hash: str = "blake3") -> Path:
    """Convert the checkpoint at `src` to `num_kv_heads` KV heads and write it to `out`.

    Streams: holds at most one layer's K and V (pooled ahead on a second thread) and the
    tensor being written — one layer's Q, K, V and O for `calibrated` pooling or `similarity`
    grouping.
    `calibration` maps each layer to the second moment of its attention input, augmented with
    a constant 1 ((hidden + 1)², see `uptrain.calibration`). `source_hash` names the digest
    of each source file recorded in `uptrain.json` (blake3, sha256 or none). `out` appears
    only when everything succeeded. Returns the output folder.
    """
    out = Path(out).absolute()
    strategy = get_strategy(pooling)
    if grouping not in GROUPINGS:
        raise UptrainError(f"--grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
    if strategy.whole_layer and calibration is None:
        raise UptrainError(f"--pooling {pooling} needs calibration data (--calibration-data FILE)")
    if source_hash not in HASH_CHOICES:
        raise UptrainError(f"--source-hash must be one of {', '.join(HASH_CHOICES)}, got {source_hash!r}")
    cast = None
    if dtype is not None:
        if dtype not in DTYPES:
            raise UptrainError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        cast = DTYPES[dtype]
    max_shard_bytes = parse_size(max_shard_size)
    check_output_path(out, overwrite)
    folder, label = resolve_source(src)
    config = read_config(folder)
    layout = layout_for(config.get("model_type"))
    geometry = attention_geometry(config, layout.head_dim_key)
    check_num_kv_heads(geometry.num_heads, geometry.num_kv_heads, num_kv_heads)
    source = SourceCheckpoint(folder, allow_pickle=allow_pickle)
    try:
        plan = plan_conversion(source, layout, geometry, num_kv_heads, cast, strategy, grouping)
        init_std = config.get("initializer_range", 0.02)
        merger = LayerMerger(source, layout, geometry, num_kv_heads, strategy, grouping,
                             rotary_dim(config, geometry.head_dim), calibration, seed, init_std)
        with atomic_directory(out, overwrite) as tmp, BackgroundHasher(source.files, source_hash) as hasher:
            _write_weights(plan, source, tmp, strategy, seed, init_std, max_shard_bytes, progress, merger)
            source_files = hasher.result()
            _write_config(folder, tmp, config, num_kv_heads, dtype)
            _copy_side_files(folder, tmp, config)
            provenance = _provenance(label, source_files, strategy, seed, plan, dtype)
            provenance["grouping"] = grouping
            if merger.kv_orders:
                provenance["kv_head_order"] = {str(k): v for k, v in merger.kv_orders.items()}
            if calibration_info:
                provenance["calibration"] = calibration_info
            (tmp / "uptrain.json").write_text(json.dumps(provenance, indent=2) + "\n")
            (tmp / "README.md").write_text(_model_card(provenance))
    finally:
        source.close()
    return out


def _write_weights(plan: ConversionPlan, source: SourceCheckpoint, folder: Path, strategy: Strategy,
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


def _write_config(src: Path, dst: Path, config: dict, num_kv_heads: int, dtype: str | None) -> None:
    # Edit the JSON itself, not a transformers config object: every other field stays as it was.
    config = dict(config, num_key_value_heads=num_kv_heads)
    if dtype is not None:
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _copy_side_files(src: Path, dst: Path, config: dict) -> None:
    for pattern in SIDE_FILE_PATTERNS:
        for path in src.glob(pattern):
            if path.is_file() and not (dst / path.name).exists():
                shutil.copy2(path, dst / path.name)
    if not (dst / "generation_config.json").exists():
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        (dst / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")


def _provenance(label: str, source_files: dict[str, dict], strategy: Strategy, seed: int, plan: ConversionPlan,
                dtype: str | None) -> dict:
    geo = plan.geometry
    return {
        "uptrain_version": uptrain.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": label,
        "source_files": source_files,
        "model_type": geo.model_type,
        "pooling": strategy.name,
        "pooling_reference": strategy.reference,
        "seed": seed,
        "dtype": dtype,
        "num_attention_heads": geo.num_heads,
        "source_num_key_value_heads": geo.num_kv_heads,
        "num_key_value_heads": plan.num_kv_heads,
        "kv_groups": kv_groups(geo.num_kv_heads, plan.num_kv_heads),
        "query_to_kv": query_to_kv(geo.num_heads, plan.num_kv_heads),
    }


def _model_card(p: dict) -> str:
    return f"""---
tags: [uptrain, grouped-query-attention]
---
# {p['model_type']} with {p['num_key_value_heads']} KV heads (converted by uptrain)

Converted from `{p['source']}` ({p['num_attention_heads']} query heads, \
{p['source_num_key_value_heads']} KV heads) to grouped-query attention with \
{p['num_key_value_heads']} KV heads by `{p['pooling']}` pooling of each contiguous group of \
{p['source_num_key_value_heads'] // p['num_key_value_heads']} KV heads \
(query head i reads KV head i // {p['num_attention_heads'] // p['num_key_value_heads']}).
Strategy: {p['pooling_reference']}. Seed {p['seed']}.

The weights have not been trained since conversion: uptrain them (`uptrain train`) before use.
Every other tensor is copied unchanged{'' if p['dtype'] is None else f" (cast to {p['dtype']})"}.
`uptrain.json` records the source files' digests, the grouping and the uptrain version \
({p['uptrain_version']}).
"""
