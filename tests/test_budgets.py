"""Pretraining budgets: known families recognised by name and architecture together, else None;
the one budget rule of `uptrain train` and `uptrain compare`."""

from __future__ import annotations

import json
import math
import re

import pytest

from uptrain.budgets import known_pretrain_tokens
from uptrain.data.corpus import read_documents
from uptrain.demo import REFERENCE


@pytest.mark.parametrize(
    "model_type,name,tokens",
    [
        ("gpt_neox", "EleutherAI/pythia-160m", 300e9),
        ("gpt_neox", "EleutherAI/pythia-1.4b-deduped", 300e9),
        ("gpt_neox_gqa", "/data/pythia-410m", 300e9),  # converted by uptrain: still Pythia
        ("opt", "facebook/opt-125m", 180e9),
        ("gptj", "EleutherAI/gpt-j-6b", 402e9),
        ("bloom", "bigscience/bloom", 366e9),
        ("gpt_neo", "EleutherAI/gpt-neo-125m", 300e9),
        ("gpt_neo_gqa", "/data/gpt-neo-1.3B", 380e9),
        ("gpt_neo", "EleutherAI/gpt-neo-2.7B", 420e9),
        ("mpt", "mosaicml/mpt-7b", 1e12),
        ("mpt_gqa", "/data/mpt-7b-instruct", 1e12),  # a fine-tune of the base, converted
        ("llama", "meta-llama/Llama-2-7b-hf", 2e12),
        ("llama", "huggyllama/llama-65b", 1.4e12),
        ("llama", "huggyllama/llama-7b", 1.0e12),
    ],
)
def test_known_families(model_type, name, tokens):
    assert known_pretrain_tokens({"model_type": model_type}, name) == tokens


@pytest.mark.parametrize(
    "model_type,name",
    [
        ("gpt2", "openai-community/gpt2"),  # never published
        ("llama", "EleutherAI/pythia-160m"),  # name of one family, architecture of another
        ("gpt_neox", "EleutherAI/gpt-neox-20b"),
        ("bloom", "bigscience/bloom-560m"),  # smaller BLOOMs: budget not in the table
        ("opt", "facebook/opt-iml-1.3b"),
        ("gpt_neox", "EleutherAI/gpt-neo-125m"),  # GPT-Neo's name, NeoX's architecture
        ("gpt_neo", "EleutherAI/gpt-neo-350M"),  # a size the table does not list
        ("mpt", "mosaicml/mpt-7b-8k"),  # 1.5T: continued pretraining
        ("mpt", "mosaicml/mpt-30b"),
        ("llama", "my-model"),
    ],
)
def test_unknown_is_none(model_type, name):
    assert known_pretrain_tokens({"model_type": model_type}, name) is None


def test_name_from_config():
    config = {"model_type": "gpt_neox", "_name_or_path": "EleutherAI/pythia-70m"}
    assert known_pretrain_tokens(config, "out") == 300e9


# One budget rule (issue #16): `uptrain train` and `uptrain compare` declare the same budget keys,
# check them with the same rule, and find a missing `pretrain_tokens` with the same function.

BAD_BUDGETS = [
    ({}, "exactly one budget"),
    ({"max_steps": "3", "max_tokens": "100"}, "exactly one budget"),
    ({"uptrain_fraction": "0.05", "max_tokens": "100"}, "exactly one budget"),
    ({"max_tokens": "100", "pretrain_tokens": "1e6"}, "`pretrain_tokens` only applies with `uptrain_fraction`"),
    ({"uptrain_fraction": "2"}, "`uptrain_fraction`: must be at most 1"),
    ({"max_steps": "0"}, "`max_steps`: must be at least 1"),
]


def flags(budget: dict[str, str], dashed: bool) -> list[str]:
    return [
        word for key, value in budget.items() for word in ("--" + (key.replace("_", "-") if dashed else key), value)
    ]


@pytest.mark.parametrize("budget,expected", BAD_BUDGETS)
def test_train_and_compare_refuse_the_same_budgets_alike(capsys, tmp_path, budget, expected):
    from uptrain.cli import main

    model = str(REFERENCE)
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--model",
                model,
                "--train_data",
                "t.txt",
                "--eval_data",
                "e.txt",
                "--output_dir",
                str(tmp_path / "train"),
                "--seq_len",
                "32",
                "--batch_size",
                "2",
                "--lr",
                "1e-3",
                *flags(budget, dashed=False),
            ]
        )
        == 2
    )
    train_error = capsys.readouterr().err.strip()
    assert (
        main(
            [
                "compare",
                "--model",
                model,
                "--num-kv-heads",
                "2",
                "--output-dir",
                str(tmp_path / "compare"),
                "--report-to",
                "jsonl",
                *flags(budget, dashed=True),
            ]
        )
        == 2
    )
    compare_error = capsys.readouterr().err.strip()
    assert train_error.startswith("uptrain train: error: invalid config: ") and expected in train_error
    assert compare_error.startswith("uptrain compare: error: invalid option: ") and expected in compare_error
    assert train_error.split(": ", 3)[3] == compare_error.split(": ", 3)[3]  # the same words
    assert not (tmp_path / "train").exists() and not (tmp_path / "compare").exists()


class Stop(Exception):
    pass


def test_train_finds_the_reference_budget_as_compare_does(tmp_path, capsys):
    """`uptrain train --model uptrain/assets/reference --uptrain_fraction 0.05` trains (it used to be
    refused for want of `pretrain_tokens`), for the budget `uptrain compare` uses."""
    from uptrain.cli import build_parser
    from uptrain.compare.study import validate
    from uptrain.demo import demo_spec
    from uptrain.train.config import config_from_args
    from uptrain.train.loop import run_training

    text = tmp_path / "text.jsonl"  # a little of the shipped corpus: enough blocks for a step
    text.write_text(
        "".join(json.dumps({"text": d["text"]}) + "\n" for _, d in zip(range(20), read_documents("validation")))
    )
    argv = [
        "train",
        "--model",
        str(REFERENCE),
        "--uptrain_fraction",
        "0.05",
        "--train_data",
        str(text),
        "--eval_data",
        str(text),
        "--output_dir",
        str(tmp_path / "run"),
        "--seq_len",
        "32",
        "--batch_size",
        "2",
        "--lr",
        "6e-4",
        "--eval_blocks",
        "1",
        "--report_to",
        "jsonl",
    ]
    config = config_from_args(build_parser("train").parse_args(argv))
    assert config.pretrain_tokens is None

    def stop(step, record):
        raise Stop

    with pytest.raises(Stop):  # after the first optimizer step: the run was planned and started
        run_training(config, on_step=stop)
    card = json.loads((REFERENCE / "reference.json").read_text())["pretrain_tokens"]
    assert config.pretrain_tokens == card
    steps = int(re.search(r"steps\s+(\d+)", capsys.readouterr().out).group(1))
    assert steps == math.ceil(0.05 * card / (32 * 2))

    spec = demo_spec(tmp_path / "demo")  # the demo: `uptrain compare` on the same model, α = 0.05
    validate(spec)
    assert spec.pretrain_tokens == config.pretrain_tokens
