"""Pretrain the project's MHA reference model from random initialisation, with uptrain's own loop.

    python scripts/make_reference_model.py                      # the shipped model (~20 min on 2 idle cores)
    python scripts/make_reference_model.py --tokens 200000 --output-dir /tmp/ref   # a quick try

A Llama-architecture model with 8 heads and 8 KV heads (plain MHA) is initialised from a seed,
pretrained on the train split of the shipped corpus for a recorded number of tokens, and
written to `uptrain/assets/reference/` with the tokenizer and a card: pretraining tokens, final
validation loss and perplexity, the unigram-model baseline, and this command. The recorded token
count makes "uptrain for α = 5% of pretraining" exact for this model.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "uptrain" / "assets" / "reference"
ARCHITECTURE = dict(
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=8,
    num_hidden_layers=6,
    intermediate_size=704,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    initializer_range=0.02,
    rms_norm_eps=1e-5,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=3_000_000, help="pretraining tokens (default: 3,000,000)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--work-dir",
        type=Path,
        default=ROOT / "runs" / "reference-pretrain",
        help="training run folder (checkpoints, metrics; rerunning resumes it)",
    )
    p.add_argument(
        "--output-dir", type=Path, default=DEFAULT_OUT, help=f"where the model goes (default: {DEFAULT_OUT})"
    )
    return p.parse_args()


def initial_checkpoint(folder: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from uptrain.data.corpus import load_tokenizer

    tokenizer = load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **ARCHITECTURE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> int:
    args = parse_args()
    from uptrain.checkpoint.reader import SourceCheckpoint
    from uptrain.data.corpus import load_tokenizer, split_path, unigram_perplexity
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training
    from uptrain.train.metrics import read_metrics

    init = args.work_dir.parent / (args.work_dir.name + "-init")
    if not (init / "config.json").exists():
        initial_checkpoint(init, args.seed)
    data = {}
    for split in ("train", "validation"):  # plain jsonl copies of the shipped gzip'd splits
        data[split] = args.work_dir.parent / f"{split}.jsonl"
        if not data[split].exists():
            with gzip.open(split_path(split), "rb") as src, open(data[split], "wb") as dst:
                shutil.copyfileobj(src, dst)
    resume = (args.work_dir / "metrics.jsonl").exists()
    config = TrainConfig(
        model=str(init),
        train_data=str(data["train"]),
        eval_data=str(data["validation"]),
        output_dir=str(args.work_dir),
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=100,
        max_tokens=args.tokens,
        eval_every=200,
        save_every=200,
        eval_blocks=128,
        seed=args.seed,
        report_to=["jsonl"],
        resume=resume,
        weight_decay=0.1,
    )
    final = run_training(config)
    records = read_metrics(args.work_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/loss" in r]
    tokens = max(r.get("train/tokens_seen", 0) for r in records)
    baseline = unigram_perplexity(load_tokenizer()).perplexity
    card = {
        "architecture": "llama",
        **ARCHITECTURE,
        "vocab_size": len(load_tokenizer()),
        "parameters": sum(math.prod(t.shape) for t in SourceCheckpoint(Path(final)).tensors.values()),
        "pretrain_tokens": tokens,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "validation_loss": evals[-1]["eval/loss"],
        "validation_perplexity": math.exp(evals[-1]["eval/loss"]),
        "eval_blocks": 128,
        "unigram_validation_perplexity": baseline,
        # The arguments that shape the model (the work and output folders do not).
        "command": (
            f"python scripts/make_reference_model.py --tokens {args.tokens} --seq-len {args.seq_len} "
            f"--batch-size {args.batch_size} --lr {args.lr} --seed {args.seed}"
        ),
    }
    out = args.output_dir
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(final, tmp)
    (tmp / "reference.json").write_text(json.dumps(card, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(json.dumps(card))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
