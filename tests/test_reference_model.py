"""The shipped reference model is a genuinely trained MHA model, and its card tells the truth."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from uptrain.compare.study import validate
from uptrain.data.batches import eval_batches
from uptrain.data.corpus import split_path
from uptrain.data.text import load_blocks
from uptrain.demo import REFERENCE, demo_spec


def test_reference_model_matches_its_card(tmp_path):
    card = json.loads((REFERENCE / "reference.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(REFERENCE).eval()
    config = model.config
    assert config.num_key_value_heads == config.num_attention_heads == 8  # MHA
    assert (REFERENCE / "model.safetensors").stat().st_size <= 40 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE)
    # The card's validation loss was measured by the training loop on these blocks.
    blocks, _ = load_blocks(
        str(split_path("validation")),
        "eval_data",
        tokenizer,
        card["seq_len"],
        "text",
        "train",
        None,
        "paragraph",
        False,
        None,
    )
    total, count = 0.0, 0
    with torch.no_grad():
        for input_ids, _counted in eval_batches(blocks, card["eval_blocks"], 16, 0, 1):
            logits = model(input_ids).logits[:, :-1]
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += input_ids[:, 1:].numel()
    loss = total / count
    assert abs(loss - card["validation_loss"]) < 1e-3, (loss, card["validation_loss"])
    assert math.exp(loss) < card["unigram_validation_perplexity"] / 3  # far below the unigram baseline
    assert card["pretrain_tokens"] > 1_000_000


def test_demo_runs_on_the_reference_model():
    spec = demo_spec("unused")
    validate(spec)
    assert spec.pretrain_tokens == json.loads((REFERENCE / "reference.json").read_text())["pretrain_tokens"]
