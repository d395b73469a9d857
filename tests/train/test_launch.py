"""A launch that cannot do what it says stops with one line before anything is written.

Real `accelerate launch` subprocesses on this GPU-less machine, plus the decision itself on the
GPU cases that cannot be launched here.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.train.train_helpers import python_env
from uptrain.train.distributed import Launch, launch_problem

REPO = Path(__file__).resolve().parents[2]
FSDP_YAML = REPO / "configs" / "accelerate" / "fsdp.yaml"
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without GPUs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_fsdp_config(base_config: dict, tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    """`accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 -m uptrain train`."""
    out = tmp_path / "runs" / "run"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**base_config, "output_dir": str(out)}))
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--config_file",
        str(FSDP_YAML),
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "uptrain",
        "train",
        "--config",
        str(path),
    ]
    full_env = {k: v for k, v in python_env().items() if k != "ACCELERATE_USE_CPU"}
    full_env.update(env)
    proc = subprocess.run(cmd, env=full_env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    return proc, out


def uptrain_errors(proc: subprocess.CompletedProcess) -> set[str]:
    """The distinct `uptrain train: error:` lines (every process of a refused launch prints its own)."""
    return {line for line in proc.stderr.splitlines() if line.startswith("uptrain train: error:")}


@needs_no_gpu
def test_fsdp_config_without_gpus_is_refused(base_config, tmp_path):
    # Without a GPU accelerate starts each process on its own: N runs racing on one output_dir.
    proc, out = launch_fsdp_config(base_config, tmp_path)
    assert proc.returncode != 0
    [error] = uptrain_errors(proc)
    assert "the launcher started 2 processes but they did not join one run" in error, proc.stderr[-3000:]
    assert "ACCELERATE_USE_CPU=1" in error
    assert not (tmp_path / "runs").exists()  # nothing written, not even the folder


@needs_no_gpu
def test_fsdp_config_on_cpu_processes_is_refused(base_config, tmp_path):
    # With ACCELERATE_USE_CPU=1 the processes join, but accelerate silently trains with DDP.
    proc, out = launch_fsdp_config(base_config, tmp_path, ACCELERATE_USE_CPU="1")
    assert proc.returncode != 0
    [error] = uptrain_errors(proc)
    assert "the accelerate config asks for FSDP, but accelerate set up MULTI_CPU with 2 process(es) on cpu" in error
    assert not (tmp_path / "runs").exists()


def launch(**fields) -> Launch:
    defaults = dict(launched=1, joined=1, asked=None, got="NO", device="cpu", gpus=0)
    return Launch(**{**defaults, **fields})


@pytest.mark.parametrize(
    "ok",
    [
        launch(),  # `uptrain train` on a CPU
        launch(device="cuda", gpus=1, gpus_in_use=1),  # on a GPU
        launch(launched=2, joined=2, got="MULTI_CPU"),  # ACCELERATE_USE_CPU=1 --multi_gpu
        launch(launched=8, joined=8, asked="FSDP", got="FSDP", device="cuda", gpus=8, gpus_in_use=8),
        launch(
            launched=16, joined=16, asked="DEEPSPEED", got="DEEPSPEED", device="cuda", gpus=8, gpus_in_use=16
        ),  # 2 nodes
        launch(launched=4, joined=4, got="MULTI_GPU", device="cuda", gpus=8, gpus_in_use=4),
        launch(launched=8, joined=8, got="MULTI_GPU", device="cuda", gpus=1, gpus_in_use=8),  # one shown to each
    ],
)
def test_launches_that_can_run_pass(ok):
    assert launch_problem(ok) is None


@pytest.mark.parametrize(
    "bad, expected",
    [
        (launch(launched=8, asked="FSDP"), "started 8 processes but they did not join one run"),
        (launch(launched=2, joined=2, asked="DEEPSPEED", got="MULTI_CPU"), "asks for DeepSpeed"),
        (launch(asked="FSDP", got="NO", device="cuda", gpus=1), "asks for FSDP, but accelerate set up NO"),
        (
            launch(launched=8, joined=8, asked="FSDP", got="FSDP", device="cuda", gpus=2, gpus_in_use=2),
            "the run's 8 processes landed on 2 GPU(s) (2 visible here)",
        ),
    ],
)
def test_launches_that_cannot_run_are_refused(bad, expected):
    problem = launch_problem(bad)
    assert problem is not None and expected in problem and "\n" not in problem
