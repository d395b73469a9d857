"""Token shards checked against the blake3 digests `uptrain tokenize` recorded, once per version
of each file.

A shard is checked by reading it whole: its digest must be the one `tokens.json` records (a
flipped bit anywhere is refused), and its largest token id is found on the way (an id the
tokenizer cannot have made is refused by the caller). Reading costs what the disk gives (blake3
itself runs at several GB/s on one core): seconds per GB, tens of minutes for a set of hundreds
of GB. So that this is paid once, not at every start of every run, a shard that passed is
recorded in the user's cache (`$XDG_CACHE_HOME/uptrain/verified-shards/`, else
`~/.cache/uptrain/…`), one small file per shard named by the shard's identity: its resolved
path, device, inode, size, modification and change times (ns), the digest it matched and the
dtype it was read as. A later use that finds the record reads it and one `stat` per shard;
any write to a shard changes its times and so its identity, and the shard is read again. What
the record cannot see is a change made with no write through the file system (media decay
after the first check). A cache that cannot be written (a read-only home) only means the
shards are read again next time; deleting the folder forgets every record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import blake3
import numpy as np

from uptrain import UptrainError
from uptrain.checkpoint.atomic import write_file
from uptrain.strict_json import parse_json

CACHE_FOLDER = "verified-shards"
CHUNK_TOKENS = 1 << 22  # tokens hashed and scanned at once: 8–16 MiB


def cache_folder() -> Path:
    """Where verified shards are recorded (XDG's cache folder, as other tools keep theirs)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "uptrain" / CACHE_FOLDER


def _identity(path: Path, digest: str, dtype: np.dtype) -> str:
    """A name for this version of the shard, read as `dtype`, with the digest it must match."""
    st = path.stat()
    fields = [str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, dtype.str]
    return blake3.blake3(json.dumps(fields).encode()).hexdigest()


def _recorded(record: Path, digest: str) -> int | None:
    """The largest id an earlier check recorded, or None (no record, or one that is not whole)."""
    try:
        value = parse_json(record.read_bytes(), str(record))
    except (OSError, UptrainError):
        return None
    if not isinstance(value, dict) or value.get("blake3") != digest:
        return None
    largest = value.get("largest_id")
    return largest if type(largest) is int and largest >= 0 else None


def _read(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """(blake3 of the file, its largest token id), reading it once."""
    hasher, largest = blake3.blake3(), 0
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(tokens), CHUNK_TOKENS):
        chunk = np.ascontiguousarray(tokens[start : start + CHUNK_TOKENS])
        hasher.update(chunk.view(np.uint8))
        largest = max(largest, int(chunk.max()))
    del tokens
    return hasher.hexdigest(), largest


def verified_largest_id(path: Path, digest: str, dtype: np.dtype) -> int:
    """The largest token id of the shard at `path` (a regular file of whole `dtype` tokens, at
    least one), once its bytes are checked against `digest`: from the record of an earlier check
    of this very version of the file, else by reading it (and recording that it passed).
    Refuses, in one line, a shard whose bytes are not the ones the digest was made of."""
    record = cache_folder() / f"{_identity(path, digest, dtype)}.json"
    largest = _recorded(record, digest)
    if largest is not None:
        return largest
    try:
        found, largest = _read(path, dtype)
    except OSError as err:
        raise UptrainError(f"cannot read {path}: {err.strerror or err}") from None
    if found != digest:
        raise UptrainError(
            f"{path} is not the shard `uptrain tokenize` wrote (its blake3 is not the one tokens.json "
            "records): tokenize the data again"
        )
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_file(record, json.dumps({"shard": str(path.resolve()), "blake3": digest, "largest_id": largest}) + "\n")
    except OSError:
        pass  # not recorded: checked again next time
    return largest
