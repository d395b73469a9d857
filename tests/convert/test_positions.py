"""Lengths uptrain chooses stay within the model's positions, read from the config field the
architecture's record names (GPT-2's n_positions, BART's max_position_embeddings), and lengths a
user asks for beyond them are refused in one line: calibration clamps its blocks; tokenize and
train refuse a seq_len the model cannot read."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BartConfig, BartForConditionalGeneration

from tests.modeling.classic_models import CONFIGS, SHARED
from tests.train.test_seq2seq import WORDS, build_tokenizer
from tests.train.train_helpers import make_text
from uptrain.architecture import REGISTRY
from uptrain.cli import main


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Plain text, more than one 256-token calibration block of it."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(make_text(1, 400) + "\n\n" + " ".join(WORDS * 40) + "\n")
    return path


@pytest.fixture(scope="module")
def gpt2(tokenizer, tmp_path_factory):
    """A tiny GPT-2 of 128 positions, spelled as GPT-2 spells them: `n_positions`."""
    shared = dict(SHARED, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    shared.update(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model("gpt2", **{**CONFIGS["gpt2"], **shared, "n_positions": 128})
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gpt2") / "src"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["n_positions"] == 128
    return folder


@pytest.fixture(scope="module")
def bart(text, tmp_path_factory):
    """A tiny BART of 160 positions (encoder and decoder alike) with a word-level tokenizer."""
    tokenizer = build_tokenizer(text.read_text(), sentinels=False)
    config = BartConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=40,
        decoder_ffn_dim=40,
        max_position_embeddings=160,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id,
        forced_bos_token_id=None,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("bart") / "src"
    BartForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model, positions", [("gpt2", 128), ("bart", 160)])
def test_calibration_blocks_are_clamped_to_the_positions(model, positions, request, text, capsys, tmp_path):
    """The default 256-token calibration blocks are longer than the model's positions: calibration
    cuts them there (it chose the length), where it used to end in an IndexError."""
    src = request.getfixturevalue(model)
    out = tmp_path / "out"
    argv = ["convert", str(src), str(out), "-g", "2", "--pooling", "calibrated", "--calibration-data", str(text)]
    assert main([*argv, "--calibration-tokens", "512", "--source-hash", "none"]) == 0, capsys.readouterr().err
    calibration = json.loads((out / "uptrain.json").read_text())["calibration"]
    assert calibration["seq_len"] == positions


def test_tokenize_refuses_blocks_beyond_the_positions(gpt2, text, capsys, tmp_path):
    """A seq_len GPT-2 cannot read is refused before any text is read, naming n_positions."""
    out = tmp_path / "tokens"
    assert main(["tokenize", str(text), str(out), "--tokenizer", str(gpt2), "--seq-len", "129"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "128 positions" in err and "n_positions" in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert main(["tokenize", str(text), str(out), "--tokenizer", str(gpt2), "--seq-len", "128"]) == 0


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_every_positions_key_is_a_field_the_config_saves(model_type):
    """Each record's positions keys are fields its transformers config writes to config.json
    (a misspelt key would read as "no limit")."""
    arch = REGISTRY[model_type]
    saved = AutoConfig.for_model(model_type).to_dict()
    for key in (arch.target_positions_key, arch.source_text_positions_key, arch.source_positions_key):
        if key is not None:
            assert isinstance(saved.get(key), int), (model_type, key)
