"""The version floors in pyproject.toml are tested: a second environment holds every runtime
dependency at exactly its floor (`name>=X` installed as `name==X`; torch at the CPU build
constraints.txt pins), and the quick tests of each part (conversion, the GQA modeling, training
with accelerate and datasets, speed, compare) pass in it against this checkout.

The environment is built once from the package registry and cached under
`~/.cache/uptrain-tests/`, keyed by the floors; uptrain itself is installed into it in editable
mode from this checkout at every run (without dependencies), so the code under test is this
checkout's. Skipped when the registry cannot be reached, except under CI (`CI=true`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from tests.modeling.second_environment import CACHE, CONSTRAINTS, cached_environment

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 900
# One quick test file per part of uptrain that leans on a dependency's API.
QUICK_TESTS = [
    "tests/convert/test_parity.py",
    "tests/modeling/test_workflows.py",
    "tests/train/test_loop.py",
    "tests/train/test_data_stream.py",
    "tests/train/test_tracking.py",
    "tests/test_speed.py",
    "tests/compare/test_study.py",
]


def floors() -> dict[str, str]:
    """Runtime dependency → its floor, from pyproject.toml. Every dependency must have one."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)(,<[0-9.]+)?", requirement.replace(" ", ""))
        assert match, f"dependency {requirement!r} has no `>=` floor to test"
        found[match.group(1).lower()] = match.group(2)
    return found


def test_every_dependency_has_a_floor_and_torch_matches_the_constraint():
    pinned = floors()
    constraint = dict(line.split("==") for line in CONSTRAINTS.read_text().splitlines() if "==" in line)
    # torch's floor is the CPU build CI installs (the only one on this machine's disk).
    assert Version(pinned["torch"]) == Version(constraint["torch"])


def floors_python() -> Path:
    requirements = [f"{name}=={version}" for name, version in sorted(floors().items()) if name != "torch"]
    digest = hashlib.sha256("\n".join(requirements + [sys.version]).encode()).hexdigest()[:12]
    return cached_environment(
        CACHE / f"floors-{digest}",
        requirements + ["torch", "pytest>=8", "psutil>=5.9", "hypothesis>=6.100"],
        "dependency-floors",
        BUILD_TIMEOUT,
    )


@pytest.mark.slow
def test_the_quick_tests_pass_at_the_dependency_floors():
    python = floors_python()
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"], check=True, capture_output=True, text=True
    ).stdout
    installed = {p["name"].lower(): Version(Version(p["version"]).public) for p in json.loads(listed)}
    for name, floor in floors().items():
        assert installed.get(name) == Version(floor), (name, installed.get(name), floor)
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *QUICK_TESTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
