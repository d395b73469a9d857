"""The one conversion pipeline: every check runs before calibration and before any write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.convert.tiny_models import build_model
from uptrain.cli import main
from uptrain.convert import calibration as calibration_module
from uptrain.convert.pipeline import prepare
from uptrain.convert.spec import conversion_spec
from uptrain.data.corpus import load_tokenizer, read_documents


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    tokenizer = load_tokenizer()
    for model_type in ("llama", "qwen3"):
        build_model(model_type).save_pretrained(root / model_type)
        tokenizer.save_pretrained(root / model_type)
    # What a 2-KV-head conversion of the Llama must hold: transformers' own checkpoint of that geometry.
    build_model("llama", num_kv_heads=2).save_pretrained(root / "llama-g2")
    docs = [d["text"][:2000] for _, d in zip(range(4), read_documents("validation"))]
    (root / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return root


class CalibrationRan(Exception):
    pass


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def calibration_must_not_run(monkeypatch):
    """A spy on the one function that runs calibration; `test_calibration_runs_after_the_checks_pass`
    shows it is on the path, so a refusal that does not trip it really came first."""

    def refuse(*args, **kwargs):
        raise CalibrationRan("calibration ran before a check that should have refused the conversion")

    monkeypatch.setattr(calibration_module, "collect_attention_moments", refuse)


@pytest.mark.parametrize(
    "source, extra, expected",
    [
        ("llama", ["-g", "3"], "--num-kv-heads 3 does not divide"),
        ("qwen3", ["-g", "2"], "cannot carry"),  # q/k norms: refused by the plan, not after calibration
        ("llama", ["-g", "2", "--max-shard-size", "0"], "less than one byte"),
        ("llama", ["-g", "2", "--calibration-tokens", "0"], "calibration_tokens"),
        ("llama", ["-g", "2", "--calibration-device", "tpu"], "calibration_device"),
    ],
)
def test_every_check_runs_before_calibration(
    checkpoints, calibration_must_not_run, tmp_path, capsys, source, extra, expected
):
    out, before = tmp_path / "out", folder_bytes(checkpoints / source)
    code = main(
        [
            "convert",
            str(checkpoints / source),
            str(out),
            "--pooling",
            "calibrated",
            "--calibration-data",
            str(checkpoints / "text.jsonl"),
            *extra,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == [] and folder_bytes(checkpoints / source) == before


def test_calibration_runs_after_the_checks_pass(checkpoints, calibration_must_not_run, tmp_path):
    with pytest.raises(CalibrationRan):
        main(
            [
                "convert",
                str(checkpoints / "llama"),
                str(tmp_path / "out"),
                "-g",
                "2",
                "--pooling",
                "calibrated",
                "--calibration-data",
                str(checkpoints / "text.jsonl"),
            ]
        )


def test_prepare_plans_the_whole_output_and_writes_nothing(checkpoints, tmp_path):
    source = folder_bytes(checkpoints / "llama")
    spec = conversion_spec(
        source=str(checkpoints / "llama"),
        num_kv_heads=2,
        pooling="calibrated",
        calibration_data=str(checkpoints / "text.jsonl"),
    )
    with prepare(spec, tmp_path / "out") as prepared:
        assert prepared.needs_calibration and prepared.geometry.num_kv_heads == 8
        planned = {t.out.name: (t.out.dtype, t.out.shape) for t in prepared.plan.tensors}
        total_bytes = prepared.plan.total_bytes
    with safe_open(checkpoints / "llama-g2" / "model.safetensors", "pt") as f:
        expected = {name: f.get_tensor(name) for name in f.keys()}
    assert planned == {name: (t.dtype, tuple(t.shape)) for name, t in expected.items()}
    assert total_bytes == sum(t.nbytes for t in expected.values())
    assert list(tmp_path.iterdir()) == []
    assert folder_bytes(checkpoints / "llama") == source
