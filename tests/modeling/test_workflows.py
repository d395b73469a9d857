"""`uptrain train`, `inspect` and `compare` on architectures uptrain brings its own GQA
modeling for (GPT-NeoX; GPT-Neo with its local layers, MPT and Falcon for train): the commands are
unchanged, the checkpoints carry the modeling."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.modeling.classic_models import build, text, word_tokenizer
from tests.train.train_helpers import reset_accelerate
from uptrain.cli import main
from uptrain.speed import output_cache
from uptrain.train.metrics import read_metrics


def eval_loss(model_dir: Path, tokenizer, eval_text: str, seq_len: int, blocks: int) -> float:
    """The next-token loss of the checkpoint at `model_dir` over the first `blocks` eval blocks,
    computed here from the text: each paragraph (a .txt document) tokenized without specials and
    followed by EOS, the stream cut into `seq_len` blocks."""
    docs = [d for d in eval_text.split("\n\n") if d.strip()]
    stream = [t for d in docs for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    ids = torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)[:blocks]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


# GPT-NeoX; GPT-Neo (local layers); MPT and Falcon-RW for ALiBi.
@pytest.mark.parametrize("model_type", ["gpt_neox", "gpt_neo", "mpt", "falcon"])
def test_train_from_an_mha_source_and_inspect(model_type, tmp_path, capsys):
    corpus = text(1, 3000)
    (tmp_path / "train.txt").write_text(corpus)
    (tmp_path / "eval.txt").write_text(text(2, 600))
    tokenizer = word_tokenizer(corpus)
    model = build(model_type)
    model.resize_token_embeddings(len(tokenizer))
    model.config.update(
        dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    model.save_pretrained(tmp_path / "mha")
    tokenizer.save_pretrained(tmp_path / "mha")
    run = tmp_path / "run"
    try:
        code = main(
            [
                "train",
                "--source",
                str(tmp_path / "mha"),
                "--num_kv_heads",
                "2",
                "--train_data",
                str(tmp_path / "train.txt"),
                "--eval_data",
                str(tmp_path / "eval.txt"),
                "--output_dir",
                str(run),
                "--seq_len",
                "16",
                "--batch_size",
                "4",
                "--max_steps",
                "4",
                "--eval_every",
                "2",
                "--eval_blocks",
                "4",
                "--warmup_steps",
                "1",
                "--lr",
                "3e-3",
                "--report_to",
                "jsonl",
            ]
        )
    finally:
        reset_accelerate()
    assert code == 0, capsys.readouterr().err
    records = read_metrics(run / "metrics.jsonl")
    train_losses = [r["train/loss"] for r in records if "train/loss" in r]
    evals = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    assert len(train_losses) == 4 and all(map(math.isfinite, train_losses)), train_losses
    assert [step for step, _ in evals] == [0, 2, 4] and all(math.isfinite(loss) for _, loss in evals), evals
    assert evals[0][1] > evals[1][1] > evals[2][1], evals  # uptraining learns
    final = run / "final"
    # final/ holds the weights the run evaluated last: loaded afresh, they give its last eval loss.
    assert math.isclose(eval_loss(final, tokenizer, text(2, 600), 16, 4), evals[-1][1], rel_tol=1e-4)
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == f"{model_type}_gqa" and config["num_key_value_heads"] == 2
    assert (final / f"modeling_{model_type}_gqa.py").is_file() and (final / "attention.py").is_file()
    trained = AutoModelForCausalLM.from_pretrained(final)
    with torch.no_grad():
        cache = output_cache(trained(torch.tensor([[5, 6, 7]]), use_cache=True))
    assert cache.layers[0].keys.shape[1] == 2

    capsys.readouterr()
    assert main(["inspect", str(final), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    geometry = (report["model_type"], report["num_attention_heads"], report["num_key_value_heads"])
    assert geometry == (f"{model_type}_gqa", 8, 2)
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
    cmp = tmp_path / "cmp"
    try:
        code = main(
            [
                "compare",
                "--model",
                str(tmp_path / "mha"),
                "--num-kv-heads",
                "2",
                "--pooling",
                "mean",
                "first",
                "--output-dir",
                str(cmp),
                "--max-tokens",
                "256",
                "--train-data",
                str(tmp_path / "train.txt"),
                "--eval-data",
                str(tmp_path / "eval.txt"),
                "--seq-len",
                "16",
                "--batch-size",
                "4",
            ]
        )
    finally:
        reset_accelerate()
    assert code == 0, capsys.readouterr().err
    with open(cmp / "results.csv", newline="") as f:
        rows = {row["pooling"]: row for row in csv.DictReader(f)}
    assert list(rows) == ["mha", "mean", "first"]
    for pooling, row in rows.items():
        before, after = float(row["eval_loss_before"]), float(row["eval_loss_after"])
        assert math.isfinite(before) and math.isfinite(after) and after < before, (pooling, before, after)
    assert int(rows["mha"]["num_kv_heads"]) == 8 and int(rows["mean"]["num_kv_heads"]) == 2
    # Each α = 0 loss is that of the model it names (the source, or its conversion) on the eval text;
    # 600 words give 43 blocks of 16 tokens, all under the default of 64 eval blocks.
    eval_text = text(2, 600)
    for pooling, model_dir in [
        ("mha", tmp_path / "mha"),
        ("mean", cmp / "converted" / "g2-mean"),
        ("first", cmp / "converted" / "g2-first"),
    ]:
        if pooling != "mha":
            config = json.loads((model_dir / "config.json").read_text())
            assert config["model_type"] == "gpt_neox_gqa" and config["num_key_value_heads"] == 2
        expected = eval_loss(model_dir, tokenizer, eval_text, 16, 64)
        assert math.isclose(float(rows[pooling]["eval_loss_before"]), expected, rel_tol=1e-4), pooling
    assert float(rows["mean"]["eval_loss_before"]) != float(rows["first"]["eval_loss_before"])  # two poolings
