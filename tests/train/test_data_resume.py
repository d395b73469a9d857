"""A streamed run killed and resumed trains on exactly the blocks of a run never killed, from the
data positions its checkpoint saved."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from tests.train.test_distributed import launch_two_processes
from tests.train.train_helpers import KILLER, curve, python_env, records
from uptrain.train.checkpoint import latest_checkpoint, load_data_state
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training


def two_files(assets, folder: Path) -> list[str]:
    halves = assets["train"].read_text().split("\n\n")
    files = []
    for i, part in enumerate((halves[: len(halves) // 2], halves[len(halves) // 2 :])):
        path = folder / f"train{i}.txt"
        path.write_text("\n\n".join(part) + "\n")
        files.append(str(path))
    return files


def test_streamed_run_killed_and_resumed_gives_the_same_weights(base_config, assets, tmp_path):
    # Two files, two data workers: each worker reads one file in its own process.
    files = two_files(assets, tmp_path)
    values = {
        **base_config,
        "train_data": files,
        "streaming": True,
        "data_workers": 2,
        "max_steps": 8,
        "save_every": 3,
        "eval_every": 4,
    }
    baseline = TrainConfig(**values)
    run_training(baseline)
    saved = load_data_state(latest_checkpoint(Path(baseline.output_dir))[1], 0)
    assert saved["processes"] == 1 and saved["data_workers"] == 2 and saved["next_share"] == 0
    assert all(share["epoch"] >= 0 and share["offset"] >= 0 for share in saved["shares"])

    values["output_dir"] = str(tmp_path / "killed")
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(values))
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(path), "5"], env=python_env(), capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    # Another number of data workers would give each worker other files: refused in one
    # line, before the resume that keeps them.
    other = subprocess.run(
        [str(Path(sys.executable).parent / "uptrain"), "train", "--config", str(path), "--resume"]
        + ["--data_workers", "1"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert other.returncode != 0
    assert "split over 1 processes × 2 data_workers" in other.stderr and "Traceback" not in other.stderr
    resumed = subprocess.run(
        [str(Path(sys.executable).parent / "uptrain"), "train", "--config", str(path), "--resume"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "step_00000003" in resumed.stdout
    assert curve(values["output_dir"]) == curve(baseline.output_dir)
    assert all(r["perf/data_wait_s"] >= 0 for r in records(values["output_dir"]) if r["step"] > 0)
    a = load_file(Path(baseline.output_dir) / "final" / "model.safetensors")
    b = load_file(Path(values["output_dir"]) / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_processes_resume_their_own_shares_and_refuse_one_process(base_config, assets, tmp_path):
    """Each of 2 processes saves its own position; the run resumes on 2 processes to the same
    curve, and is refused on 1 process even with the global batch kept (batch_size × 2)."""
    values = {
        **base_config,
        "train_data": two_files(assets, tmp_path),
        "streaming": True,
        "batch_size": 2,
        "max_steps": 4,
        "save_every": 2,
        "eval_every": 2,
    }
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(values))
    first = launch_two_processes(["-m", "uptrain", "train", "--config", str(path)], tmp_path / "home")
    assert first.returncode == 0, first.stderr[-3000:]
    out = Path(values["output_dir"])
    before = curve(out)
    checkpoint = out / "checkpoints" / "step_00000002"
    states = [load_data_state(checkpoint, rank) for rank in (0, 1)]
    assert [s["processes"] for s in states] == [2, 2]
    assert [s["shares"][0]["offset"] for s in states] == [4, 4]  # 2 steps × 2 blocks, each of its own file
    # As if killed after that checkpoint, before final/ was written.
    shutil.rmtree(out / "final")

    one = subprocess.run(
        [str(Path(sys.executable).parent / "uptrain"), "train", "--config", str(path), "--resume"]
        + ["--batch_size", "4"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode != 0 and "Traceback" not in one.stderr
    assert "split over 2 processes × 1 data_workers when the checkpoint was written, now 1 × 1" in one.stderr

    again = launch_two_processes(["-m", "uptrain", "train", "--config", str(path), "--resume"], tmp_path / "home")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and curve(out) == before
