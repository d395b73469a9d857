"""A run folder torn by a kill, damaged by hand, or impossible to write: repaired where a kill
explains it, otherwise refused in one line before anything is written (issue #12)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.robustness.test_kill_anywhere import snapshot
from uptrain import UptrainError
from uptrain.cli import main
from uptrain.train.checkpoint import STATE_FILE, latest_checkpoint
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training
from uptrain.train.metrics import read_metrics


def values(base_config: dict, **changes) -> dict:
    return {**base_config, "max_steps": 4, "save_every": 2, "eval_every": 2, **changes}


def refused(config: dict, message: str) -> str:
    with pytest.raises(UptrainError, match=message) as err:
        run_training(TrainConfig(**config))
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.fixture
def interrupted(base_config) -> Path:
    """A run that stopped after its checkpoint at step 2, as a kill after step 3 leaves it."""
    out = Path(base_config["output_dir"])
    run_training(TrainConfig(**values(base_config)))
    shutil.rmtree(out / "final")
    assert latest_checkpoint(out)[0] == 2
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:4]))  # steps 0–3: logged past the checkpoint
    return out


def test_a_torn_last_metrics_line_is_repaired_on_resume(base_config, interrupted):
    with (interrupted / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train/loss": 3.2, "train/l')  # the kill cut this write short
    assert [r["step"] for r in read_metrics(interrupted / "metrics.jsonl")] == [0, 1, 2, 3]
    run_training(TrainConfig(**values(base_config, resume=True)))
    text = (interrupted / "metrics.jsonl").read_text()
    assert [json.loads(line)["step"] for line in text.splitlines()] == [0, 1, 2, 3, 4]


def test_damage_not_made_by_a_kill_is_refused(base_config, interrupted):
    metrics = interrupted / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good.replace("\n", "\n{oops\n", 1))
    refused(values(base_config, resume=True), r"metrics.jsonl, line 2: not a JSON record")
    metrics.write_text(good)


@pytest.mark.parametrize(
    "name,damage,message",
    [
        ("run_config.yaml", "model: [unclosed", "run_config.yaml is damaged"),
        ("run_config.yaml", "- a list\n- of things\n", "run_config.yaml is damaged"),
        # Past PyYAML's parser, in its constructor (a ValueError, once a traceback).
        ("run_config.yaml", "model: 2024-13-45\n", "run_config.yaml is damaged .*month must be in 1..12"),
        ("run.json", '{"global_batch": ', "run.json is not valid JSON"),
        ("run.json", "[4]", "run.json is damaged"),
        ("checkpoints/step_00000002/" + STATE_FILE, '{"step": ', "trainer_state.json is not valid JSON"),
        ("checkpoints/step_00000002/" + STATE_FILE, '{"step": 7}', "does not hold the step of step_00000002"),
        ("checkpoints/step_00000002/" + STATE_FILE, "[]", "does not hold the step"),
    ],
)
def test_a_damaged_run_file_is_one_line_and_nothing_changes(base_config, interrupted, name, damage, message):
    (interrupted / name).write_text(damage)
    before = snapshot(interrupted)
    refused(values(base_config, resume=True), message)
    assert snapshot(interrupted) == before


def test_a_damaged_run_config_is_one_line_and_exit_2_from_the_command(base_config, interrupted, tmp_path, capsys):
    (interrupted / "run_config.yaml").write_text("model: 2024-13-45\n")
    before = snapshot(interrupted)
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(values(base_config, resume=True)))
    capsys.readouterr()
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("uptrain train: error: cannot resume: run_config.yaml"), err
    assert "is damaged" in err and "is not valid YAML: month must be in 1..12" in err, err
    assert snapshot(interrupted) == before


def test_another_global_batch_is_refused_in_the_shared_wording(base_config, interrupted):
    """batch_size and grad_accum may change only together, their product kept: run.json records it."""
    before = snapshot(interrupted)
    message = refused(values(base_config, resume=True, batch_size=8), "its settings changed")
    assert "(batch_size × grad_accum × processes: 4 → 8); rerun with the earlier value" in message
    assert "--overwrite" in message and snapshot(interrupted) == before


def test_a_damaged_checkpoint_is_one_line(base_config, interrupted):
    (latest_checkpoint(interrupted)[1] / "model.safetensors").write_bytes(b"\x00" * 16)
    message = refused(values(base_config, resume=True), "cannot resume from .*step_00000002")
    assert "delete that folder" in message


def test_output_dir_that_cannot_be_written(base_config, tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    refused(values(base_config, output_dir=str(tmp_path / "a-file")), "is a file")
    refused(values(base_config, output_dir=str(tmp_path / "a-file" / "run")), "cannot create output_dir")
    # /proc refuses new entries even to root, where a read-only chmod would not.
    refused(values(base_config, output_dir="/proc/uptrain-run"), "cannot create output_dir /proc/uptrain-run")
    assert (tmp_path / "a-file").read_text() == "mine"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values(base_config)))
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "a-file" / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("uptrain train: error: cannot create output_dir"), err


def test_a_refused_conversion_writes_nothing_and_the_corrected_command_runs(base_config, assets):
    config = {k: v for k, v in values(base_config).items() if k != "model"}
    out = Path(config["output_dir"])
    refused({**config, "source": str(assets["mha"]), "num_kv_heads": 3}, "does not divide")
    assert not out.exists()
    run_training(TrainConfig(**{**config, "source": str(assets["mha"]), "num_kv_heads": 2}))
    assert (out / "final" / "config.json").is_file() and (out / "converted" / "config.json").is_file()


def test_text_that_is_only_whitespace_is_refused(base_config, tmp_path):
    import gzip

    (tmp_path / "blank.txt").write_text("   \n\t \n\n  \r\n" * 100)
    with gzip.open(tmp_path / "blank.jsonl.gz", "wt") as f:
        f.write("\n \n")
    for name in ("blank.txt", "blank.jsonl.gz"):
        refused(values(base_config, train_data=str(tmp_path / name)), f"`train_data`: .*{name} holds only whitespace")
        refused(values(base_config, eval_data=str(tmp_path / name)), f"`eval_data`: .*{name} holds only whitespace")
    assert not Path(base_config["output_dir"]).exists()
