"""recipes/uptrain.py: convert on the fly, uptrain, report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "uptrain.py"


def load_recipe():
    spec = importlib.util.spec_from_file_location("uptrain_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_reports_alpha_zero_and_after(assets, tmp_path, capsys):
    recipe = load_recipe()
    code = recipe.main(
        [
            "--source",
            str(assets["mha"]),
            "--num_kv_heads",
            "2",
            "--train_data",
            str(assets["train"]),
            "--eval_data",
            str(assets["eval"]),
            "--output_dir",
            str(tmp_path / "run"),
            "--seq_len",
            "32",
            "--batch_size",
            "4",
            "--lr",
            "3e-3",
            "--max_steps",
            "4",
            "--eval_every",
            "4",
            "--report_to",
            "none",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "at α = 0 →" in out and "after 4 steps (512 tokens" in out
    # 8 → 2 KV heads: a quarter of the cache.
    assert "KV heads: 8 → 2 (256 bytes per token, 4× smaller" in out


def test_recipe_bad_input_is_one_line(tmp_path, capsys):
    code = load_recipe().main(
        [
            "--model",
            "m",
            "--train_data",
            "t",
            "--eval_data",
            "e",
            "--output_dir",
            str(tmp_path),
            "--seq_len",
            "8",
            "--batch_size",
            "1",
            "--lr",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "exactly one budget" in err
