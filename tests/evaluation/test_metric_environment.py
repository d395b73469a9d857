"""The metric libraries of `uptrain[eval]` (jiwer, sacrebleu, rouge-score, lm-eval) are tested in a
cached environment of their own, so the main one stays without them (and tests the one-line
message naming the extra): uptrain's runtime dependencies, the extra at exactly its floors, and
this checkout (`cached_environment`). Its cold build took 73 s on 2 quiet cores and up to 3 min
52 s on 2 cores other jobs kept busy, pip's download cache warm (each build records its seconds in
the environment's `complete` file); the library tests then take 35–55 s."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tomllib

from tests.modeling.second_environment import CACHE, REPO, cached_environment

LIBRARY_TESTS = "tests/evaluation/test_metric_libraries.py"


def eval_requirements() -> list[str]:
    """uptrain's runtime dependencies as pyproject.toml gives them, and the `eval` extra pinned at its floors."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = [
        re.sub(r">=([0-9.]+)(,<[0-9.]+)?$", r"==\1", r.replace(" ", ""))
        for r in project["optional-dependencies"]["eval"]
    ]
    return project["dependencies"] + pinned + ["pytest>=8", "psutil>=5.9", "hypothesis>=6.100"]


def eval_python():
    requirements = eval_requirements()
    digest = hashlib.sha256("\n".join(requirements + [sys.version]).encode()).hexdigest()[:12]
    return cached_environment(CACHE / f"eval-{digest}", requirements, "uptrain[eval]")


def test_every_eval_library_has_a_floor_that_the_environment_pins():
    pins = [r for r in eval_requirements() if "==" in r]
    assert {p.split("==")[0] for p in pins} == {"jiwer", "sacrebleu", "rouge-score", "lm-eval"}


def test_the_metric_library_tests_pass_with_the_extra_installed(tmp_path):
    python = eval_python()
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rs", "--basetemp", str(tmp_path / "in")]
        + [LIBRARY_TESTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
