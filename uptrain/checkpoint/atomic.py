"""Outputs appear whole or not at all, and only one run at a time writes each of them.

- `atomic_directory`: an output folder is built in a hidden sibling (`.OUT.uptrain-tmp-PID`) and
  renamed into place when complete; an existing OUT (with --overwrite) is exchanged with it in
  one step where the file system can (`renameat2(RENAME_EXCHANGE)`), else first moved aside to
  `.OUT.uptrain-old-PID`, and deleted once the new one is in.
- `atomic_file`: one output file is written to a hidden sibling (`.NAME.uptrain-tmp-PID`) and
  renamed over NAME when complete: a kill leaves the previous file or the new one, never a part.
- `OutputLock`: an `fcntl.flock` on a lock file, held for as long as a run writes an output. A
  second run is refused at once, not after its work. The kernel drops a flock when its holder
  dies, even by kill -9, so a killed run never leaves a lock that blocks the next one.
- Under the lock, leftovers of killed runs are put right before anything else: a previous OUT
  that a kill left moved aside comes back, temporary siblings are deleted. Only lock holders
  create those siblings, so whatever the lock holder finds of them belongs to a dead run.

See docs/failure_modes.md for every case and why a lock rather than a rename that refuses an
existing target.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import glob
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from uptrain import UptrainError

TMP_TAG = ".uptrain-tmp-"
OLD_TAG = ".uptrain-old-"
LOCK_TAG = ".uptrain-lock"


class OutputLock:
    """An exclusive, non-waiting `flock` on `path`, which names what it guards as `target`.

    The lock file records the holder's pid (for the refusal message) and is removed on release.
    Two `open`s of one file conflict even within one process: release before locking again.
    """

    def __init__(self, path: Path, target: Path, what: str = "output"):
        self.path, self.target, self.what = Path(path), Path(target), what
        self.fd: int | None = None

    def acquire(self) -> OutputLock:
        for _ in range(100):
            try:
                # O_NOFOLLOW: a symbolic link planted at the lock's name must not make uptrain
                # truncate (or create) whatever it points to.
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    raise UptrainError(
                        f"cannot lock {self.target}: its lock file {self.path} is a symbolic link; remove it"
                    ) from None
                raise UptrainError(f"cannot write {self.target}: {err.strerror or err}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UptrainError(
                    f"{self.target} is being written by another uptrain run (pid {holder}); "
                    f"wait for it to finish or choose another {self.what}"
                ) from None
            except OSError:
                pass  # a file system without locks (ENOLCK): go on unguarded, as uptrain always did there
            # The previous holder removes the file when it releases: if it did so between our open
            # and our flock, we hold a lock nobody else will ever see. Start again on the new file.
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return self
            os.close(fd)
        raise UptrainError(f"cannot lock {self.target}: its lock file {self.path} keeps changing")

    def release(self) -> None:
        if self.fd is None:
            return
        if _same_file(self.fd, self.path):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def remove_stale_locks(folder: Path) -> None:
    """Remove the lock files in `folder` that no live process holds: a killed holder leaves its
    file behind (the kernel dropped the lock itself). Held ones are left alone."""
    for path in Path(folder).glob(f".*{LOCK_TAG}"):
        try:
            with OutputLock(path, path):
                pass
        except UptrainError:
            pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}{tag}"


def output_lock(out: Path) -> OutputLock:
    """The lock of an output folder: a file beside it (the folder itself is replaced whole)."""
    return OutputLock(_sibling(out, LOCK_TAG), out)


def _recover(out: Path) -> None:
    """Put right what killed runs left beside `out`. Call only while holding its lock."""

    def leftovers(tag: str) -> list[Path]:
        return [Path(p) for p in glob.glob(glob.escape(str(_sibling(out, tag))) + "*")]

    olds = sorted(leftovers(OLD_TAG), key=lambda p: p.lstat().st_ctime)
    if olds and not os.path.lexists(out):
        # A run was killed between moving the previous OUT aside and renaming its own in: it never
        # finished, so the previous OUT is what the user has. (The newest one, should there be more.)
        olds.pop().rename(out)
    for leftover in olds + leftovers(TMP_TAG):
        shutil.rmtree(leftover, ignore_errors=True)


def _check_target(out: Path, overwrite: bool) -> None:
    if out.is_symlink():
        raise UptrainError(f"{out} is a symbolic link; give the folder itself or another output path")
    if out.exists() and not out.is_dir():
        raise UptrainError(
            f"{out} is a file, not a folder; --overwrite replaces only folders: choose another output path"
        )
    if out.exists() and not overwrite:
        raise UptrainError(f"{out} already exists; pass --overwrite to replace it")


def _check_parent(out: Path) -> None:
    if not out.parent.is_dir():
        raise UptrainError(f"cannot write {out}: {out.parent} is not an existing directory")


def check_apart(out: Path, inputs: Iterable[tuple[str, Path]], what: str = "output") -> None:
    """Refuse an output folder that is one of the run's inputs, lies inside one, or holds one:
    writing it (or emptying it for --overwrite) would replace or pollute that input. `inputs`
    are (what it is, path) pairs; paths that do not exist here (Hub ids) are skipped."""
    out = Path(out).resolve()
    for name, path in inputs:
        if not Path(path).exists():
            continue
        path = Path(path).resolve()
        if out == path or path in out.parents or out in path.parents:
            raise UptrainError(f"{what} {out} overlaps the {name} {path}; choose another folder")


def check_output_path(out: Path, overwrite: bool) -> None:
    """Refuse early, before any work, an OUT that exists, cannot be created or that another run
    is writing. Restores an OUT that a killed --overwrite run left moved aside."""
    out = Path(out).absolute()
    _check_parent(out)
    with output_lock(out):
        _recover(out)
        _check_target(out, overwrite)


@contextmanager
def atomic_directory(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces `out` only if the body succeeds.

    Holds `out`'s lock throughout: a second run aiming at the same `out` is refused at once
    with one line, and the swap below can never interleave with another run's.
    """
    out = Path(out).absolute()
    _check_parent(out)
    with output_lock(out):
        _recover(out)
        _check_target(out, overwrite)
        tmp = _sibling(out, f"{TMP_TAG}{os.getpid()}")
        try:
            tmp.mkdir()
        except OSError as err:
            raise UptrainError(f"cannot write {out}: {err.strerror or err}") from None
        try:
            yield tmp
            _check_target(out, overwrite)  # something other than uptrain may have made OUT meanwhile
            _swap_in(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def replace_directory(folder: Path, out: Path) -> None:
    """Rename the finished `folder` to `out`, replacing an existing `out` as `atomic_directory`
    does, for a writer that builds its folder across runs (`uptrain tokenize` resumes). Call
    only while holding `out`'s lock (`output_lock`)."""
    _swap_in(Path(folder), Path(out))


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing an existing `out`. A kill at any point leaves either the
    previous `out` (in place, or aside where `_recover` brings it back) or the new one."""
    if not out.exists():
        tmp.rename(out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp)  # the previous OUT, now; a kill before this leaves a leftover `_recover` deletes
        return
    # No atomic exchange here: move OUT aside first. A kill between the two renames leaves no OUT
    # until the next run to it puts the previous one back (`_recover`).
    old = _sibling(out, f"{OLD_TAG}{os.getpid()}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; it replaces `path` (one rename) only if the
    body succeeds, and is removed otherwise. A kill leaves the temporary behind: whoever holds
    the lock of the folder removes it (`remove_temporaries`)."""
    path = Path(path)
    tmp = _sibling(path, f"{TMP_TAG}{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_file(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` whole or not at all (`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def remove_temporaries(folder: Path) -> None:
    """Delete what killed writers left in `folder` (`atomic_file`'s and `atomic_directory`'s
    temporaries). Call only while holding the lock that every writer there holds."""
    for leftover in Path(folder).glob(f".*{TMP_TAG}*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


RENAME_EXCHANGE = 2  # <linux/fs.h>
AT_FDCWD = -100


@functools.cache
def _renameat2():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2  # glibc ≥ 2.28
    except (OSError, AttributeError):
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing directory entries in one step (Linux `renameat2(RENAME_EXCHANGE)`), so
    that no moment exists without either. False, with nothing changed, where the kernel, the
    C library or the file system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    sys.audit("os.rename", a, b, -1, -1)  # a rename: report it as os.rename reports its own
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
