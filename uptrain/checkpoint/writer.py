"""Safetensors files written tensor by tensor, with every header planned before a byte of data."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain.checkpoint.reader import TORCH_TO_ST, RawDtype, tensor_bytes, tensor_nbytes


@dataclass(frozen=True)
class OutputEntry:
    name: str
    dtype: torch.dtype | RawDtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


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
            header[e.name] = {"dtype": TORCH_TO_ST[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keeps tensor data 8-byte aligned, as safetensors does
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self._remaining = 0

    def begin(self, name: str) -> None:
        entry = self.entries[self._next]
        if entry.name != name or self._remaining:
            raise RuntimeError(f"writing {name} out of plan order in {self.path}")
        self._remaining = entry.nbytes
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
        if exc_type is None and (self._next != len(self.entries) or self._remaining):
            raise RuntimeError(f"{self.path}: closed before every planned tensor was written")
