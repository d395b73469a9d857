"""Safetensors files written tensor by tensor, with every header planned before a byte of data.

One planner for every checkpoint uptrain writes (`uptrain convert`'s output and `final/` of
`uptrain train`): tensors in order, cut into shards no larger than the limit (a bigger tensor
alone), named and indexed as transformers names them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain.checkpoint.reader import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    TORCH_TO_ST,
    RawDtype,
    tensor_bytes,
    tensor_nbytes,
)


@dataclass(frozen=True)
class OutputEntry:
    name: str
    dtype: torch.dtype | RawDtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class Shard:
    file: str
    entries: list[OutputEntry]


def plan_shards(entries: list[OutputEntry], max_shard_bytes: int) -> list[Shard]:
    """`entries`, in order, as shards of at most `max_shard_bytes` (a larger tensor gets its
    own): `model.safetensors`, or `model-0000i-of-0000n.safetensors` when there are several."""
    groups: list[list[OutputEntry]] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    if len(groups) == 1:
        return [Shard(SAFETENSORS_SINGLE, groups[0])]
    return [Shard(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", group) for i, group in enumerate(groups)]


def write_index(folder: Path, shards: list[Shard]) -> None:
    """`model.safetensors.index.json` of a sharded checkpoint (none for a single file)."""
    if len(shards) == 1:
        return
    weight_map = {e.name: shard.file for shard in shards for e in shard.entries}
    total = sum(e.nbytes for shard in shards for e in shard.entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


class ShardWriter:
    """Writes one safetensors file whose header is known up front; tensors then stream in order.

    A context manager: leaving the block normally checks that every planned byte was written.
    """

    def __init__(self, path: Path, entries: list[OutputEntry], metadata: dict[str, str]):
        self.path = path
        self.entries = entries
        header: dict = {"__metadata__": metadata}
        offset = 0
        for e in entries:
            header[e.name] = {
                "dtype": TORCH_TO_ST[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keeps tensor data 8-byte aligned, as safetensors does
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self._remaining = 0

    @property
    def full(self) -> bool:
        """Every planned tensor has begun (the last one may still be streaming in)."""
        return self._next == len(self.entries)

    def begin(self, name: str) -> None:
        if self.full or self.entries[self._next].name != name or self._remaining:
            raise RuntimeError(f"writing {name} out of plan order in {self.path}")
        self._remaining = self.entries[self._next].nbytes
        self._next += 1

    def write(self, data: memoryview) -> None:
        self._remaining -= len(data)
        if self._remaining < 0:
            raise RuntimeError(f"more bytes than planned for a tensor in {self.path}")
        self.file.write(data)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.file.close()
        if exc_type is None and (not self.full or self._remaining):
            raise RuntimeError(f"{self.path}: closed before every planned tensor was written")


class ShardedWriter:
    """A whole checkpoint's weights: the tensors of `entries` stream in, in order, through
    `begin(name)` and `write(bytes)`; each shard is opened when its first tensor begins (the
    first at once) and the index is written when the block is left normally.

    `metadata` goes into every shard's header, with `format: pt` as transformers expects.
    """

    def __init__(
        self, folder: Path, entries: list[OutputEntry], max_shard_bytes: int, metadata: dict[str, str] | None = None
    ):
        self.folder = folder
        self.shards = plan_shards(entries, max_shard_bytes)
        self.metadata = {**(metadata or {}), "format": "pt"}
        self._opened = 0
        self._writer = self._open_next()

    def _open_next(self) -> ShardWriter:
        shard = self.shards[self._opened]
        self._opened += 1
        return ShardWriter(self.folder / shard.file, shard.entries, self.metadata)

    def begin(self, name: str) -> None:
        if self._writer.full and self._opened < len(self.shards):
            self._writer.__exit__(None, None, None)  # raises if its last tensor is short
            self._writer = self._open_next()
        self._writer.begin(name)

    def write(self, data: memoryview) -> None:
        self._writer.write(data)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._writer.__exit__(exc_type, *exc)
        if exc_type is None:
            if self._opened < len(self.shards):
                raise RuntimeError(f"{self.folder}: closed before every planned shard was written")
            write_index(self.folder, self.shards)


def write_tensors(
    tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int, metadata: dict[str, str] | None = None
) -> None:
    """Tensors in memory as a safetensors checkpoint in `folder` (sharded as `plan_shards` does)."""
    entries = [OutputEntry(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with ShardedWriter(folder, entries, max_shard_bytes, metadata) as writer:
        for name, tensor in tensors.items():
            writer.begin(name)
            writer.write(tensor_bytes(tensor))
