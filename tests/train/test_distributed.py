"""Two CPU processes under `accelerate launch` (gloo DDP) against one process with the same global
batch, and the same two processes as two machines (one `accelerate launch` per machine rank)
against the two on one machine."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from tests.train.train_helpers import CURVE, KILLER, curve, python_env, records, wandb_records
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(machines: int = 1, machine_rank: int = 0, port: int | None = None) -> list[str]:
    """`accelerate launch` of 2 CPU processes in all (docs/commands/train.md) on `machines` machines: with
    several, this is machine `machine_rank`'s command, which meets the others at 127.0.0.1:`port`."""
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",  # in all, over every machine
        "--num_machines",
        str(machines),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port or free_port()),
    ]
    if machines > 1:
        cmd += ["--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1"]
    return cmd


def user_env(home: Path) -> dict[str, str]:
    """A user who never set up wandb: no WANDB_MODE, no key, no ~/.netrc."""
    env = {k: v for k, v in python_env().items() if k not in ("WANDB_MODE", "WANDB_API_KEY", "NETRC")}
    env.update(ACCELERATE_USE_CPU="1", HOME=str(home))
    return env


def launch_two_processes(args: list[str], home: Path) -> subprocess.CompletedProcess:
    """The 2-CPU-process launch of docs/commands/train.md, as a user would type it, by a user who never set up wandb
    and with no terminal to answer a prompt."""
    return subprocess.run(
        launch_command() + args,
        env=user_env(home),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )


def launch_two_machines(
    args: list[str], home: Path, cwd: list[Path] | None = None
) -> list[subprocess.CompletedProcess]:
    """The two processes as two machines on this one: one `accelerate launch` per machine rank,
    one process each, started together and meeting at 127.0.0.1 over gloo; `cwd`: each machine's
    working folder. Returns each machine's launch."""
    port = free_port()
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(2)]  # no pipe to fill
    machines = [
        subprocess.Popen(
            launch_command(2, rank, port) + args,
            env=user_env(home),
            cwd=cwd[rank] if cwd else None,
            stdin=subprocess.DEVNULL,
            stdout=logs[rank][0],
            stderr=logs[rank][1],
            text=True,
        )
        for rank in range(2)
    ]
    try:
        codes = [machine.wait(timeout=300) for machine in machines]
    finally:
        for machine in machines:
            machine.kill()
    done = []
    for machine, code, (out, err) in zip(machines, codes, logs, strict=True):
        out.seek(0), err.seek(0)
        done.append(subprocess.CompletedProcess(machine.args, code, out.read(), err.read()))
    return done


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


def test_two_machines_resume_and_end_as_two_processes_on_one(two_process_run, tmp_path):
    """Outgrowing one machine: the same 2 processes as 2 machines of one process each
    (`--num_machines 2`, `--machine_rank 0` and `1`, `--main_process_ip`), one filesystem. Killed
    after step 3 and resumed from the checkpoint of step 2, they end as the 2 processes on one
    machine did: the same curve and the same final weights, bit for bit (the same world and order
    of reduction). Files have one writer, the whole run's main process (each machine has a local
    main process of its own): one checkpoint with one model file and each process's RNG state, one
    metrics record per step."""
    from safetensors.torch import load_file

    values, one_machine = two_process_run
    assert one_machine.returncode == 0, one_machine.stderr[-3000:]
    killed_values = {**values, "output_dir": str(tmp_path / "run"), "report_to": ["jsonl"]}
    path, script = tmp_path / "run.yaml", tmp_path / "killer.py"
    path.write_text(yaml.safe_dump(killed_values))
    script.write_text(KILLER)
    (tmp_path / "home").mkdir()
    killed = launch_two_machines([str(script), str(path), "3"], tmp_path / "home")
    assert all(machine.returncode != 0 for machine in killed)  # each machine's launcher reports its dead process
    out = Path(killed_values["output_dir"])
    assert max(r["step"] for r in records(out)) == 3
    [checkpoint] = list((out / "checkpoints").iterdir())
    assert checkpoint.name == "step_00000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "trainer_state.json",
    ]

    resumed = launch_two_machines(["-m", "uptrain", "train", "--config", str(path), "--resume"], tmp_path / "home")
    for machine in resumed:
        assert machine.returncode == 0, machine.stderr[-3000:]
    assert "resuming from" in resumed[0].stdout and "processes 2" in resumed[0].stdout
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]  # one record per step: one writer
    assert curve(out) == curve(values["output_dir"])  # exactly
    final, expected = (
        load_file(out / "final" / "model.safetensors"),
        load_file(Path(values["output_dir"]) / "final" / "model.safetensors"),
    )
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], expected[name]) for name in final)


def test_two_machines_refuse_an_output_dir_they_do_not_share(assets, tmp_path):
    """Each machine in a folder of its own, with a relative output_dir: two folders, as on
    machines without a shared filesystem. Refused in one line on both before the first step: the
    second machine's parts of each checkpoint would be where no resume finds them."""
    values = {
        "model": str(assets["gqa"]),
        "train_data": str(assets["train"]),
        "eval_data": str(assets["eval"]),
        "output_dir": "run",
        "seq_len": 32,
        "batch_size": 2,
        "lr": 3e-3,
        "max_steps": 4,
        "report_to": ["jsonl"],
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    machines = [tmp_path / "machine0", tmp_path / "machine1", tmp_path / "home"]
    for folder in machines:
        folder.mkdir()
    launched = launch_two_machines(["-m", "uptrain", "train", "--config", str(path)], machines[2], machines[:2])
    for machine in launched:
        assert machine.returncode != 0
        assert "is not the same folder for every process (process 1 does not see" in machine.stderr, machine.stderr[
            -3000:
        ]
    assert not (machines[0] / "run" / "metrics.jsonl").exists() or records(machines[0] / "run") == []
