"""A compare small enough to run many times: the training tests' tiny MHA Llama, G = 2 with
calibrated pooling (so that calibration.safetensors is written), two optimizer steps per run."""

from __future__ import annotations

from pathlib import Path

from tests.train.train_helpers import reset_accelerate
from uptrain.cli import main


def compare_argv(assets: dict, out: Path | str, *extra: str) -> list[str]:
    return [
        "compare",
        "--model",
        str(assets["mha"]),
        "--num-kv-heads",
        "2",
        "--pooling",
        "calibrated",
        "--calibration-tokens",
        "64",
        "--train-data",
        str(assets["train"]),
        "--eval-data",
        str(assets["eval"]),
        "--output-dir",
        str(out),
        "--max-steps",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--eval-every",
        "2",
        "--eval-blocks",
        "2",
        "--warmup-steps",
        "1",
        "--report-to",
        "jsonl",
        # Speed off: timings differ between runs, and its files are tested in tests/compare/test_speed_rows.py.
        "--speed-repeats",
        "0",
        *extra,
    ]


def run_compare_cli(assets: dict, out: Path | str, *extra: str) -> int:
    reset_accelerate()
    return main(compare_argv(assets, out, *extra))


def results(out: Path) -> str:
    """What a compare reports (its table), which a compare killed and resumed must reproduce."""
    return (out / "results.csv").read_text()


def leftovers(out: Path) -> list[str]:
    """Temporaries, locks and other hidden entries under a compare folder (a finished one has none)."""
    return sorted(
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.name.startswith(".") or p.suffix == ".tmp" or ".uptrain-" in p.name
    )
