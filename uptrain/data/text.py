"""Text → token blocks, shared by training and calibration: load local files or a Hub dataset
with `datasets`, tokenize, join documents with EOS, pack into `seq_len` blocks.

Neither `uptrain.convert` nor `uptrain.train` owns this: calibration (a conversion step) and
the uptraining loop read text the same way.
"""

from __future__ import annotations

import bz2
import copy
import glob
import gzip
import itertools
import lzma
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain import UptrainError, exception_line
from uptrain.data.blocks import Blocks, TensorBlocks, check_indices
from uptrain.data.shards import is_token_folder, open_token_folder

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# datasets decompresses these on the fly: `train.jsonl.gz` reads as jsonl.
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def _kind(path: str | Path) -> str | None:
    """The datasets builder for a file, looking through a compression suffix."""
    path = Path(path)
    if path.suffix in COMPRESSIONS:
        path = path.with_suffix("")
    return BUILDERS.get(path.suffix)


# Documents tokenized per `map` batch; each batch's last partial block is dropped.
MAP_BATCH = 1000


@dataclass(frozen=True)
class DataSource:
    """Where text comes from: local files (with their `datasets` builder) or a Hub dataset."""

    label: str
    builder: str | None  # "text"/"json"/"parquet" for local files, None for a Hub name
    files: tuple[str, ...] = ()

    @property
    def is_local(self) -> bool:
        return self.builder is not None


def resolve_data(spec: str | list[str], key: str) -> DataSource:
    """Local files (paths, globs or a folder) or a Hub name. Raises UptrainError on a missing path."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    files: list[str] = []
    for s in specs:
        path = Path(s).expanduser()
        if path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if _kind(p) and p.is_file())
            if not found:
                raise UptrainError(f"`{key}`: folder {s} holds no {'/'.join(sorted(BUILDERS))} files")
            files += found
        elif path.is_file():
            files.append(str(path))
        elif any(c in s for c in "*?["):
            found = sorted(glob.glob(os.path.expanduser(s)))
            if not found:
                raise UptrainError(f"`{key}`: {s} matches no file")
            files += found
        elif len(specs) == 1 and not _looks_like_path(s):
            return DataSource(s, None)
        else:
            raise UptrainError(f"`{key}`: {s} does not exist")
    builders = {_kind(f) for f in files}
    if None in builders:
        bad = next(f for f in files if _kind(f) is None)
        raise UptrainError(f"`{key}`: cannot read {bad}; use .txt, .jsonl, .json or .parquet")
    if len(builders) > 1:
        raise UptrainError(f"`{key}` mixes file types ({', '.join(sorted(builders))}); use one kind per key")
    if all(os.path.getsize(f) == 0 for f in files):
        raise UptrainError(f"`{key}`: {', '.join(specs)} is empty")
    if all(_only_whitespace(f) for f in files):
        raise UptrainError(f"`{key}`: {', '.join(specs)} holds only whitespace: no text to read")
    return DataSource(", ".join(specs), builders.pop(), tuple(files))


def _only_whitespace(path: str) -> bool:
    """A text or JSON-lines file (plain or compressed) holding nothing but whitespace. Reads up
    to the first other byte, which for real data is in the first chunk."""
    if _kind(path) not in ("text", "json"):
        return False  # parquet is binary: datasets judges it
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(Path(path).suffix, open)
    if Path(path).suffix == ".zst":
        return False  # needs the zstandard package to look inside: datasets judges it
    try:
        with opener(path, "rb") as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return False
    except (OSError, EOFError, lzma.LZMAError):
        return False  # unreadable or not really compressed: datasets reports it in its own words
    return True


def _looks_like_path(s: str) -> bool:
    return s.startswith((".", "/", "~")) or _kind(s) is not None or s.count("/") > 1


def load_documents(source: DataSource, split: str, dataset_config: str | None, sample_by: str, streaming: bool):
    from datasets import load_dataset

    try:
        if source.is_local:
            kwargs = {"sample_by": sample_by} if source.builder == "text" else {}
            return load_dataset(
                source.builder, data_files=list(source.files), split="train", streaming=streaming, **kwargs
            )
        return load_dataset(source.label, dataset_config, split=split, streaming=streaming)
    except UptrainError:
        raise
    except Exception as err:  # datasets raises many types; the user needs the one line
        offline = (
            " (HF_DATASETS_OFFLINE is set)"
            if not source.is_local and os.environ.get("HF_DATASETS_OFFLINE") == "1"
            else ""
        )
        raise UptrainError(f"cannot load {source.label}{offline}: {exception_line(err)}") from None


def _column_names(ds, source: DataSource) -> list[str]:
    names = ds.column_names
    if names is None:  # some streamed datasets only know their columns after the first row
        names = list(next(iter(ds)).keys())
    return list(names)


class Pack:
    """A batched `map` function: tokenize documents, append EOS to each, cut into `seq_len` blocks.
    A value that is not text (a number, a list: the tokenizer would read a list as pre-split
    words) is refused in one line naming `what`. A class rather than a closure so that it
    pickles into DataLoader worker processes under any start method."""

    def __init__(self, tokenizer, text_field: str, seq_len: int, what: str):
        self.tokenizer, self.text_field, self.seq_len, self.what = tokenizer, text_field, seq_len, what
        self.eos = tokenizer.eos_token_id

    def fingerprint(self, dataset, columns: list[str]) -> str | None:
        """The cache key of packing `dataset` (a local dataset, tokenized up front) with this: what
        `datasets` would hash, but for where the tokenizer was loaded from and which key it is for
        (`what`, for messages only). The same tokenizer files in another folder give the same
        blocks: each converted model of a compare carries its source's tokenizer, so its runs (and
        its calibration) tokenize their common text once instead of once each. None: let
        `datasets` key it (a dataset held in memory, without cache files to name its data)."""
        from datasets.fingerprint import Hasher

        if not dataset.cache_files:  # their names follow the data files and how they were read
            return None
        tokenizer = copy.copy(self.tokenizer)
        tokenizer.name_or_path = ""
        tokenizer.init_kwargs = {**tokenizer.init_kwargs, "name_or_path": ""}
        state = (type(self).__qualname__, tokenizer, self.text_field, self.seq_len, self.eos, MAP_BATCH, columns)
        return Hasher.hash(([f["filename"] for f in dataset.cache_files], state))

    def __call__(self, batch: dict) -> dict:
        try:
            values = batch[self.text_field]
        except UnicodeDecodeError as err:  # Arrow keeps a JSON string's bytes; Python decodes them here
            raise UptrainError(f"{self.what}: a `{self.text_field}` value is not UTF-8 ({err.reason})") from None
        texts = [t for t in values if t is not None and t != ""]
        if bad := next((t for t in texts if not isinstance(t, str)), None):
            raise UptrainError(
                f"{self.what}: a `{self.text_field}` value is {type(bad).__name__} ({str(bad)[:40]!r}), not text"
            )
        # No BOS or other specials: documents are separated by EOS only, the same way everywhere.
        ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        stream = list(itertools.chain.from_iterable(doc + [self.eos] for doc in ids))
        usable = len(stream) - len(stream) % self.seq_len
        return {"input_ids": [stream[i : i + self.seq_len] for i in range(0, usable, self.seq_len)]}


def pack_function(tokenizer, text_field: str, seq_len: int, what: str) -> Pack:
    return Pack(tokenizer, text_field, seq_len, what)


class TextStream:
    """A streamed dataset's text and how to pack it, tokenized only as it is read.

    Iterating gives the packed blocks (`{"input_ids": [...]}`) of the whole dataset in file
    order (evaluation, calibration). Training reads one share of it per process and data
    worker (`share`), so that no process reads or tokenizes the others' text.
    """

    def __init__(self, texts, pack: Pack, columns: list[str]):
        self.texts, self.pack, self.columns = texts, pack, columns

    @property
    def seq_len(self) -> int:
        return self.pack.seq_len

    @property
    def label(self) -> str:
        return self.pack.what

    def __iter__(self):
        # Name the removed columns explicitly: streamed datasets do not infer them when the row count changes.
        packed = self.texts.map(self.pack, batched=True, batch_size=MAP_BATCH, remove_columns=self.columns)
        return iter(packed)

    def head(self, count: int) -> TensorBlocks:
        """The first `count` blocks (fewer if the stream holds fewer), in memory: what evaluation and
        calibration read of a streamed dataset, which is never read in full."""
        rows = [row["input_ids"] for row in itertools.islice(iter(self), count)]
        empty = torch.empty((0, self.seq_len), dtype=torch.long)
        return TensorBlocks(torch.tensor(rows, dtype=torch.long) if rows else empty)

    def share(self, slot: int, slots: int, order: list[int] | None = None) -> list:
        """Share `slot` of `slots` as a list of streamed datasets of raw rows, read in turn.

        With at least `slots` shards (files, or a Hub dataset's data files) a share is whole
        shards: those at positions slot, slot + slots, … of `order` (a permutation of the
        shard indices, the same in every process). With fewer, each share reads every row but
        keeps one in `slots` before tokenizing (`split_dataset_by_node`'s example split).
        """
        from datasets.distributed import split_dataset_by_node

        n = self.texts.num_shards
        if n >= slots:
            order = list(range(n)) if order is None else order
            return [self.texts.shard(num_shards=n, index=i) for i in order[slot::slots]]
        return [split_dataset_by_node(self.texts, rank=slot, world_size=slots)]


class TokenBlocks:
    """Packed blocks of a local dataset, tokenized up front (cached by `datasets`)."""

    def __init__(self, dataset):
        self.dataset = dataset.with_format("torch")

    def __len__(self) -> int:
        return len(self.dataset)

    def take(self, indices: list[int]) -> torch.Tensor:
        """Blocks at `indices`, shape [len(indices), seq_len]."""
        check_indices(indices, len(self))
        return self.dataset[indices]["input_ids"]


def head_blocks(data: Blocks | TextStream, count: int) -> Blocks:
    """Data that evaluation or calibration can index: blocks tokenized up front as they are (the
    reader takes its first `count`), or a stream's first `count` blocks, in memory."""
    return data.head(count) if isinstance(data, TextStream) else data


def load_blocks(
    spec,
    key: str,
    tokenizer,
    seq_len: int,
    text_field: str,
    split: str,
    dataset_config: str | None,
    sample_by: str,
    streaming: bool | None,
    workers: int | None,
) -> tuple[Blocks | TextStream, DataSource]:
    """Load and pack one data key. Returns (its blocks, or a TextStream when streamed, and the source)."""
    if is_token_folder(spec):  # `uptrain tokenize` wrote it: memory-mapped blocks, nothing to tokenize
        shards = open_token_folder(spec, key, tokenizer, seq_len)
        return shards, DataSource(str(spec), "tokens", tuple(str(s.path) for s in shards.shards))
    source = resolve_data(spec, key)
    stream = (not source.is_local) if streaming is None else streaming
    ds = load_documents(source, split, dataset_config, sample_by, stream)
    columns = _column_names(ds, source)
    if text_field not in columns:
        raise UptrainError(
            f"`{key}` ({source.label}) has no column `{text_field}` (columns: {', '.join(columns)}); set `text_field`"
        )
    pack = Pack(tokenizer, text_field, seq_len, f"`{key}` ({source.label})")
    if stream:
        return TextStream(ds, pack, columns), source
    # Name the removed columns explicitly (as TextStream does).
    packed = ds.map(
        pack,
        batched=True,
        batch_size=MAP_BATCH,
        remove_columns=columns,
        num_proc=workers,
        desc=f"tokenize {key}",
        new_fingerprint=pack.fingerprint(ds, columns),
    )
    return TokenBlocks(packed), source
