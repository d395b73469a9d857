"""`uptrain train` never writes into, around or over its own inputs (issue #17), and `--resume`
finds the run however its folder is spelled."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import pytest

from tests.robustness.test_kill_anywhere import snapshot
from uptrain import UptrainError
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training

INPUTS = ("model", "source", "teacher", "train_data", "eval_data")
# Where output_dir is put relative to the input: the input itself, inside it, or around it.
RELATIONS = ("same", "inside", "around")


def place(tmp_path: Path, assets: dict, base_config: dict, key: str) -> tuple[dict, Path]:
    """A private copy of the input `key` (so a failure cannot damage the shared fixtures) in the config."""
    config = dict(base_config)
    if key in ("train_data", "eval_data"):
        path = tmp_path / "inputs" / f"{key}.txt"
        path.parent.mkdir(parents=True)
        shutil.copyfile(assets["train" if key == "train_data" else "eval"], path)
    else:
        path = tmp_path / "inputs" / key
        shutil.copytree(assets["mha" if key in ("source", "teacher") else "gqa"], path)
    config[key] = str(path)
    if key == "source":
        config.pop("model")
        config["num_kv_heads"] = 2
    return config, path


@pytest.mark.parametrize(("key", "relation", "overwrite"), itertools.product(INPUTS, RELATIONS, [False, True]))
def test_output_dir_never_overlaps_an_input(tmp_path, assets, base_config, key, relation, overwrite):
    config, path = place(tmp_path, assets, base_config, key)
    if relation == "same":
        out = path
    elif relation == "inside":
        if path.is_file():
            pytest.skip("nothing lies inside a file")
        out = path / "run"
    else:
        out = path.parent
    config.update(output_dir=str(out), overwrite=overwrite, max_steps=1)
    before = snapshot(path.parent)
    with pytest.raises(UptrainError, match="overlaps the") as err:
        run_training(TrainConfig(**config))
    assert "\n" not in str(err.value)
    assert snapshot(path.parent) == before  # nothing written, nothing deleted


@pytest.mark.parametrize("spelling", ["trailing slash", "absolute", "dot segments"])
def test_resume_finds_the_run_however_its_folder_is_spelled(tmp_path, base_config, spelling, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {**base_config, "output_dir": "run", "max_steps": 2, "save_every": 1, "eval_every": 2}
    run_training(TrainConfig(**config))
    shutil.rmtree(tmp_path / "run" / "final")  # as a kill after the last checkpoint leaves it
    other = {"trailing slash": "run/", "absolute": str(tmp_path / "run"), "dot segments": "./x/../run"}[spelling]
    (tmp_path / "x").mkdir()
    final = run_training(TrainConfig(**{**config, "output_dir": other, "resume": True}))
    assert os.path.samefile(final, tmp_path / "run" / "final")
