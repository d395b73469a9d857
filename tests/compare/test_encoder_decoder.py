"""`uptrain compare` on a tiny T5 v1.1, the paper's setting, end to end: conversion of the decoder's
self- and cross-attention, span-corruption uptraining, and speed measured from both caches."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from transformers import T5Config, T5ForConditionalGeneration

from tests.compare.test_budget import rows_of
from uptrain.cli import main
from uptrain.data.corpus import load_tokenizer, read_documents

HEADS, D_KV, DECODER_LAYERS = 4, 8, 2


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare_t5")
    tokenizer = load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(16)]})
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=D_KV,
        num_heads=HEADS,
        num_layers=1,
        num_decoder_layers=DECODER_LAYERS,
        d_ff=64,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(root / "mha")
    tokenizer.save_pretrained(root / "mha")
    (root / "mha" / "reference.json").write_text(json.dumps({"pretrain_tokens": 20480}))
    docs = [d["text"][:4000] for _, d in zip(range(8), read_documents("validation"))]
    (root / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:6]))
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[6:]))
    return root


def test_t5_compare_converts_the_decoder_uptrains_with_span_corruption_and_times_both_caches(t5, tmp_path):
    out = tmp_path / "cmp"
    argv = ["compare", "--model", str(t5 / "mha"), "--num-kv-heads", "2", "1", "--pooling", "mean", "random"]
    argv += ["--train-data", str(t5 / "train.jsonl"), "--eval-data", str(t5 / "eval.jsonl"), "--output-dir", str(out)]
    argv += ["--uptrain-fraction", "0.05", "--seq-len", "32", "--batch-size", "4", "--eval-every", "4"]
    argv += ["--eval-blocks", "4", "--warmup-steps", "1", "--report-to", "jsonl", "--speed-batch", "2"]
    argv += ["--speed-repeats", "1", "--speed-context", "16", "--speed-new-tokens", "4"]
    assert main(argv) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["num_kv_heads"], r["pooling"]) for r in rows] == [
        ("4", "mha"),
        ("2", "mean"),
        ("2", "random"),
        ("1", "mean"),
        ("1", "random"),
    ]
    mha_cache = int(rows[0]["kv_cache_bytes"])
    for r in rows:
        g = int(r["num_kv_heads"])
        # α = 0.05 of the card's 20,480 tokens = 1,024 = 8 steps of 4 × 32 input tokens.
        assert int(r["uptrain_tokens"]) == 1024
        # Apart, both at G: the self-attention's per target token, the cross-attention's per source position.
        assert int(r["kv_cache_bytes_per_token"]) == int(r["cross_kv_cache_bytes_per_source_token"]), r
        assert int(r["kv_cache_bytes_per_token"]) == 2 * DECODER_LAYERS * g * D_KV * 4, r
        # Measured from both caches after decoding: 4 self-attention positions, 16 cross-attention ones.
        per_position = 2 * DECODER_LAYERS * g * D_KV * 4 * 2
        assert (
            int(r["kv_cache_bytes"]) == per_position * (4 + 16) and int(r["kv_cache_bytes"]) * HEADS // g == mha_cache
        )
        assert float(r["eval_loss_after"]) < float(r["eval_loss_before"]) or r["pooling"] == "mha", r
    speed = json.loads((out / "speed-g2.json").read_text())
    assert (
        speed["cross_attention_num_kv_heads"] == 2
        and speed["cross_attention_cache_bytes"] == 2 * DECODER_LAYERS * 2 * D_KV * 4 * 2 * 16
    )
    assert "16-token source encoded once + 4 new tokens with both KV caches" in (out / "results.md").read_text()
    converted = json.loads((out / "converted" / "g2-mean" / "config.json").read_text())
    assert converted["model_type"] == "t5_gqa"
    assert (converted["decoder_num_key_value_heads"], converted["cross_attention_num_key_value_heads"]) == (2, 2)
    assert converted.get("encoder_num_key_value_heads", HEADS) == HEADS  # the paper's choice: the decoder's only
    recorded = yaml.safe_load((out / "runs" / "g2-mean" / "train" / "run_config.yaml").read_text())
    assert recorded.get("objective") in (None, "span_corruption")  # T5's own objective, by default


def test_t5_budget_rows_report_each_caches_kv_bytes_apart_and_the_budgets_weighted_bytes(t5, tmp_path):
    """`--kv-budget F --cross-kv-weight R` on an encoder–decoder: each row's KV bytes are its decoder
    self-attention's per target token and its cross-attention's per source position, apart (two
    lengths: no sum of them is a cache size), each exactly what its converted heads hold; the
    quality-vs-bytes plot's measure is the budget's own, self + R × cross: F × MHA's for a uniform
    allocation, at most that for a calibrated one."""
    from uptrain.compare.report import budget_bytes
    from uptrain.compare.study import RunResult

    out, weight = tmp_path / "cmp", 4
    argv = ["compare", "--model", str(t5 / "mha"), "-g", "2", "--kv-budget", "0.5", "--cross-kv-weight", str(weight)]
    argv += ["--allocation", "uniform", "calibrated", "--pooling", "mean", "--output-dir", str(out)]
    argv += ["--train-data", str(t5 / "train.jsonl"), "--eval-data", str(t5 / "eval.jsonl"), "--max-tokens", "256"]
    argv += ["--seq-len", "32", "--batch-size", "4", "--eval-every", "2", "--eval-blocks", "2", "--warmup-steps", "1"]
    assert main([*argv, "--report-to", "jsonl", "--speed-repeats", "0", "--calibration-tokens", "256"]) == 0
    rows = rows_of(out)
    budgets = [("0.5", "uniform"), ("0.5", "calibrated")]
    assert [(r["kv_budget"], r["allocation"]) for r in rows] == [("", "")] * 2 + budgets  # MHA, G = 2, budgets

    def heads(r: dict) -> list[list[int]]:  # decoder self-attention's, cross-attention's, layer by layer
        if r["kv_heads_per_layer"]:
            return [[int(h) for h in part.split(",")] for part in r["kv_heads_per_layer"].split("/")]
        return [[int(r["num_kv_heads"])] * DECODER_LAYERS] * 2

    for r in rows:
        own, cross = heads(r)
        assert int(r["kv_cache_bytes_per_token"]) == 2 * sum(own) * D_KV * 4, r
        assert int(r["cross_kv_cache_bytes_per_source_token"]) == 2 * sum(cross) * D_KV * 4, r
    markdown = (out / "results.md").read_text()
    assert "| KV self bytes/target token | KV cross bytes/source position |" in markdown
    assert "A --kv-budget counts self + R × cross (R: --cross-kv-weight" in markdown
    for r in rows:
        cells = f"| {int(r['kv_cache_bytes_per_token']):,} | {int(r['cross_kv_cache_bytes_per_source_token']):,} |"
        assert cells in markdown, cells
    results = {p.parent.name: RunResult(**json.loads(p.read_text())) for p in (out / "runs").glob("*/result.json")}
    spent = {name: budget_bytes(r, weight) / budget_bytes(results["mha"], weight) for name, r in results.items()}
    assert spent["b0.5-uniform-mean"] == 0.5 and spent["b0.5-calibrated-mean"] <= 0.5, spent
