"""kill -9 at every file-system step of `uptrain convert` and of training's checkpoints and
final/: the previous good state survives, and the next run completes and leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.convert.tiny_models import build_model, save
from tests.robustness.faults import EVERY_STEP, NEVER, RENAMES, run_and_kill_at
from tests.train.train_helpers import reset_accelerate
from uptrain import UptrainError
from uptrain.checkpoint.atomic import _exchange
from uptrain.cli import main
from uptrain.convert.pipeline import convert_checkpoint

VARYING = {"uptrain.json", "README.md"}  # hold the creation time


def snapshot(folder: Path) -> dict[str, bytes]:
    """The files of a checkpoint folder, but for those that record when they were made."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in VARYING
    }


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".uptrain-" in p.name)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save(build_model("llama"), tmp_path_factory.mktemp("kill") / "src", max_shard_size="40KB")


def exchange_supported(folder: Path) -> bool:
    """Whether renameat2(RENAME_EXCHANGE) swaps two folders here (ext4, xfs, btrfs, tmpfs do)."""
    a, b = folder / ".probe-a", folder / ".probe-b"
    a.mkdir()
    b.mkdir()
    try:
        return _exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


@pytest.mark.parametrize("had_output", [True, False])
def test_convert_killed_at_every_step(tmp_path, src, had_output):
    root = tmp_path / "work"
    root.mkdir()
    out = root / "out"
    previous = snapshot(convert_checkpoint(src, tmp_path / "previous", 4, progress=False))
    expected = snapshot(convert_checkpoint(src, tmp_path / "expected", 2, progress=False, max_shard_size="20KB"))
    argv = ["convert", str(src), str(out), "-g", "2", "--max-shard-size", "20KB", "--overwrite"]

    def start_state() -> None:
        if had_output:
            convert_checkpoint(src, out, 4, progress=False, overwrite=True)

    start_state()
    code, steps = run_and_kill_at(NEVER, root, lambda: main(argv))
    assert code == 0 and steps > 10, (code, steps)
    assert snapshot(out) == expected
    for n in range(1, steps + 1):
        start_state()
        code, _ = run_and_kill_at(n, root, lambda: main(argv))
        assert code == -9, f"step {n} of {steps}: the child was not killed ({code})"
        if had_output and exchange_supported(root):
            # --overwrite exchanges the new OUT with the old one in one step: never a moment without OUT.
            assert (out / "config.json").is_file(), f"killed at step {n} of {steps}: no OUT"
        # Whatever the kill left, the next run puts it right before it looks at OUT: here one
        # without --overwrite, which must find the previous OUT (or the finished new one) and refuse.
        if had_output or out.exists():
            with pytest.raises(UptrainError, match="already exists"):
                convert_checkpoint(src, out, 2, progress=False)
            assert snapshot(out) in ((previous, expected) if had_output else (expected,)), f"step {n} of {steps}"
        convert_checkpoint(src, out, 2, progress=False, overwrite=True, max_shard_size="20KB")
        assert snapshot(out) == expected
        assert leftovers(root) == [], f"killed at step {n} of {steps}: {leftovers(root)}"


def train_values(base_config: dict, **changes) -> dict:
    return {**base_config, "max_steps": 4, "save_every": 1, "keep_checkpoints": 1, "eval_every": 2, **changes}


def run_dir_leftovers(out: Path) -> list[str]:
    """Hidden entries and temporaries of a run folder (a finished run has none)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp")


def kill_training_everywhere(base_config: dict, tmp_path: Path, events: frozenset[str]) -> None:
    """Kill a run at each of its steps in turn; --resume must end with the weights of a run
    never killed, the metrics of every step once, and no leftovers."""
    import shutil

    from uptrain.train.checkpoint import latest_checkpoint, read_trainer_state
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training
    from uptrain.train.metrics import read_metrics

    reference = tmp_path / "reference"
    run_training(TrainConfig(**train_values(base_config, output_dir=str(reference))))
    expected = load_file(reference / "final" / "model.safetensors")
    expected_steps = [r["step"] for r in read_metrics(reference / "metrics.jsonl")]
    out = tmp_path / "killed"

    def train(resume: bool = False):
        reset_accelerate()
        return run_training(TrainConfig(**train_values(base_config, output_dir=str(out), resume=resume)))

    code, steps = run_and_kill_at(NEVER, out, train, events)
    assert code == 0 and steps > 5, (code, steps)
    for n in range(1, steps + 1):
        shutil.rmtree(out)
        code, _ = run_and_kill_at(n, out, train, events)
        assert code == -9, f"step {n} of {steps}: the child was not killed ({code})"
        if (latest := latest_checkpoint(out)) is not None:
            read_trainer_state(latest[1])  # what a kill left is whole
        train(resume=True)
        got = load_file(out / "final" / "model.safetensors")
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), (
            f"killed at step {n} of {steps}"
        )
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == expected_steps, f"step {n} of {steps}"
        assert run_dir_leftovers(out) == [], f"killed at step {n} of {steps}"


def test_training_killed_at_every_rename_resumes_to_the_same_model(base_config, tmp_path):
    """Every rename of a run: run_config.yaml, run.json, metrics repair, each checkpoint saved
    or dropped, final/."""
    kill_training_everywhere(base_config, tmp_path, RENAMES)


@pytest.mark.slow
def test_training_killed_at_every_step_resumes_to_the_same_model(base_config, tmp_path):
    """Every write, mkdir and delete too (about 50 kills, a minute or two)."""
    kill_training_everywhere(base_config, tmp_path, EVERY_STEP)


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, src):
    """A write that fails (here: a file-size limit, as a full disk would) ends the conversion
    with one line, exit 2, the previous OUT intact and no temporary left."""
    import os
    import resource
    import signal
    import sys

    out = tmp_path / "out"
    previous = snapshot(convert_checkpoint(src, out, 4, progress=False))
    err_file = tmp_path / "stderr.txt"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sys.stderr = open(err_file, "w", buffering=1)  # pytest's capture is not fd 2
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
            code = main(["convert", str(src), str(out), "-g", "2", "--overwrite"])
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    err = err_file.read_text().strip()
    assert os.WEXITSTATUS(status) == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("uptrain convert: error: File too large"), err
    assert snapshot(out) == previous
    assert leftovers(tmp_path) == []
