"""Fault injection: run a piece of uptrain in a forked child that SIGKILLs itself at its n-th
file-system step, as a power cut of the process would (kill -9: no cleanup, no finally).

The steps are counted from Python's audit events (`sys.addaudithook`), so no product code
knows about the test: every rename (`os.rename`/`os.replace`, pathlib's too), every file
opened for writing, every mkdir, rmtree and remove under `root`. The hook sees a step before
it happens, so "killed at step n" means steps 1 … n-1 were done and step n was not.

A fork, not a fresh interpreter: the child starts with torch and uptrain already imported, so
a sweep over every step costs a fraction of a second per step.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from tests.robustness.opened_files import _writes

EVERY_STEP = frozenset({"os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "open"})
RENAMES = frozenset({"os.rename"})  # os.rename and os.replace both raise it
NEVER = 10**9


def run_and_kill_at(
    n: int, root: Path, body: Callable[[], object], events: frozenset[str] = EVERY_STEP
) -> tuple[int, int]:
    """Run `body()` in a forked child killed at its n-th file-system step under `root`, counting
    the audit `events` given ("open" counts only opens for writing).

    Returns (how the child ended: -9 if killed, else its exit code, steps counted). With
    n = NEVER the child runs to the end and the count is that of a whole run.
    """
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            count = 0
            prefix = str(Path(root).absolute()) + os.sep

            def hook(event: str, args: tuple) -> None:
                nonlocal count
                if event not in events or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
                    return
                if event == "open" and not _writes(args[1], args[2] if len(args) > 2 else 0):
                    return
                if not (str(Path(os.fsdecode(args[0])).absolute()) + os.sep).startswith(prefix):
                    return
                count += 1
                if count == n:
                    os.write(write_end, count.to_bytes(8, "little"))
                    os.kill(os.getpid(), signal.SIGKILL)

            sys.addaudithook(hook)
            try:
                result = body()
                code = result if isinstance(result, int) else 0
            except BaseException:
                code = 3
            os.write(write_end, count.to_bytes(8, "little"))
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    data = b""
    while chunk := os.read(read_end, 8):
        data = chunk
    os.close(read_end)
    steps = int.from_bytes(data, "little") if data else 0
    return (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), steps
