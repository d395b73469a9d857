"""Values no parser should turn into a traceback (issue #17): integers past Python's 4300-digit
limit in JSON, and data whose text column holds something other than text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.convert.tiny_models import build_model, save
from tests.robustness.test_kill_anywhere import snapshot
from uptrain.cli import main

HUGE = "9" * 5000
REFERENCE = Path(__file__).resolve().parents[2] / "uptrain" / "assets" / "reference"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save(build_model("llama"), tmp_path_factory.mktemp("values") / "src")


def one_line(capsys) -> str:
    """The error line (progress bars may come before it on stderr; no traceback anywhere)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("uptrain ") and ": error: " in last, err
    return last


@pytest.mark.parametrize("where", ["config.json", "model.safetensors.index.json"])
def test_an_integer_too_long_for_python_is_one_line(tmp_path, src, capsys, where):
    bad = tmp_path / "src"
    bad.mkdir()
    for path in src.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    if where == "config.json":
        text = (bad / where).read_text().replace('"num_hidden_layers": 2', f'"num_hidden_layers": {HUGE}')
        assert HUGE in text
        (bad / where).write_text(text)
    else:
        weights = bad / "model.safetensors"
        (bad / "model-00001-of-00001.safetensors").write_bytes(weights.read_bytes())
        weights.unlink()
        (bad / where).write_text(f'{{"metadata": {{"total_size": {HUGE}}}, "weight_map": {{}}}}')
    before = snapshot(bad)
    assert main(["convert", str(bad), str(tmp_path / "out"), "-g", "2"]) == 2
    assert "digits" in one_line(capsys)
    assert snapshot(bad) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [5, ["pre", "split"], {"nested": "text"}])
def test_a_text_column_holding_no_text_is_one_line(tmp_path, base_config, capsys, value):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "a fine document"}) + "\n" + json.dumps({"text": value}) + "\n")
    out = Path(base_config["output_dir"])
    argv = (
        ["train"]
        + [f"--{k}={v if not isinstance(v, list) else v[0]}" for k, v in base_config.items() if k != "train_data"]
        + [f"--train_data={data}"]
    )
    assert main(argv) == 2
    message = one_line(capsys)
    assert "not text" in message and str(data) in message
    assert not out.exists() or not any(out.iterdir())


def test_calibration_text_holding_no_text_is_one_line(tmp_path, capsys):
    data = tmp_path / "calibration.jsonl"
    data.write_text(json.dumps({"text": 12345}) + "\n")
    argv = [
        "convert",
        str(REFERENCE),
        str(tmp_path / "out"),
        "-g",
        "2",
        "--pooling",
        "calibrated",
        "--calibration-data",
        str(data),
        "--calibration-tokens",
        "64",
    ]
    assert main(argv) == 2
    assert "not text" in one_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "card",
    ["not json", '{"pretrain_tokens": -5}', '{"pretrain_tokens": "3e6"}', "[1, 2]", '{"pretrain_tokens": 1e999}'],
)
def test_a_bad_reference_card_is_one_line(tmp_path, capsys, card):
    model = tmp_path / "model"
    shutil.copytree(REFERENCE, model)
    (model / "reference.json").write_text(card)
    out = tmp_path / "run"
    argv = [
        "train",
        f"--model={model}",
        f"--train_data={REFERENCE.parent / 'corpus' / 'validation.jsonl.gz'}",
        f"--eval_data={REFERENCE.parent / 'corpus' / 'validation.jsonl.gz'}",
        f"--output_dir={out}",
        "--seq_len=32",
        "--batch_size=2",
        "--lr=1e-3",
        "--uptrain_fraction=0.05",
        "--report_to=jsonl",
    ]
    assert main(argv) == 2
    assert "reference.json" in one_line(capsys)
    assert not out.exists() or not any(out.iterdir())
