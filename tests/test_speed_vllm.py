"""`uptrain speed --engine vllm`: MHA and each G served in vLLM side by side, in one run.

Run in the cached vLLM environment (tests/modeling/vllm_environment.py), on the tiny Llama of
tests/modeling/test_vllm.py (4 heads of 32) and its G = 2 and G = 1 conversions: the KV
capacity each engine reports in the same space grows exactly h/G-fold, and so does the maximum
concurrency; every model is timed. Without vLLM, one line says how to install it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.modeling.test_vllm import HEADS, tiny_llama
from tests.modeling.vllm_environment import vllm_python
from uptrain.convert import convert_checkpoint


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_one_line_says_how_to_install_it(tmp_path):
    tiny_llama(tmp_path / "llama")
    result = subprocess.run(
        [sys.executable, "-m", "uptrain", "speed", "--engine", "vllm", str(tmp_path / "llama"), "--context", "16"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "pip install 'uptrain[vllm]'" in result.stderr and "Traceback" not in result.stderr


def test_a_context_beyond_the_positions_is_refused_before_vllm_is_needed(tmp_path):
    tiny_llama(tmp_path / "llama")
    positions = json.loads((tmp_path / "llama" / "config.json").read_text())["max_position_embeddings"]
    result = subprocess.run(
        [sys.executable, "-m", "uptrain", "speed", "--engine", "vllm", str(tmp_path / "llama")]
        + ["--context", str(positions - 1), "--new-tokens", "2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"is beyond the model's {positions} positions" in result.stderr


@pytest.mark.slow
def test_speed_in_vllm_reports_mha_and_each_g_side_by_side(tmp_path):
    tiny_llama(tmp_path / "llama-g4")
    models = [tmp_path / "llama-g4"]
    for g in (2, 1):
        models.append(convert_checkpoint(tmp_path / "llama-g4", tmp_path / f"llama-g{g}", g, progress=False))
    python = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "VLLM_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    command = [str(python), "-m", "uptrain", "speed", "--engine", "vllm", *map(str, models)]
    flags = ["--context", "32", "--new-tokens", "8", "--batch", "2", "--repeats", "1", "--kv-cache-gib", "1"]
    result = subprocess.run([*command, *flags, "--json"], env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["num_kv_heads"] for r in rows] == [4, 2, 1]
    mha = rows[0]
    for r in rows:
        assert r["kv_cache_tokens"] == mha["kv_cache_tokens"] * HEADS // r["num_kv_heads"]
        assert r["max_concurrency"] == r["kv_cache_tokens"] / (32 + 8)
        assert r["time_per_sample_s"] > 0 and r["output_tokens_per_s"] == 2 * 8 / r["time_per_sample_s"]
