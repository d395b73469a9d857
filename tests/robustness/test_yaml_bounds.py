"""Every YAML a command reads goes through the one bounded loader (`uptrain.options.read_yaml`,
`parse_yaml`): an alias bomb ("billion laughs": a few hundred bytes of nested aliases that write
out to 10^7 values) or an alias inside its own anchor is one line, at once, whichever command
reads it: a train config (`--config`), a flag's value, a run folder's run_config.yaml (train's
resume, compare's resume), an lm-eval task YAML (`evaluate --task lm-eval:FILE`) and a source's
model card. Issue #34, item 7."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from uptrain import UptrainError
from uptrain.cli import main
from uptrain.options import MAX_EXPANDED_YAML, parse_yaml, read_yaml


def bomb(levels: int = 7, width: int = 10) -> str:
    """One flow value, its anchors inline: each level `width` aliases of the one before, the
    last written out width**levels values."""
    anchors = [f"&a0 [{', '.join(['lol'] * width)}]"]
    anchors += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "[" + ", ".join(anchors) + "]"


BOMB = bomb()  # 10^7 values written out
SELF = "&a [x, *a]"  # an alias inside its own anchor


def refused_fast(call, *args) -> str:
    start = time.process_time()
    with pytest.raises(UptrainError) as err:
        call(*args)
    assert time.process_time() - start < 5  # coarse: the unbounded walk takes minutes
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_loader_bounds_what_aliases_expand_to():
    assert "aliases expand to more than a config can hold" in refused_fast(parse_yaml, f"train_data: {BOMB}", "f.yaml")
    assert "an alias refers to the value it is inside of" in refused_fast(parse_yaml, f"train_data: {SELF}", "f.yaml")
    # Aliases within the bound are YAML as ever: merge keys, shared values.
    assert parse_yaml("base: &b {x: 1}\nrun: {<<: *b, y: 2}\nlist: [*b, *b]\n", "f.yaml") == {
        "base": {"x": 1},
        "run": {"x": 1, "y": 2},
        "list": [{"x": 1}, {"x": 1}],
    }
    # The bound is what a file of the largest config size could hold written out.
    width = int(MAX_EXPANDED_YAML**0.5) // 4
    assert len(parse_yaml(f"x: {bomb(levels=2, width=width)}", "f.yaml")["x"][1]) == width


@pytest.mark.parametrize(
    "value, problem",
    [(BOMB, "aliases expand to more than a config can hold"), (SELF, "an alias refers to the value it is inside of")],
    ids=["bomb", "self"],
)
def test_a_train_config_whose_value_is_an_alias_bomb_is_one_line(tmp_path, capsys, value, problem):
    path = tmp_path / "config.yaml"
    path.write_text(f"lr: 0.001\ntrain_data: {value}\n")
    start = time.process_time()
    assert main(["train", "--config", str(path), "--output_dir", str(tmp_path / "run")]) == 2
    assert time.process_time() - start < 5
    err = capsys.readouterr().err
    assert err.startswith(f"uptrain train: error: {path}: ") and problem in err, err[:300]
    assert err.count("\n") == 1 and len(err) < 500, err[:300]
    assert not (tmp_path / "run").exists()


def test_a_flag_value_that_is_an_alias_bomb_is_one_line(tmp_path, capsys):
    value = BOMB
    start = time.process_time()
    assert main(["train", "--output_dir", str(tmp_path / "run"), "--max_grad_norm", value]) == 2
    assert time.process_time() - start < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`max_grad_norm`" in err and len(err) < 2 * len(value), err[:300]
    assert not (tmp_path / "run").exists()


def test_a_run_config_that_is_an_alias_bomb_is_one_line(tmp_path):
    # train --resume reads it through read_yaml (rundir); compare reads it to spell its model.
    from uptrain.compare.study import _as_recorded

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.yaml").write_text(f"model: {BOMB}\n")
    refused_fast(read_yaml, run / "run_config.yaml")
    start = time.process_time()
    assert _as_recorded(tmp_path / "model", run) == tmp_path / "model"  # the run itself then says why
    assert time.process_time() - start < 5


def test_an_lm_eval_task_yaml_that_is_an_alias_bomb_is_one_line(tmp_path):
    from uptrain.evaluation.harness import harness_task

    path = tmp_path / "task.yaml"
    path.write_text(f"task: bomb\nprocess_results: !function utils.process\nfewshot: {BOMB}\n")
    message = refused_fast(harness_task, f"lm-eval:{path}")
    assert message.startswith(f"cannot read the task YAML {path}") and "aliases expand" in message
    path.write_text("task: fine\nprocess_results: !function utils.process\nx: &x [1]\ny: *x\n")
    assert harness_task(f"lm-eval:{path}") == ("fine", tmp_path)
    # lm-eval indexes every task YAML in the folder: one beside the task is read first too.
    (tmp_path / "group").mkdir()
    (tmp_path / "group" / "other.yaml").write_text(f"task: other\nfewshot: {BOMB}\n")
    assert str(tmp_path / "group" / "other.yaml") in refused_fast(harness_task, f"lm-eval:{path}")


def test_a_model_card_whose_front_matter_is_an_alias_bomb_carries_nothing(tmp_path):
    from uptrain.checkpoint.card import card_metadata

    (tmp_path / "README.md").write_text(f"---\nlicense: {BOMB}\n---\n# A model\n")
    start = time.process_time()
    assert card_metadata(tmp_path) == {}
    assert time.process_time() - start < 5
    (tmp_path / "README.md").write_text("---\nlicense: &l mit\nlicense_name: *l\n---\n# A model\n")
    assert card_metadata(tmp_path) == {"license": "mit", "license_name": "mit"}


def test_every_yaml_reader_is_the_bounded_one():
    """No module parses YAML but options.py: a new reader is one more place a bomb would go off."""
    root = Path(__file__).resolve().parents[2] / "uptrain"
    readers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "options.py"
        and any(call in path.read_text() for call in ("yaml.load", "yaml.safe_load", "yaml.full_load", "metadata_load"))
    ]
    assert readers == []
