"""The shipped reference T5 is a genuinely pretrained MHA T5 v1.1, and its card tells the truth."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from uptrain.data.corpus import load_tokenizer, split_path
from uptrain.data.text import load_blocks
from uptrain.demo import REFERENCE_T5
from uptrain.objectives import sentinel_ids_for, span_corruption, span_corruption_lengths

CARD = json.loads((REFERENCE_T5 / "reference.json").read_text())


def test_reference_t5_is_an_mha_t5_v1_1_with_sentinels():
    model = AutoModelForSeq2SeqLM.from_pretrained(REFERENCE_T5)
    config = model.config
    assert config.model_type == "t5" and config.num_heads == 8 and config.d_kv == CARD["d_kv"]
    assert not any(k.endswith("num_key_value_heads") for k in config.to_dict() if config.to_dict()[k] is not None)
    # T5 v1.1: gated GELU, the head's input not scaled (transformers 5 ties the head to the embedding).
    assert config.feed_forward_proj == "gated-gelu" and config.scale_decoder_outputs is False
    assert (REFERENCE_T5 / "model.safetensors").stat().st_size <= 16 * 2**20
    assert sum(p.numel() for p in model.parameters()) == CARD["parameters"]
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_T5)
    shipped = load_tokenizer()
    # The sentinels are appended: every token of the shipped tokenizer keeps its id.
    assert sentinel_ids_for(tokenizer) == list(range(len(shipped), len(shipped) + CARD["num_sentinels"]))
    text = "To be, or not to be, that is the question."
    assert tokenizer(text)["input_ids"] == shipped(text)["input_ids"]
    assert len(tokenizer) == config.vocab_size == CARD["vocab_size"]


def test_reference_t5_scores_its_card_s_validation_loss():
    """Recomputed from the card's facts alone: its validation blocks, corrupted with its seed."""
    model = AutoModelForSeq2SeqLM.from_pretrained(REFERENCE_T5).eval()
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_T5)
    raw = span_corruption_lengths(CARD["seq_len"])[0]
    assert raw == CARD["raw_block_len"]
    blocks, _ = load_blocks(
        str(split_path("validation")), "eval_data", tokenizer, raw, "text", "train", None, "paragraph", False, None
    )
    rows = blocks.take(list(range(CARD["eval_blocks"])))
    batch = span_corruption(
        rows,
        sentinel_ids=sentinel_ids_for(tokenizer),
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(CARD["eval_seed"]),
    )
    assert batch["input_ids"].shape == (CARD["eval_blocks"], CARD["seq_len"])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], labels=batch["labels"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    assert abs(loss - CARD["validation_loss"]) < 1e-3, (loss, CARD["validation_loss"])
    assert loss < CARD["validation_loss_initial"] - 2  # it learned: far below its start near ln(vocab)


def test_card_budget_makes_five_percent_exact():
    assert CARD["pretrain_tokens"] == CARD["steps"] * CARD["batch_size"] * CARD["seq_len"]
    assert CARD["pretrain_tokens"] * 5 % 100 == 0  # α = 5% is a whole number of tokens
    assert CARD["objective"] == "span_corruption" and CARD["command"].startswith("python scripts/make_reference_t5.py")


def test_the_t5_demo_runs_on_the_reference_t5(tmp_path):
    from uptrain.compare.speed_rows import speed_setting
    from uptrain.compare.study import validate
    from uptrain.demo import demo_spec

    spec = demo_spec(tmp_path / "demo", reference="t5")
    validate(spec)  # every conversion's checks and every run's TrainConfig
    assert spec.pretrain_tokens == CARD["pretrain_tokens"] and spec.seq_len == CARD["seq_len"]
    assert spec.objective == "span_corruption" and spec.model == str(REFERENCE_T5)
    # T5 has relative positions: the speed defaults apply as they are, a 480-token source at batch 8.
    assert speed_setting(spec) == {
        "context": 480,
        "new_tokens": 32,
        "batch": 8,
        "repeats": 2,
        "device": "cpu",
        "dtype": "float32",
    }
