"""Known pretraining budgets: recognised by name and architecture together, else None."""

from __future__ import annotations

import pytest

from uptrain.budgets import known_pretrain_tokens


@pytest.mark.parametrize("model_type,name,tokens", [
    ("gpt_neox", "EleutherAI/pythia-160m", 300e9),
    ("gpt_neox", "EleutherAI/pythia-1.4b-deduped", 300e9),
    ("gpt_neox_gqa", "/data/pythia-410m", 300e9),  # converted by uptrain: still Pythia
    ("opt", "facebook/opt-125m", 180e9),
    ("gptj", "EleutherAI/gpt-j-6b", 402e9),
    ("bloom", "bigscience/bloom", 366e9),
    ("llama", "meta-llama/Llama-2-7b-hf", 2e12),
    ("llama", "huggyllama/llama-65b", 1.4e12),
    ("llama", "huggyllama/llama-7b", 1.0e12),
])
def test_known_families(model_type, name, tokens):
    assert known_pretrain_tokens({"model_type": model_type}, name) == tokens


@pytest.mark.parametrize("model_type,name", [
    ("gpt2", "openai-community/gpt2"),  # never published
    ("llama", "EleutherAI/pythia-160m"),  # name of one family, architecture of another
    ("gpt_neox", "EleutherAI/gpt-neox-20b"),
    ("bloom", "bigscience/bloom-560m"),  # smaller BLOOMs: budget not in the table
    ("opt", "facebook/opt-iml-1.3b"),
    ("llama", "my-model"),
])
def test_unknown_is_none(model_type, name):
    assert known_pretrain_tokens({"model_type": model_type}, name) is None


def test_name_from_config():
    config = {"model_type": "gpt_neox", "_name_or_path": "EleutherAI/pythia-70m"}
    assert known_pretrain_tokens(config, "out") == 300e9
