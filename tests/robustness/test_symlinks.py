"""Symbolic links planted where uptrain writes its lock files: never written through (issue #17).

A lock file is opened, truncated and written with the holder's pid. Opened through a link, that
would overwrite what the link points to (even the source's config.json) or, for a dangling link,
create a file wherever it points. Every lock is opened with O_NOFOLLOW and refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.convert.tiny_models import build_model, save
from tests.robustness.test_kill_anywhere import snapshot
from uptrain import UptrainError
from uptrain.checkpoint.atomic import remove_stale_locks
from uptrain.cli import main
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save(build_model("llama"), tmp_path_factory.mktemp("links") / "src")


def plant(link: Path, target: Path) -> None:
    os.symlink(target, link)


@pytest.mark.parametrize("dangling", [False, True])
def test_convert_never_writes_through_a_linked_lock(tmp_path, src, capsys, dangling):
    target = tmp_path / "elsewhere.txt" if dangling else src / "config.json"
    before = snapshot(src)
    out = tmp_path / "out"
    plant(tmp_path / ".out.uptrain-lock", target)
    assert main(["convert", str(src), str(out), "-g", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "symbolic link" in err, err
    assert snapshot(src) == before  # the source's config.json untouched
    if dangling:
        assert not target.exists()
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.uptrain-lock"]


def test_train_never_writes_through_a_linked_run_lock(tmp_path, base_config):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    out = Path(base_config["output_dir"])
    out.mkdir(parents=True)
    plant(out / ".uptrain-lock", victim)
    with pytest.raises(UptrainError, match="symbolic link") as err:
        run_training(TrainConfig(**{**base_config, "max_steps": 1}))
    assert "\n" not in str(err.value)
    assert victim.read_text() == "keep me\n"
    assert sorted(p.name for p in out.iterdir()) == [".uptrain-lock"]


def test_the_stale_lock_sweep_leaves_links_alone(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    folder = tmp_path / "runs"
    folder.mkdir()
    plant(folder / ".a.uptrain-lock", victim)
    plant(folder / ".b.uptrain-lock", tmp_path / "nowhere")
    remove_stale_locks(folder)
    assert victim.read_text() == "keep me\n"
    assert not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in folder.iterdir()) == [".a.uptrain-lock", ".b.uptrain-lock"]
