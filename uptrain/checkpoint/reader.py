"""Checkpoint reading, one tensor at a time.

Safetensors files are read with plain positioned reads (no mmap): a mapped file counts
toward the process's resident memory as it is touched, and a converter that maps a 140 GB
checkpoint looks, and may behave, like one that loaded it. (The provenance digests are
computed beside the conversion, in `uptrain.checkpoint.hashing`.)
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from uptrain import UptrainError
from uptrain.strict_json import parse_json, read_json


@dataclass(frozen=True)
class RawDtype:
    """A safetensors dtype this torch cannot hold (sub-byte floats, or types newer than the
    installed torch): such tensors are copied byte for byte and never computed on."""

    code: str
    bits: int
    is_floating_point = False  # never cast by --dtype
    is_complex = False

    def __repr__(self) -> str:
        return f"safetensors {self.code}"


# Every dtype of the safetensors format (as of safetensors 0.8), with its bits per element and
# the torch dtype holding it where this torch has one.
_FORMAT_DTYPES = {
    "BOOL": (8, "bool"),
    "U8": (8, "uint8"),
    "I8": (8, "int8"),
    "U16": (16, "uint16"),
    "I16": (16, "int16"),
    "U32": (32, "uint32"),
    "I32": (32, "int32"),
    "U64": (64, "uint64"),
    "I64": (64, "int64"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "F32": (32, "float32"),
    "F64": (64, "float64"),
    "C64": (64, "complex64"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
    "F4": (4, None),  # packed: no torch dtype per element
}
ST_DTYPES: dict[str, torch.dtype | RawDtype] = {
    code: getattr(torch, name) if name and hasattr(torch, name) else RawDtype(code, bits)
    for code, (bits, name) in _FORMAT_DTYPES.items()
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}


def dtype_bits(dtype: torch.dtype | RawDtype) -> int:
    return dtype.bits if isinstance(dtype, RawDtype) else dtype.itemsize * 8


def tensor_nbytes(dtype: torch.dtype | RawDtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor's data; sub-byte dtypes pack their elements (safetensors rounds up)."""
    return (math.prod(shape) * dtype_bits(dtype) + 7) // 8


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The little-endian bytes of a tensor, as safetensors stores them."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


MAX_HEADER_BYTES = 100 * 1024 * 1024
COPY_CHUNK_BYTES = 1024 * 1024  # 1–2 MiB copy fastest here, 4 MiB 4× slower: scripts/bench_copy_chunks.py

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype | RawDtype
    shape: tuple[int, ...]
    file: Path
    start: int = 0  # absolute byte offsets in `file` (safetensors only)
    end: int = 0

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def _whole_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: Path) -> tuple[dict, list[TensorInfo]]:
    """Parse and validate a safetensors header without touching tensor data.

    Checked as the safetensors library checks: every entry has a known dtype, a shape of
    whole numbers and offsets that match it; names are unique; the tensors tile the data
    exactly; `__metadata__` maps strings to strings.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise UptrainError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise UptrainError(f"{path}: corrupt or truncated safetensors header")
            raw = f.read(header_len)
    except OSError as err:
        raise UptrainError(f"cannot read {path}: {err.strerror}") from None
    header = parse_json(raw, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise UptrainError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise UptrainError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")
    data_start = 8 + header_len
    tensors = []
    for name, entry in header.items():
        dtype = (
            ST_DTYPES.get(entry.get("dtype"))
            if isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
            else None
        )
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(map(_whole_number, shape))
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(map(_whole_number, offsets))
        ):
            raise UptrainError(
                f"{path}: corrupt safetensors entry for {name!r} (needs a known dtype, a shape and "
                "two data_offsets, all whole numbers)"
            )
        begin, end = offsets
        info = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)
        if end < begin or end - begin != info.nbytes or math.prod(shape) * dtype_bits(dtype) % 8:
            raise UptrainError(f"{path}: corrupt safetensors entry for {name!r} (size does not match shape)")
        if info.end > size:
            raise UptrainError(f"{path}: truncated: {name!r} ends at byte {info.end} but the file has {size}")
        tensors.append(info)
    # Tensors tile the data exactly, as the safetensors library requires (transformers could not
    # load the file otherwise): no shared bytes, no gaps, nothing after the last one.
    tensors.sort(key=lambda t: (t.start, t.end))
    position, before = data_start, None
    for t in tensors:
        if t.start < position:
            raise UptrainError(f"{path}: corrupt safetensors header ({before.name!r} and {t.name!r} share bytes)")
        if t.start > position:
            raise UptrainError(
                f"{path}: corrupt safetensors header ({t.start - position} bytes before {t.name!r} belong to no tensor)"
            )
        position, before = t.end, t
    if position != size:
        raise UptrainError(f"{path}: corrupt safetensors file ({size - position} bytes after its last tensor)")
    return metadata, tensors


class PositionedReader:
    """Positioned reads (pread) from one file: safe from several threads at once."""

    def __init__(self, path: Path):
        self.path = path
        self.file: BinaryIO = open(path, "rb", buffering=0)

    def read_into(self, start: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes at [start, start + len(buffer))."""
        done = 0
        while done < len(buffer):
            n = os.preadv(self.file.fileno(), [buffer[done:]], start + done)
            if not n:
                raise UptrainError(f"{self.path}: file ended early (truncated?)")
            done += n

    def copy_to(self, start: int, length: int, write: Callable[[memoryview], object], chunk: bytearray) -> None:
        """Stream [start, start + length) to `write` through a reusable chunk buffer."""
        view = memoryview(chunk)
        pos, end = start, start + length
        while pos < end:
            part = view[: min(len(view), end - pos)]
            self.read_into(pos, part)
            write(part)
            pos += len(part)


class SourceCheckpoint:
    """The weights of a local checkpoint folder: tensor metadata up front, data on demand."""

    def __init__(self, folder: Path, allow_pickle: bool = False):
        self.folder = folder
        self.is_pickle = False
        self.metadata: dict = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._readers: dict[Path, PositionedReader] = {}
        self._readers_lock = threading.Lock()
        self._pickled: dict[Path, dict] = {}
        if (folder / SAFETENSORS_INDEX).is_file():
            self._open_safetensors(self._index_shards(folder / SAFETENSORS_INDEX))
        elif (folder / SAFETENSORS_SINGLE).is_file():
            self._open_safetensors({SAFETENSORS_SINGLE: None})
        elif (folder / PICKLE_INDEX).is_file() or (folder / PICKLE_SINGLE).is_file():
            if not allow_pickle:
                raise UptrainError(
                    f"{folder} holds only pickle (.bin) weights; pass --allow-pickle to read them "
                    "(loaded with torch.load(weights_only=True))"
                )
            self._open_pickle(folder)
        else:
            raise UptrainError(f"{folder} holds no weights ({SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX})")

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def _index_shards(self, index_path: Path) -> dict[str, set[str]]:
        """Shard file → the tensors the index places in it. A shard must be a file of this
        folder: an index naming `/etc/…` or `../…` is refused before anything is opened."""
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise UptrainError(f"{index_path}: not a valid index (weight_map must map tensor names to shard files)")
        shards: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            parts = Path(shard).parts
            if not parts or Path(shard).is_absolute() or ".." in parts or "\0" in shard:
                raise UptrainError(f"{index_path}: shard {shard!r} of {name!r} is not a file inside {self.folder}")
            shards.setdefault(shard, set()).add(name)
        return shards

    def _open_safetensors(self, shards: dict[str, set[str] | None]) -> None:
        for shard, names in shards.items():
            path = self.folder / shard
            if not path.is_file():
                raise UptrainError(f"shard {shard} named in the index is missing from {self.folder}")
            metadata, infos = read_safetensors_header(path)
            self.metadata = self.metadata or metadata
            held = {t.name: t for t in infos}
            if names is not None:
                missing = sorted(names - held.keys())
                if missing:
                    raise UptrainError(
                        f"the index names {missing[0]!r} in {shard}, which does not hold it"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                    )
                held = {n: t for n, t in held.items() if n in names}
            self.tensors.update(held)

    def _open_pickle(self, folder: Path) -> None:
        self.is_pickle = True
        if (folder / PICKLE_INDEX).is_file():
            shards = self._index_shards(folder / PICKLE_INDEX)
        else:
            shards = {PICKLE_SINGLE: None}
        for shard, names in shards.items():
            path = folder / shard
            if not path.is_file():
                raise UptrainError(f"shard {shard} named in the index is missing from {folder}")
            state = _torch_load_safely(path)
            if names is not None and (missing := sorted(names - state.keys())):
                raise UptrainError(f"the index names {missing[0]!r} in {shard}, which does not hold it")
            self._pickled[path] = state
            for name, t in state.items():
                if names is None or name in names:
                    self.tensors[name] = TensorInfo(name, t.dtype, tuple(t.shape), path)

    def order(self) -> list[TensorInfo]:
        """Tensors in file order: reading them in this order reads each file front to back."""
        return sorted(self.tensors.values(), key=lambda t: (str(t.file), t.start))

    def _reader(self, path: Path) -> PositionedReader:
        with self._readers_lock:  # the conversion reads from two threads (run.py)
            if path not in self._readers:
                self._readers[path] = PositionedReader(path)
            return self._readers[path]

    def read_tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        if self.is_pickle:
            return self._pickled[info.file][name]
        if isinstance(info.dtype, RawDtype):
            raise UptrainError(
                f"{name} is stored as {info.dtype.code}, which this torch cannot compute on; "
                "uptrain can copy such tensors but not pool or cast them"
            )
        # torch's allocator, not a bytearray: no zero-fill, and huge pages where enabled (cli.py).
        raw = torch.empty(info.nbytes, dtype=torch.uint8)
        self._reader(info.file).read_into(info.start, memoryview(raw.numpy()))
        return raw.view(info.dtype).reshape(info.shape)

    def copy_raw(self, name: str, write: Callable[[memoryview], object], chunk: bytearray) -> None:
        """Send a tensor's bytes unchanged to `write`, never holding more than `chunk`."""
        info = self.tensors[name]
        if self.is_pickle:
            write(tensor_bytes(self._pickled[info.file][name]))
        else:
            self._reader(info.file).copy_to(info.start, info.nbytes, write, chunk)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.file.close()
        self._readers.clear()
        self._pickled.clear()


def _torch_load_safely(path: Path) -> dict[str, torch.Tensor]:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses arbitrary objects with an UnpicklingError
        raise UptrainError(f"{path}: cannot be read as a weights-only pickle ({type(err).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UptrainError(f"{path}: not a state dict of tensors")
    return state
