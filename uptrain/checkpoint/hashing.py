"""Digests of the source weight files for the provenance record, computed off the critical path.

A background thread reads and hashes every source file while the conversion streams the same
files (the page cache serves both). BLAKE3 is the default: a cryptographic hash that runs at
about 7 GB/s on one core here, against 1.8 GB/s for sha256 even with SHA extensions; on two
cores it adds about a tenth to a conversion, sha256 over a third (BENCHMARKS.md). Both
release the GIL while hashing, which lets the thread run beside the conversion.

Files in a Hugging Face cache are named by the sha256 the Hub lists for them (their LFS object
id); that name is recorded as `hub_sha256` at no cost, and `--source-hash sha256` checks it.
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path

import blake3

from uptrain import UptrainError
from uptrain.checkpoint.reader import COPY_CHUNK_BYTES

SOURCE_HASHES = {"blake3": blake3.blake3, "sha256": hashlib.sha256}


def hub_sha256(path: Path) -> str | None:
    """The sha256 a Hub cache file is named by (blobs/<sha256>), or None for any other file."""
    target = path.resolve()
    if target.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", target.name):
        return target.name
    return None


class BackgroundHasher:
    """Hashes `paths`, in order, on a daemon thread; `result()` waits for the digests.

    Use as a context manager: leaving the block early (an error in the conversion) stops the
    thread at its next chunk.
    """

    def __init__(self, paths: list[Path], algorithm: str):
        self.algorithm = algorithm
        self.paths = list(paths)
        self._digests: dict[Path, str] = {}
        self._error: UptrainError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="uptrain-source-hash", daemon=True)

    def __enter__(self) -> BackgroundHasher:
        if self.algorithm != "none":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        view = memoryview(bytearray(COPY_CHUNK_BYTES))
        for path in self.paths:
            digest = SOURCE_HASHES[self.algorithm]()
            try:
                with open(path, "rb", buffering=0) as f:
                    while n := f.readinto(view):
                        if self._stop.is_set():
                            return
                        digest.update(view[:n])
            except OSError as err:
                self._error = UptrainError(f"cannot read {path} to hash it: {err.strerror}")
                return
            self._digests[path] = digest.hexdigest()

    def result(self) -> dict[str, dict]:
        """Per source file (by name): its size, its digest, and the Hub's sha256 where known.

        Raises when a file cannot be read or, with sha256, does not match the Hub's.
        """
        if self._thread.ident is not None:  # started
            self._thread.join()
        if self._error:
            raise self._error
        files = {}
        for path in self.paths:
            record: dict = {"bytes": path.stat().st_size}
            if self.algorithm != "none":
                record[self.algorithm] = self._digests[path]
            if hub := hub_sha256(path):
                if record.get("sha256", hub) != hub:
                    raise UptrainError(
                        f"{path} does not match the sha256 the Hub cache names it by "
                        f"({record['sha256']} vs {hub}): a corrupt download?"
                    )
                record["hub_sha256"] = hub
            files[path.name] = record
        return files
