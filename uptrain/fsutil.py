"""Outputs appear whole or not at all: built in a temporary sibling, renamed at the end."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from uptrain import UptrainError

TMP_TAG = ".uptrain-tmp-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(out: Path) -> None:
    """Clear siblings left by a run that was killed (kill -9 gives no chance to clean up)."""
    for sibling in out.parent.glob(f".{out.name}{TMP_TAG}*"):
        pid = sibling.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


def check_output_path(out: Path, overwrite: bool) -> None:
    """Refuse early, before any work, an OUT that exists or cannot be created."""
    if out.exists() and not overwrite:
        raise UptrainError(f"{out} already exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise UptrainError(f"cannot write {out}: {out.parent} is not an existing directory")


@contextmanager
def atomic_directory(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces `out` only if the body succeeds."""
    out = Path(out).absolute()
    check_output_path(out, overwrite)
    _remove_stale_temporaries(out)
    tmp = out.parent / f".{out.name}{TMP_TAG}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as err:
        raise UptrainError(f"cannot write {out}: {err.strerror or err}") from None
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.uptrain-old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
