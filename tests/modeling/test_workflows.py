"""`uptrain train`, `inspect` and `compare` on an architecture uptrain brings its own GQA
modeling for (GPT-NeoX): the commands are unchanged, the checkpoints carry the modeling."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from tests.modeling.classic_models import build, text, word_tokenizer
from uptrain.cli import main


def test_train_from_an_mha_source_and_inspect(tmp_path, capsys):
    corpus = text(1, 3000)
    (tmp_path / "train.txt").write_text(corpus)
    (tmp_path / "eval.txt").write_text(text(2, 600))
    tokenizer = word_tokenizer(corpus)
    model = build("gpt_neox")
    model.resize_token_embeddings(len(tokenizer))
    model.config.update(dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(tmp_path / "mha")
    tokenizer.save_pretrained(tmp_path / "mha")
    run = tmp_path / "run"
    try:
        code = main(["train", "--source", str(tmp_path / "mha"), "--num_kv_heads", "2",
                     "--train_data", str(tmp_path / "train.txt"), "--eval_data", str(tmp_path / "eval.txt"),
                     "--output_dir", str(run), "--seq_len", "16", "--batch_size", "4", "--max_steps", "4",
                     "--eval_every", "2", "--eval_blocks", "4", "--warmup_steps", "1", "--lr", "3e-3",
                     "--report_to", "jsonl"])
    finally:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert code == 0, capsys.readouterr().err
    final = run / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == "gpt_neox_gqa" and config["num_key_value_heads"] == 2
    assert (final / "modeling_gpt_neox_gqa.py").is_file() and (final / "attention.py").is_file()
    trained = AutoModelForCausalLM.from_pretrained(final)
    with torch.no_grad():
        cache = trained(torch.tensor([[5, 6, 7]]), use_cache=True).cache
    assert cache.layers[0].keys.shape[1] == 2

    capsys.readouterr()
    assert main(["inspect", str(final), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    geometry = (report["model_type"], report["num_attention_heads"], report["num_key_value_heads"])
    assert geometry == ("gpt_neox_gqa", 8, 2)
    assert report["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # K and V × layers × G × head_dim × fp32


def test_compare_runs_on_gpt_neox(tmp_path, capsys):
    """`uptrain compare` converts, evaluates and uptrains a NeoX model at G = 2 with two poolings."""
    corpus = text(1, 3000)
    (tmp_path / "train.txt").write_text(corpus)
    (tmp_path / "eval.txt").write_text(text(2, 600))
    tokenizer = word_tokenizer(corpus)
    model = build("gpt_neox")
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "mha")
    tokenizer.save_pretrained(tmp_path / "mha")
    try:
        code = main(["compare", "--model", str(tmp_path / "mha"), "--num-kv-heads", "2", "--pooling", "mean", "first",
                     "--output-dir", str(tmp_path / "cmp"), "--max-tokens", "256", "--train-data",
                     str(tmp_path / "train.txt"), "--eval-data", str(tmp_path / "eval.txt"), "--seq-len", "16",
                     "--batch-size", "4"])
    finally:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert code == 0, capsys.readouterr().err
    rows = (tmp_path / "cmp" / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + 3  # header, MHA, mean, first
