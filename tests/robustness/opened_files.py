"""Which files code opens, and how, from Python's audit events (`sys.addaudithook`).

Every `open()` and `os.open()` raises an "open" audit event with the path and the mode or
flags, whichever layer does it (pathlib, shutil, json, safetensors' Python side, torch's
file readers call open too). Hooks cannot be removed, so one hook is installed once and
records only inside `files_opened()`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_recording: list[list[OpenedFile]] = []
_installed = False


@dataclass(frozen=True)
class OpenedFile:
    path: Path
    writes: bool


def _writes(mode, flags) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))


def _hook(event: str, args: tuple) -> None:
    if _recording and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = Path(os.path.normpath(Path(os.fsdecode(args[0])).absolute()))  # lexically: a/../b is b
        for record in _recording:
            record.append(OpenedFile(path, _writes(args[1], args[2] if len(args) > 2 else 0)))


@contextmanager
def files_opened() -> Iterator[list[OpenedFile]]:
    """Yield a list that fills with every file opened in this process until the block ends."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    record: list[OpenedFile] = []
    _recording.append(record)
    try:
        yield record
    finally:
        _recording.remove(record)
