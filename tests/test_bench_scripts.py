"""The benchmark scripts run end to end at a tiny size and print their JSON contract.

No timing assertions: speed is for the benchmarks themselves (BENCHMARKS.md), not for tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 2, "a readable table comes before the JSON line"
    return json.loads(lines[-1])


def numbers(value):
    """Every number in a JSON value, however nested (booleans and nulls are not numbers)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_bench_convert_tiny(tmp_path):
    result = run_script("bench_convert.py", "--size-gb", "0.02", "--repeats", "1", "--workdir", str(tmp_path))
    for key in ("time_ratio_vs_floor", "time_ratio_vs_naive", "rss_ratio_vs_naive", "peak_rss_bytes",
                "baseline_rss_bytes", "largest_tensor_bytes", "largest_shard_bytes"):
        assert isinstance(result[key], (int, float)) and result[key] > 0, key
    assert all(math.isfinite(x) for x in numbers(result))
    assert result["largest_tensor_bytes"] <= result["largest_shard_bytes"]
    assert set(result["time_ratio_vs_floor_by_source_hash"]) == {"blake3", "sha256", "none"}
    assert result["double_layers"]["layers"] == 2 * result["layers"]
    assert set(result["targets_met"]) >= {"time_ratio_vs_floor<=1.2", "rss_over_baseline<=3x_largest_tensor",
                                          "rss_ratio_vs_naive<=0.2", "double_layers_rss_not_higher"}
    assert list(tmp_path.iterdir()) == []  # checkpoints cleaned up


def test_bench_copy_chunks_tiny(tmp_path):
    result = run_script("bench_copy_chunks.py", "--size-gb", "0.02", "--repeats", "1", "--chunks", "64K,1M",
                        "--workdir", str(tmp_path))
    assert set(result["seconds"]) == {"chunks 64K", "chunks 1M", "copy_file_range"}
    assert result["bytes"] > 0 and all(math.isfinite(x) and x >= 0 for x in numbers(result))
    assert list(tmp_path.iterdir()) == []


def test_bench_decode_tiny():
    heads, kv_heads = 8, 2
    result = run_script("bench_decode.py", "--contexts", "8,16", "--batches", "1,2", "--new-tokens", "2",
                        "--repeats", "1", "--hidden", "64", "--heads", str(heads), "--num-kv-heads", str(kv_heads),
                        "--layers", "2", "--vocab", "128", "--threads", "1")
    assert result["kv_bytes_ratio"] == kv_heads / heads
    assert set(result["decode_speedup"]) == {f"ctx{c}_batch{b}" for c in (8, 16) for b in (1, 2)}
    for row in result["settings"]:
        assert row["gqa_kv_bytes"] * heads == row["mha_kv_bytes"] * kv_heads  # measured, exactly G/h
    assert all(math.isfinite(x) and x >= 0 for x in numbers(result))


def test_bench_train_tiny():
    result = run_script("bench_train.py", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                        "--seq-len", "32", "--batch-size", "2", "--steps", "3", "--warmup", "1", "--repeats", "1")
    assert result["tokens_per_second_ratio"] > 0 and result["mfu"] is None  # no MFU on CPU without peak_flops
    assert all(math.isfinite(x) and x > 0 for x in numbers(result))
