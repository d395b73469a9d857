"""Two runs aiming at one output: exactly one writes it, the other is refused with one line and
leaves nothing behind (issue #12). Started together as separate processes, and, to reach every
interleaving deterministically, against a process that holds the output's lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.convert.tiny_models import build_model, save
from tests.robustness.test_kill_anywhere import leftovers, snapshot
from uptrain import UptrainError
from uptrain.checkpoint.atomic import output_lock
from uptrain.convert.pipeline import convert_checkpoint, execute, prepare
from uptrain.convert.spec import conversion_spec
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training
from uptrain.train.metrics import read_metrics
from uptrain.train.rundir import LOCK_FILE, hold_run_dir

UPTRAIN = str(Path(sys.executable).parent / "uptrain")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save(build_model("llama"), tmp_path_factory.mktemp("race") / "src")


@contextmanager
def held_by_another_process(take: Callable[[], object]) -> Iterator[int]:
    """A forked child enters the context manager `take()` and stays inside until the block ends;
    yields the child's pid. The child leaves it normally (or dies by SIGKILL if told to)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            with take():
                os.write(ready_w, b"1")
                os.read(go_r, 1)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    assert os.read(ready_r, 1) == b"1"
    try:
        yield pid
    finally:
        os.write(go_w, b"1")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)


def test_two_converts_started_together_one_wins(tmp_path, src):
    out = tmp_path / "out"
    runs = [
        subprocess.Popen(
            [UPTRAIN, "convert", str(src), str(out), "-g", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read().strip()) for p in runs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    err = next(e for code, e in results if code == 2)
    assert len(err.splitlines()) == 1 and ("already exists" in err or "being written by another uptrain run" in err)
    assert snapshot(out) == snapshot(convert_checkpoint(src, tmp_path / "alone", 2, progress=False))
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_convert_is_refused_while_another_writes_out(tmp_path, src, overwrite):
    """Another run holds OUT's lock (it is writing OUT): refused at the checks, before any work,
    or — when the other run starts after those — before the first write."""
    out = tmp_path / "out"
    if overwrite:
        convert_checkpoint(src, out, 4, progress=False)
    before = snapshot(out) if overwrite else None
    spec = conversion_spec(source=str(src), num_kv_heads=2)
    with held_by_another_process(lambda: output_lock(out)) as pid:
        with pytest.raises(UptrainError, match=f"being written by another uptrain run \\(pid {pid}\\)") as err:
            prepare(spec, out, overwrite)
        assert "\n" not in str(err.value)
    with prepare(spec, out, overwrite) as prepared:
        with held_by_another_process(lambda: output_lock(out)) as pid:
            with pytest.raises(UptrainError, match=f"pid {pid}"):
                execute(prepared, out, overwrite)
            assert leftovers(tmp_path) == [".out.uptrain-lock"]  # the other run's; nothing of ours
    assert leftovers(tmp_path) == []
    assert (snapshot(out) == before) if overwrite else not out.exists()


def train_config(base_config: dict, **changes) -> dict:
    return {**base_config, "max_steps": 3, "save_every": 2, "eval_every": 3, **changes}


def test_two_trainings_started_together_one_runs(base_config, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(train_config(base_config)))
    runs = [
        subprocess.Popen(
            [UPTRAIN, "train", "--config", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read().strip()) for p in runs]
    assert sorted(code for code, _ in results) == [0, 2], [(c, e[-500:]) for c, e in results]
    err = next(e for code, e in results if code == 2).splitlines()[-1]
    assert err.startswith("uptrain train: error: ") and (
        "being written by another uptrain run" in err or "already holds another uptrain run" in err
    ), err
    out = Path(base_config["output_dir"])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]  # one run's records, once
    assert not (out / LOCK_FILE).exists()


def test_training_refused_while_another_holds_the_folder(base_config):
    out = Path(base_config["output_dir"])
    run_training(TrainConfig(**train_config(base_config, max_steps=2)))
    before = snapshot(out)
    with held_by_another_process(lambda: hold_run_dir(out)) as pid:
        for resume in (False, True):
            with pytest.raises(UptrainError, match=f"being written by another uptrain run \\(pid {pid}\\)"):
                run_training(TrainConfig(**train_config(base_config, max_steps=4, resume=resume)))
    assert snapshot(out) == before


def test_a_killed_runs_lock_does_not_block_resume(base_config):
    out = Path(base_config["output_dir"])
    values = train_config(base_config, max_steps=4)

    def killed_after_step_3(step: int, record: dict) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, as when a node dies

    pid = os.fork()
    if pid == 0:
        try:
            run_training(TrainConfig(**values), on_step=killed_after_step_3)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert (out / LOCK_FILE).read_text().strip() == str(pid)  # left behind by the dead run …
    run_training(TrainConfig(**values, resume=True))  # … and no obstacle
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert not (out / LOCK_FILE).exists()
