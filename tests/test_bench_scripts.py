"""The benchmark scripts run end to end at a tiny size and print their JSON contract.

No timing assertions: speed is for the benchmarks themselves (BENCHMARKS.md), not for tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # six child interpreters that each import torch and transformers: ~40 s
def test_bench_calibrate_tiny(tmp_path):
    result = run_script("bench_calibrate.py", "--size-gb", "0.02", "--tokens", "128", "--seq-len", "64",
                        "--threads", "1", "--workdir", str(tmp_path))
    assert result["tokens"] == 128 and result["device"] == "cpu"
    assert set(result["rss_over_baseline_bytes"]) == {"layerwise", "whole"}
    assert all(result["seconds_per_token"][p] > 0 for p in ("layerwise", "whole"))
    assert result["rss_ratio_vs_whole"] > 0 and result["gpu_peak_bytes"] == {"layerwise": None, "whole": None}
    # Both paths read the same blocks in the same batches through the same layer code.
    assert result["moments_max_relative_difference"] < 1e-10
    assert result["double_layers"]["layers"] == 2 * result["layers"]
    assert set(result["targets_met"]) == {"rss_ratio_vs_whole<=0.25", "double_layers_rss_not_higher"}
    assert all(math.isfinite(x) for x in numbers(result))
    assert list(tmp_path.iterdir()) == []  # checkpoints cleaned up


def device_check(env: dict) -> subprocess.CompletedProcess:
    import os

    full_env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPTS / "device_check.sh")], env=full_env, capture_output=True, text=True,
                          timeout=600)


def test_device_check_gpu_arguments_parse():
    # The GPU preset cannot run here; each script's own parser (and uptrain's config) checks its
    # arguments, so a typo is caught before a GPU session is spent on it.
    import importlib.util
    import shlex

    from uptrain.cli import build_parser
    from uptrain.train.config import config_from_args

    proc = device_check({"DEVICE_CHECK_PRINT_ARGS": "1"})
    assert proc.returncode == 0, proc.stderr
    args = json.loads(proc.stdout)
    for script in ("train", "decode", "calibrate"):
        spec = importlib.util.spec_from_file_location(f"bench_{script}", SCRIPTS / f"bench_{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(SCRIPTS))  # bench_calibrate imports bench_convert
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(SCRIPTS))
        parse = module.parse_args if script == "train" else module.build_parser().parse_args
        parsed = parse(shlex.split(args[script]))
        assert parsed.device == "cuda", script
    hidden, layers, heads, intermediate = map(int, args["uptrain_model"].split())
    flat = 12 * hidden * hidden * layers  # ≈ attention + MLP at intermediate 2.75 × hidden
    assert 0.8e9 < flat < 1.5e9 and intermediate == int(2.75 * hidden)  # "~1B"
    config = config_from_args(build_parser("train").parse_args(
        ["train", "--source", "SRC", "--train_data", "t.txt", "--eval_data", "e.txt", "--output_dir", "out",
         *shlex.split(args["uptrain"])]))
    assert config.mixed_precision == "bf16" and config.num_kv_heads == 4
    # Within 8 minutes: the steps' limits, plus 4 × 5 s of --kill-after and the checks and summary.
    assert sum(map(int, args["timeouts"].split())) + 4 * 5 + 20 <= 480
    assert device_check({"DEVICE_CHECK_SIZE": "big"}).returncode == 2
    if not torch_cuda_available():  # the GPU preset stops at once, with the reason as its JSON line
        proc = device_check({})
        assert proc.returncode == 1 and "sees no CUDA GPU" in json.loads(proc.stdout.splitlines()[-1])["error"]


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow  # four steps, eight interpreters importing torch: 35-70 s on 2 shared cores
def test_device_check_tiny(tmp_path):
    proc = device_check({"DEVICE_CHECK_SIZE": "tiny", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["size"] == "tiny" and summary["device"] == "cpu"
    steps = summary["steps"]
    assert set(steps) == {"train", "decode", "calibrate", "uptrain"}
    assert all(s["ok"] for s in steps.values()), {k: s.get("error") for k, s in steps.items()}
    assert steps["train"]["result"]["tokens_per_second_ratio"] > 0 and steps["train"]["result"]["params"] > 0
    decode = steps["decode"]["result"]
    assert decode["head_ratio_bound"] == decode["num_heads"] / decode["num_kv_heads"]
    # Reading fewer bytes bounds the speed-up above 1 and below h/G.
    assert all(1 < b < decode["head_ratio_bound"] for b in decode["bandwidth_bound_speedup"].values())
    assert steps["calibrate"]["result"]["device"] == "cpu" and steps["calibrate"]["result"]["tokens"] == 128
    uptrain = steps["uptrain"]["result"]
    assert uptrain["final_num_kv_heads"] == 2 and uptrain["steps"] == 2 and uptrain["params"] > 0
    assert any(f.endswith(".safetensors") for f in uptrain["final_files"])
    assert summary["targets_met"] == {"uptrain_wrote_final": True}  # no MFU target without a GPU peak
    assert all(math.isfinite(x) for x in numbers(summary))
    assert not list(tmp_path.glob("device-check-*"))  # the work folder is removed
