"""A second Python environment with transformers 4.57 (the last 4.x), for the tests that load
converted checkpoints the way a transformers 4 user does: without uptrain, from the files
beside the weights; and `cached_environment`, the builder of the other cached environments
(the dependency floors', the metric libraries' of `uptrain[eval]`), which hold this checkout.

Built once from the package registry with pip and cached under
`~/.cache/uptrain-tests/`, keyed by the versions it holds (Python, torch, the transformers
requirement): transformers 4.57 and its dependencies, safetensors, and the torch this test
run uses (the local CPU build pip finds on disk here, pinned by the repository's
constraints.txt). Nothing of uptrain is installed in it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TRANSFORMERS_4 = "transformers==4.57.*"
CACHE = Path(os.environ.get("UPTRAIN_TEST_CACHE", Path.home() / ".cache" / "uptrain-tests"))
CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"
BUILD_TIMEOUT = 600


def torch_requirement() -> str:
    return f"torch=={torch.__version__.split('+')[0]}"


def key() -> str:
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return f"{TRANSFORMERS_4.replace('==', '-').replace('.*', '')}-{torch_requirement().replace('==', '-')}-{python}"


def transformers4_python() -> tuple[Path, dict]:
    """The Python of the cached environment (built when missing) and what it holds
    (`versions.json`: package → version). Skips the calling test when the registry cannot be
    reached, except under CI (`CI=true`), where it fails: CI must run these tests."""
    folder = CACHE / key()
    record = folder / "versions.json"  # written last: its presence means the build completed
    if not record.exists():
        _build(folder)
    return folder / "bin" / "python", json.loads(record.read_text())


def _build(folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final place and renamed in: a killed build leaves no half environment
    # that a later run would take for a complete one.
    staging = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(staging)], check=True, capture_output=True, text=True)
        python = staging / "bin" / "python"
        pip_install(python, [TRANSFORMERS_4, torch_requirement(), "safetensors"], "transformers 4.57", BUILD_TIMEOUT)
        listed = subprocess.run(
            [str(python), "-m", "pip", "list", "--format", "json"], check=True, capture_output=True, text=True
        ).stdout
        versions = {p["name"].lower(): p["version"] for p in json.loads(listed)}
        versions["build_seconds"] = round(time.monotonic() - started, 1)
        (staging / "versions.json").write_text(json.dumps(versions, indent=1))
        try:
            staging.rename(folder)
        except OSError:  # another run finished the same build first: use that one
            if not (folder / "versions.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def pip_install(python: Path, requirements: list[str], what: str, timeout: float) -> None:
    """Install `requirements` (constraints.txt applies) into the environment of `python`. When the
    registry cannot give them, the calling test is skipped, or fails under CI (`CI=true`)."""
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c", str(CONSTRAINTS)]
        + requirements,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if pip.returncode != 0:
        message = f"cannot build the {what} environment from the registry: {pip.stderr.strip()[-1500:]}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


REPO = Path(__file__).resolve().parents[2]


def cached_environment(
    folder: Path, requirements: list[str], what: str, timeout: int = 900, finish: Callable[[Path], None] | None = None
) -> Path:
    """The Python of the environment `folder` (under CACHE, named by a key of what it holds),
    built once with pip from `requirements` (constraints.txt applies), then this checkout
    installed into it in editable mode without dependencies at every call, so the code under
    test is this checkout's. Built in place (console scripts such as `wandb` name their
    interpreter by its absolute path, so the folder cannot be renamed after), under a lock;
    `finish` runs on the new environment's Python before it counts as built; `complete` is
    written last, so a killed build is redone, and it records the build's seconds.
    Skips the calling test when the registry cannot be reached, except under CI (`CI=true`)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    python = folder / "bin" / "python"
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "complete").exists():
            shutil.rmtree(folder, ignore_errors=True)
            started = time.monotonic()
            subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, capture_output=True)
            pip_install(python, requirements, what, timeout)
            if finish is not None:
                finish(python)
            seconds = round(time.monotonic() - started, 1)
            (folder / "complete").write_text("\n".join(requirements) + f"\n# built in {seconds} s\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(REPO)],
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    return python


def falcon_rewritten_between(version: str) -> bool:
    """Whether transformers `version` and the installed one lie on two sides of 5.25's rewrite of
    Falcon's attention (its eager divided the scores by √d, now multiplies by 1/√d): falcon_gqa
    follows each bit for bit at G = h (test_backends), so across the two it is the same model
    one rounding apart, and only its tokens and cache shapes can be compared exactly."""
    import transformers
    from packaging.version import Version

    rewritten = Version("5.25")
    return (Version(version) < rewritten) != (Version(transformers.__version__) < rewritten)
