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

from tests.convert.test_calibrated_whisper import speech  # noqa: F401  (the fixture)

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
    for key in (
        "time_ratio_vs_floor",
        "time_ratio_vs_naive",
        "rss_ratio_vs_naive",
        "peak_rss_bytes",
        "baseline_rss_bytes",
        "largest_tensor_bytes",
        "largest_shard_bytes",
    ):
        assert isinstance(result[key], (int, float)) and result[key] > 0, key
    assert all(math.isfinite(x) for x in numbers(result))
    assert result["largest_tensor_bytes"] <= result["largest_shard_bytes"]
    assert set(result["time_ratio_vs_floor_by_source_hash"]) == {"blake3", "sha256", "none"}
    assert result["double_layers"]["layers"] == 2 * result["layers"]
    assert set(result["targets_met"]) >= {
        "time_ratio_vs_floor<=1.2",
        "rss_over_baseline<=3x_largest_tensor",
        "rss_ratio_vs_naive<=0.2",
        "double_layers_rss_not_higher",
    }
    assert list(tmp_path.iterdir()) == []  # checkpoints cleaned up


def test_bench_copy_chunks_tiny(tmp_path):
    result = run_script(
        "bench_copy_chunks.py", "--size-gb", "0.02", "--repeats", "1", "--chunks", "64K,1M", "--workdir", str(tmp_path)
    )
    assert set(result["seconds"]) == {"chunks 64K", "chunks 1M", "copy_file_range"}
    assert result["bytes"] > 0 and all(math.isfinite(x) and x >= 0 for x in numbers(result))
    assert list(tmp_path.iterdir()) == []


def test_bench_decode_tiny():
    heads, kv_heads = 8, 2
    result = run_script(
        "bench_decode.py",
        "--contexts",
        "8,16",
        "--batches",
        "1,2",
        "--new-tokens",
        "2",
        "--repeats",
        "1",
        "--hidden",
        "64",
        "--heads",
        str(heads),
        "--num-kv-heads",
        str(kv_heads),
        "--layers",
        "2",
        "--vocab",
        "128",
        "--threads",
        "1",
    )
    assert result["kv_bytes_ratio"] == kv_heads / heads
    assert set(result["decode_speedup"]) == {f"ctx{c}_batch{b}" for c in (8, 16) for b in (1, 2)}
    for row in result["settings"]:
        assert row["gqa_kv_bytes"] * heads == row["mha_kv_bytes"] * kv_heads  # measured, exactly G/h
    assert all(math.isfinite(x) and x >= 0 for x in numbers(result))


def test_bench_train_tiny():
    result = run_script(
        "bench_train.py",
        "--hidden",
        "64",
        "--layers",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--repeats",
        "1",
    )
    assert result["tokens_per_second_ratio"] > 0 and result["mfu"] is None  # no MFU on CPU without peak_flops
    # AdamW's step alone, torch's three implementations (all three run on a CPU in torch >= 2.4)
    assert set(result["optimizer_step_s"]) == {"for-loop", "foreach", "fused"} and result["fused_vs_foreach"] > 0
    assert all(math.isfinite(x) and x > 0 for x in numbers(result))


@pytest.mark.slow  # six child interpreters that each import torch and transformers: ~40 s
def test_bench_calibrate_tiny(tmp_path):
    result = run_script(
        "bench_calibrate.py",
        "--size-gb",
        "0.02",
        "--tokens",
        "128",
        "--seq-len",
        "64",
        "--threads",
        "1",
        "--workdir",
        str(tmp_path),
    )
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


def test_bench_value_fit_tiny(speech, tmp_path):  # noqa: F811
    from tests.convert.test_calibrated_whisper import whisper

    src = whisper(tmp_path / "src")
    argv = ["--model", str(src), "--calibration-data", str(speech), "--language", "en", "--kv-heads", "2"]
    result = run_script("bench_value_fit.py", *argv, "--clips", "4", "--workdir", str(tmp_path / "out"))
    assert set(result["wall_s"]) == set(result["peak_rss_bytes"]) == {"inputs", "output"}
    assert result["output_over_inputs"] == result["wall_s"]["output"] / result["wall_s"]["inputs"]
    assert all(math.isfinite(x) and x > 0 for x in numbers(result))
    for fit in ("inputs", "output"):  # each conversion is the one its name says
        record = json.loads((tmp_path / "out" / fit / "uptrain.json").read_text())["calibration"]
        assert record.get("value_fit", "inputs") == fit and record["examples"] == 4


def device_check(env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """The check as the device tool runs it: logs into $OUT; no wheels unless the test gives some
    (this venv has every package, and a checkout's .whl/ holds the GPU machine's Python 3.12 ones)."""
    import os

    full_env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
        "OUT": str(tmp_path / "out"),
        "WHEELS": str(tmp_path / "no-wheels"),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPTS / "device_check.sh")], env=full_env, capture_output=True, text=True, timeout=900
    )


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_device_check_gpu_arguments_parse(tmp_path):
    # The GPU preset cannot run here; each script's own parser (and uptrain's config) checks its
    # arguments, so a typo is caught before a GPU session is spent on it.
    import importlib.util
    import shlex

    from uptrain.cli import build_parser
    from uptrain.train.config import config_from_args

    proc = device_check({"DEVICE_CHECK_PRINT_ARGS": "1"}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    args = json.loads(proc.stdout)
    for step, script in (
        ("train", "train"),
        ("decode", "decode"),
        ("decode_compile", "decode"),
        ("calibrate", "calibrate"),
    ):
        spec = importlib.util.spec_from_file_location(f"bench_{script}", SCRIPTS / f"bench_{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(SCRIPTS))  # bench_calibrate imports bench_convert
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(SCRIPTS))
        parse = module.parse_args if script == "train" else module.build_parser().parse_args
        parsed = parse(shlex.split(args[step]))
        assert parsed.device == "cuda", step
        if step.startswith("decode"):  # issue #18's GPU size: 16k context in bf16, with and without compile
            assert parsed.dtype == "bfloat16" and "16384" in parsed.contexts.split(","), step
        if step == "calibrate":  # one 7B layer's merge timed on the GPU (issue #20)
            assert parsed.merge_hidden == 4096 and parsed.shape == "7b"
    hidden, layers, heads, intermediate = map(int, args["uptrain_model"].split())
    flat = 12 * hidden * hidden * layers  # ≈ attention + MLP at intermediate 2.75 × hidden
    assert 0.8e9 < flat < 1.5e9 and intermediate == int(2.75 * hidden)  # "~1B"
    config = config_from_args(
        build_parser("train").parse_args(
            [
                "train",
                "--source",
                "SRC",
                "--train_data",
                "t.txt",
                "--eval_data",
                "e.txt",
                "--output_dir",
                "out",
                *shlex.split(args["uptrain"]),
            ]
        )
    )
    assert config.mixed_precision == "bf16" and config.num_kv_heads == 4
    # Within 8 minutes: the steps' limits, 5 s of --kill-after each, ~15 s of wheels and checks and
    # ~10 s of summary (the budget holds the total anyway: each limit is cut to what is left).
    timeouts = list(map(int, args["timeouts"].split()))
    assert len(timeouts) == 5 and sum(timeouts) + 5 * 5 + 25 <= int(args["budget"]) == 480
    assert device_check({"DEVICE_CHECK_SIZE": "big"}, tmp_path).returncode == 2
    if not torch_cuda_available():  # the GPU preset stops at once, with the reason as its JSON line
        proc = device_check({}, tmp_path)
        assert proc.returncode == 1 and "sees no CUDA GPU" in last_json(proc)["error"]
        assert (tmp_path / "out" / "summary.json").read_text().strip() == proc.stdout.strip().splitlines()[-1]


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def write_wheel(folder: Path, name: str, version: str) -> Path:
    """A real, minimal pure-Python wheel: one module and its dist-info."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def test_device_check_installs_wheels_and_keeps_to_its_budget(tmp_path):
    # A budget too short for any step: the wheels are installed and used, every step is recorded
    # as skipped, and the summary still comes out, in $OUT as well.
    write_wheel(tmp_path / "wheels", "device_check_probe", "0.1")
    proc = device_check(
        {"DEVICE_CHECK_SIZE": "tiny", "WHEELS": str(tmp_path / "wheels"), "CHECK_BUDGET": "15"}, tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc)
    assert summary["versions"]["wheels"] == {"device_check_probe": "0.1"}
    assert summary["versions"]["torch"] and summary["logs"] == str(tmp_path / "out")
    assert {name: (s["ok"], s["error"], s["limit"]) for name, s in summary["steps"].items()} == {
        name: (False, "skipped: no time left", 0)
        for name in ("train", "decode", "decode_compile", "calibrate", "uptrain")
    }
    assert (tmp_path / "out" / "summary.json").read_text().strip() == proc.stdout.strip().splitlines()[-1]
    assert not list(tmp_path.glob("device-check-*"))  # the work folder, with the installed wheels, is removed


def test_device_check_reports_a_broken_wheel(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    proc = device_check({"DEVICE_CHECK_SIZE": "tiny", "WHEELS": str(tmp_path / "wheels")}, tmp_path)
    assert proc.returncode == 1
    failure = last_json(proc)
    assert failure["error"].startswith(f"installing the wheels from {tmp_path / 'wheels'} failed: ")
    assert failure["log_tail"] and (tmp_path / "out" / "setup.log").exists()


def test_device_check_records_failing_steps_and_goes_on(tmp_path):
    # Every step fails at once; each is recorded with its exit status and its log's tail, and the
    # check goes on to the next one and ends with its summary.
    proc = device_check(
        {
            "DEVICE_CHECK_SIZE": "tiny",
            "TRAIN_ARGS": "--bogus",
            "DECODE_ARGS": "--bogus",
            "DECODE_COMPILE_ARGS": "--bogus",
            "CALIBRATE_ARGS": "--bogus",
            "UPTRAIN_MODEL": "x",
        },
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = last_json(proc)["steps"]
    assert list(steps) == ["train", "decode", "decode_compile", "calibrate", "uptrain"]
    for name, step in steps.items():
        assert not step["ok"] and "result" not in step, name
        assert step["error"].startswith("exit "), (name, step["error"])
        assert step["log_tail"][-1] in step["error"], name  # the reason is the log's last line
    assert "unrecognized arguments: --bogus" in steps["decode_compile"]["error"]
    assert "ValueError" in steps["uptrain"]["error"]
    # What comes back from the device machine: at most 8 files, all in $OUT.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [f"{name}.log" for name in steps] + ["setup.log", "summary.json"]
    )


@pytest.mark.slow  # five steps, ten interpreters importing torch, two torch.compiles: 100-150 s on 2 shared cores
def test_device_check_tiny(tmp_path):
    proc = device_check({"DEVICE_CHECK_SIZE": "tiny"}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc)
    assert summary["size"] == "tiny" and summary["device"] == "cpu"
    steps = summary["steps"]
    assert set(steps) == {"train", "decode", "decode_compile", "calibrate", "uptrain"}
    assert all(s["ok"] for s in steps.values()), {k: s.get("error") for k, s in steps.items()}
    assert steps["train"]["result"]["tokens_per_second_ratio"] > 0 and steps["train"]["result"]["params"] > 0
    decode = steps["decode"]["result"]
    assert decode["head_ratio_bound"] == decode["num_heads"] / decode["num_kv_heads"]
    # Reading fewer bytes bounds the speed-up above 1 and below h/G.
    assert all(1 < b < decode["head_ratio_bound"] for b in decode["bandwidth_bound_speedup"].values())
    compiled = steps["decode_compile"]["result"]
    g_over_h = compiled["num_kv_heads"] / compiled["num_heads"]
    for setting in compiled["settings"].values():
        for path in ("eager", "compiled"):  # the same cache, eager (dynamic) or static: G/h of MHA's bytes
            assert setting["gqa"][path]["kv_cache_bytes"] == g_over_h * setting["mha"][path]["kv_cache_bytes"]
            assert setting["gqa_speedup"][path] > 0
        assert all(setting[m]["compiled"]["compile_s"] > 0 for m in ("mha", "gqa"))
    assert steps["calibrate"]["result"]["device"] == "cpu" and steps["calibrate"]["result"]["tokens"] == 128
    assert steps["calibrate"]["result"]["merge_one_layer"]["hidden"] == 256
    train = steps["train"]["result"]  # the compiled loop and AdamW's three implementations ran
    assert train["compile_speedup"] > 0 and set(train["optimizer_step_s"]) == {"for-loop", "foreach", "fused"}
    uptrain = steps["uptrain"]["result"]
    assert uptrain["final_num_kv_heads"] == 2 and uptrain["steps"] == 2 and uptrain["params"] > 0
    assert any(f.endswith(".safetensors") for f in uptrain["final_files"])
    assert summary["targets_met"] == {"uptrain_wrote_final": True}  # no MFU target without a GPU peak
    assert all(math.isfinite(x) for x in numbers(summary))
    assert (tmp_path / "out" / "summary.json").read_text().strip() == proc.stdout.strip().splitlines()[-1]
    assert "--- stdout ---" in (tmp_path / "out" / "decode.log").read_text()  # stderr, then stdout
    assert not list(tmp_path.glob("device-check-*"))  # the work folder is removed


def test_bench_data_tiny():
    result = run_script(
        "bench_data.py",
        *("--seq-len", "32", "--read-tokens", "20000", "--window-tokens", "4096"),
        *("--resume-steps", "2", "20", "--repeats", "1", "--train-steps", "3"),
    )
    assert set(result["resume_seconds"]) == {"0", "2", "20"} and result["resume_ratio_last_vs_first"] > 0
    assert 0 <= result["data_wait_share"] < 1
    assert all(math.isfinite(x) and x >= 0 for x in numbers(result))
