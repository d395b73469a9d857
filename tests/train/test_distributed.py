"""Two CPU processes under `accelerate launch` (gloo DDP) against one process with the same global batch."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.train.train_helpers import CURVE, KILLER, curve, python_env, records, wandb_records
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(args: list[str], home: Path) -> subprocess.CompletedProcess:
    """The 2-CPU-process launch of docs/commands/train.md, as a user would type it, by a user who never set up wandb:
    no WANDB_MODE, no key, no ~/.netrc, and no terminal to answer a prompt."""
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        *args,
    ]
    env = {k: v for k, v in python_env().items() if k not in ("WANDB_MODE", "WANDB_API_KEY", "NETRC")}
    env.update(ACCELERATE_USE_CPU="1", HOME=str(home))
    return subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def two_process_run(assets, tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    """`accelerate launch -m uptrain train` on 2 processes × 2 blocks: 4 steps, a checkpoint at step 2."""
    root = tmp_path_factory.mktemp("ddp")
    values = {
        "model": str(assets["gqa"]),
        "train_data": str(assets["train"]),
        "eval_data": str(assets["eval"]),
        "output_dir": str(root / "ddp"),
        "seq_len": 32,
        "batch_size": 2,
        "lr": 3e-3,
        "warmup_steps": 2,
        "max_steps": 4,
        "eval_every": 2,
        "save_every": 2,
        "keep_checkpoints": 1,
        "eval_blocks": 8,
        "report_to": ["wandb", "jsonl"],
    }
    path = root / "ddp.yaml"
    path.write_text(yaml.safe_dump(values))
    (root / "home").mkdir()
    return values, launch_two_processes(["-m", "uptrain", "train", "--config", str(path)], root / "home")


def test_two_processes_match_one_with_the_same_global_batch(two_process_run, tmp_path):
    values, two = two_process_run
    assert two.returncode == 0, two.stderr[-3000:]

    single = TrainConfig(**{**values, "batch_size": 4, "report_to": ["jsonl"], "output_dir": str(tmp_path / "one")})
    run_training(single)
    a, b = curve(single.output_dir), curve(values["output_dir"])
    assert a.keys() == b.keys() == {0, 1, 2, 3, 4}
    for step in a:
        assert a[step].keys() == b[step].keys()
        for k in CURVE:
            if k in a[step]:
                # Same blocks and token-normalised loss; only the order of float additions differs
                # (per-process sums, then the all-reduce).
                assert b[step][k] == pytest.approx(a[step][k], rel=1e-5), (step, k)

    out = Path(values["output_dir"])
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]  # only the main process logs
    assert two.stdout.count("plan:") == 1
    assert "processes 2" in two.stdout
    assert "wandb: no credentials configured, logging offline" in two.stdout
    # One checkpoint (the last kept), written once, with each process's RNG state.
    [checkpoint] = list((out / "checkpoints").iterdir())
    assert checkpoint.name == "step_00000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "trainer_state.json",
    ]
    history, summary = wandb_records(out)  # asserts a single wandb run
    assert [h["step"]["num"] for h in history] == [0, 1, 2, 3, 4]
    assert summary["summary"]["eval/loss"] == pytest.approx(records(out)[-1]["eval/loss"], rel=1e-12)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final").config.num_key_value_heads == 2


@pytest.mark.slow
def test_two_processes_killed_and_resumed_give_the_same_curve(two_process_run, tmp_path):
    values, two = two_process_run
    assert two.returncode == 0, two.stderr[-3000:]
    killed_values = {**values, "output_dir": str(tmp_path / "killed"), "report_to": ["jsonl"]}
    path, script = tmp_path / "killed.yaml", tmp_path / "killer.py"
    path.write_text(yaml.safe_dump(killed_values))
    script.write_text(KILLER)
    (tmp_path / "home").mkdir()
    killed = launch_two_processes([str(script), str(path), "3"], tmp_path / "home")
    assert killed.returncode != 0  # the launcher reports the dead process and stops the other
    out = Path(killed_values["output_dir"])
    assert max(r["step"] for r in records(out)) == 3 and (out / "checkpoints" / "step_00000002").is_dir()

    resumed = launch_two_processes(["-m", "uptrain", "train", "--config", str(path), "--resume"], tmp_path / "home")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert curve(out) == curve(values["output_dir"])  # exactly: same processes, same reduction order
