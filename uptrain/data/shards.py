"""The folder `uptrain tokenize` writes, and how training reads it without tokenizing.

A tokenized folder holds packed `seq_len` blocks exactly as `uptrain.data.text` packs text for
training, in raw little-endian shards memory-mapped at read time:

    OUT/tokens.json        format, seq_len, dtype, the shards (blocks, bytes, blake3 each), the
                           tokenizer (name, digest), the data files (bytes, blake3 each), the
                           packing (text_field, sample_by, documents per packing batch, EOS id)
    OUT/shard-00000.bin    whole blocks, row-major [blocks, seq_len], uint16 (vocabularies up to
    OUT/shard-00001.bin    65,536 tokens) or uint32

Training reads block i from shard i // blocks_per_shard: nothing is tokenized or copied until
a batch asks for its rows. The tokenizer is named by a digest of what decides its tokens, so a
run whose model tokenizes differently is refused instead of training on the wrong ids.

Before a run writes anything, a folder is refused in one line when its index is damaged (the
shards' names, counts, sizes and dtype must be the ones `uptrain tokenize` writes, every shard
inside the folder), when a shard's bytes are not the ones its recorded blake3 digest was made of,
or when a shard holds an id the tokenizer cannot make (`shard_digests`: each shard read once per
version of the file, then remembered).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import torch

from uptrain import UptrainError
from uptrain.data.blocks import check_indices
from uptrain.data.shard_digests import verified_largest_id
from uptrain.strict_json import read_json

INDEX = "tokens.json"
FORMAT = "uptrain-tokens"
FORMAT_VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def tokenizer_digest(tokenizer) -> str:
    """blake3 of what decides a tokenizer's ids: its fast tokenizer's serialised model,
    normaliser, pre-tokeniser and added tokens (or, for a slow one, its class and vocabulary),
    and the EOS id that separates documents. Two copies of one tokenizer saved in different
    folders (a converted checkpoint's) get the same digest; truncation and padding settings,
    which packing never uses, are left out."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:
        state = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}
    state["eos_token_id"] = tokenizer.eos_token_id
    return blake3.blake3(json.dumps(state, sort_keys=True).encode()).hexdigest()


def is_token_folder(spec) -> bool:
    """Whether a data key names a folder `uptrain tokenize` wrote (one path, holding tokens.json)."""
    return isinstance(spec, str | Path) and (Path(spec).expanduser() / INDEX).is_file()


def read_index(folder: Path) -> dict:
    """The folder's tokens.json, checked for what the reader relies on (`_index_problem`). One
    line when it is not one."""
    path = Path(folder) / INDEX
    try:
        index = read_json(path)
    except UptrainError as err:
        raise UptrainError(f"{err}; tokenize the data again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UptrainError(f"{path} is not a tokens index written by `uptrain tokenize`")
    if type(index.get("format_version")) is not int or index["format_version"] != FORMAT_VERSION:
        raise UptrainError(
            f"{path} has format version {_shown(index.get('format_version'))}; this uptrain reads version "
            f"{FORMAT_VERSION}: tokenize the data again"
        )
    if problem := _index_problem(index):
        raise UptrainError(f"{path} is damaged ({problem}); tokenize the data again")
    return index


def _shown(value) -> str:
    """A value of a damaged index, short enough for one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _counts(value, least: int = 1) -> bool:
    return type(value) is int and value >= least


def _index_problem(index: dict) -> str | None:
    """What in a tokens index the reader cannot rely on, or None. Block i is read from shard
    i // blocks_per_shard, so every shard but the last holds exactly blocks_per_shard blocks;
    shards are named as `uptrain tokenize` names them, in order (so none lies outside the folder)."""
    per_shard, dtype, shards = index.get("blocks_per_shard"), index.get("dtype"), index.get("shards")
    if not _counts(index.get("seq_len")):
        return f"seq_len {_shown(index.get('seq_len'))} is not a positive integer"
    if not _counts(per_shard):
        return f"blocks_per_shard {_shown(per_shard)} is not a positive integer"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return f"dtype {_shown(dtype)} is not one of {', '.join(DTYPES)}"
    if not isinstance(shards, list) or not shards:
        return "`shards` is not a list of shards"
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            return f"shard {i} is {_shown(shard)}, not a record of a shard"
        if shard.get("name") != shard_name(i):
            return f"shard {i} is named {_shown(shard.get('name'))}, not {shard_name(i)!r}"
        blocks, last = shard.get("blocks"), i == len(shards) - 1
        if not _counts(blocks) or blocks > per_shard or (not last and blocks != per_shard):
            return (
                f"{shard_name(i)} holds {_shown(blocks)} blocks, where blocks_per_shard is {per_shard} (every shard "
                "but the last holds that many, the last 1 to that many)"
            )
        if not isinstance(shard.get("blake3"), str) or not re.fullmatch(r"[0-9a-f]{64}", shard["blake3"]):
            return f"{shard_name(i)} has no blake3 digest"
    tokenizer = index.get("tokenizer")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("digest"), str):
        return "the tokenizer's digest is missing"
    return None


@dataclass
class _Shard:
    path: Path
    blocks: int


class TokenShards:
    """The blocks of a tokenized folder, memory-mapped shard by shard (`blocks.Blocks`): `take`
    gives int64 [len(indices), seq_len], as `text.TokenBlocks` does for the same text. Pickles by
    its paths (a DataLoader worker maps the shards itself instead of receiving a copy of them).
    """

    def __init__(self, folder: Path, index: dict):
        self.folder = Path(folder)
        self.seq_len = int(index["seq_len"])
        self.blocks_per_shard = int(index["blocks_per_shard"])
        self.dtype = DTYPES[index["dtype"]]
        self.shards = [_Shard(self.folder / s["name"], int(s["blocks"])) for s in index["shards"]]
        self.length = sum(s.blocks for s in self.shards)
        self._maps: list[np.memmap] | None = None

    def check_files(self) -> None:
        """Refuse a folder whose shards are missing, lie outside it (a link out), or are not of
        the size the index says."""
        root = self.folder.resolve()
        for shard in self.shards:
            try:
                target = shard.path.resolve()
            except (OSError, RuntimeError):  # a link loop
                target = None
            if target is None or target.parent != root:
                raise UptrainError(
                    f"{shard.path} is a link to {target or 'itself'}, outside {self.folder}: a tokenized folder "
                    "holds its own shards; copy them in or tokenize the data again"
                )
            expected = shard.blocks * self.seq_len * self.dtype.itemsize
            size = shard.path.stat().st_size if shard.path.is_file() else None
            if size != expected:
                found = "missing" if size is None else f"{size} bytes"
                raise UptrainError(
                    f"{shard.path} should hold {expected} bytes ({shard.blocks} blocks) but is {found}; "
                    "tokenize the data again"
                )

    def _mapped(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [
                np.memmap(s.path, dtype=self.dtype, mode="r", shape=(s.blocks, self.seq_len)) for s in self.shards
            ]
        return self._maps

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def __len__(self) -> int:
        return self.length

    def take(self, indices: list[int]) -> torch.Tensor:
        """Blocks at `indices` as int64 [len(indices), seq_len]."""
        check_indices(indices, self.length)
        maps = self._mapped()
        rows = np.empty((len(indices), self.seq_len), dtype=np.int64)
        for row, i in enumerate(indices):
            shard, within = divmod(i, self.blocks_per_shard)
            rows[row] = maps[shard][within]
        return torch.from_numpy(rows)


def open_token_folder(folder, key: str, tokenizer, seq_len: int) -> TokenShards:
    """The blocks of a tokenized folder for data key `key`, refusing in one line a folder made
    for another seq_len or by a tokenizer other than the model's, and one whose shards are not
    the bytes `uptrain tokenize` wrote or hold an id the tokenizer cannot make (`shard_digests`:
    each shard read once per version of it, then remembered)."""
    folder = Path(folder).expanduser()
    index = read_index(folder)
    if int(index["seq_len"]) != seq_len:
        raise UptrainError(
            f"`{key}`: {folder} was tokenized into blocks of {index['seq_len']} tokens, this run's seq_len "
            f"is {seq_len}: set seq_len {index['seq_len']} or tokenize again with --seq-len {seq_len}"
        )
    if index["tokenizer"]["digest"] != tokenizer_digest(tokenizer):
        raise UptrainError(
            f"`{key}`: {folder} was tokenized with tokenizer {_shown(index['tokenizer'].get('name'))}, which is not "
            "the model's (their digests differ): tokenize the data again with --tokenizer MODEL"
        )
    vocab = len(tokenizer)
    if index["dtype"] != token_dtype(vocab):  # the digests say nothing of how the bytes are read
        raise UptrainError(
            f"`{key}`: {folder / INDEX} says its tokens are {index['dtype']}; `uptrain tokenize` writes "
            f"{token_dtype(vocab)} for a vocabulary of {vocab}: tokenize the data again"
        )
    shards = TokenShards(folder, index)
    shards.check_files()
    for shard, record in zip(shards.shards, index["shards"]):
        largest = verified_largest_id(shard.path, record["blake3"], shards.dtype)
        if largest >= vocab:
            raise UptrainError(
                f"`{key}`: {shard.path} holds token id {largest}, beyond the tokenizer's {vocab}: tokenize the "
                "data again"
            )
    return shards
