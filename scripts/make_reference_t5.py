"""Pretrain the project's encoder–decoder reference model (a small MHA T5 v1.1) from a seed.

    python scripts/make_reference_t5.py                                    # the shipped model
    python scripts/make_reference_t5.py --tokens 50000 --output-dir /tmp/t5   # a quick try

The GQA paper's own setting is T5 (encoder–decoder, GQA in the decoder's self- and cross-attention),
so `uptrain demo --reference t5` needs a T5 that uptrain trained itself, whose pretraining budget is
known exactly. This one is T5 v1.1-shaped (gated-GELU feed-forward, unscaled head, no dropout
while pretraining, relative position buckets; transformers 5 ties the head to the embedding),
MHA with 8 heads so that G can be 8, 4, 2 or 1, and small enough to pretrain in minutes on two
CPU cores. It learns T5's objective, span corruption
(`uptrain.objectives.span_corruption`: 15 % of each block dropped in spans of mean length 3, each span
replaced by a sentinel `<extra_id_N>`, the targets are the sentinels and the dropped spans), on the
train split of the shipped corpus, tokenized with the shipped tokenizer plus 100 sentinel tokens
(saved with the model).

Token accounting, as `uptrain train` counts a span-corruption run: `--seq-len` is the model's input
length (128 tokens); the corpus is packed into the raw blocks that corrupt to exactly that many
(`span_corruption_lengths`: 141 raw tokens, 21 of them dropped in 7 spans, + 7 sentinels + EOS), each
block one example, and `pretrain_tokens` = steps × batch × seq_len. An uptraining run over the same
blocks counts the same way, so α = 5 % of it is exact. The script writes `uptrain/assets/reference_t5/`
with the tokenizer and a card (`reference.json`): pretraining tokens, final validation loss on the
targets of span-corrupted validation blocks (the corruption drawn from a fixed seed), and this command.

The loop is a plain AdamW loop (warmup, cosine to a tenth, clipping) over shuffled blocks; it is all
here so that the card's numbers can be traced to a few lines.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "uptrain" / "assets" / "reference_t5"
NUM_SENTINELS = 100  # T5's count; a 128-token input holds 7 of them
ARCHITECTURE = dict(
    d_model=128,
    d_kv=32,  # 8 heads × 32 = 256 ≠ d_model: T5's head size is its own
    num_heads=8,
    num_layers=2,
    num_decoder_layers=2,
    d_ff=384,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,  # v1.1: the head's input is not scaled by d_model^-1/2
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    initializer_factor=1.0,
)
EVAL_SEED = 1234  # the validation blocks' corruption: one fixed draw, the same for every evaluation


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=163_840, help="pretraining tokens (default: 163,840)")
    p.add_argument("--seq-len", type=int, default=128, help="input tokens per example (after corruption)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument("--eval-blocks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--output-dir", type=Path, default=DEFAULT_OUT, help=f"where the model goes (default: {DEFAULT_OUT})"
    )
    return p.parse_args()


def reference_tokenizer():
    """The shipped tokenizer with `<extra_id_0>` … `<extra_id_99>` added as special tokens (ids
    8192 … 8291: appended, so every other token keeps its id)."""
    from uptrain.data.corpus import load_tokenizer

    tokenizer = load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(NUM_SENTINELS)]})
    return tokenizer


def build_model(tokenizer, seed: int):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,  # T5's convention: decoding starts from pad
        **ARCHITECTURE,
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    # transformers 5 ties T5's head to the shared embedding (`tie_word_embeddings: False` only turns
    # off the v1.0 scaling of the head's input) and initialises it with std 1.0: logits of std
    # √d_model and a first loss near 68 nats. Std d_model^-1/2 (t5x's fan-in scaling) starts near ln(vocab).
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, config.d_model**-0.5)
    return model


def blocks(split: str, tokenizer, length: int) -> torch.Tensor:
    """The split packed as the training loop packs it (documents joined with EOS, cut into
    blocks of `length` raw tokens), as one [n, length] tensor."""
    from uptrain.data.corpus import split_path
    from uptrain.data.text import load_blocks

    packed, _ = load_blocks(
        str(split_path(split)), split, tokenizer, length, "text", "train", None, "paragraph", False, None
    )
    return packed.take(list(range(len(packed))))


def corrupt(rows: torch.Tensor, tokenizer, generator: torch.Generator) -> dict[str, torch.Tensor]:
    from uptrain.objectives import sentinel_ids_for, span_corruption

    return span_corruption(
        rows,
        sentinel_ids=sentinel_ids_for(tokenizer),
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        generator=generator,
    )


def validation_loss(model, tokenizer, rows: torch.Tensor, batch_size: int = 32) -> float:
    """Mean cross-entropy per target token over span-corrupted `rows`, the corruption drawn from
    EVAL_SEED (so every evaluation, and tests/test_reference_t5.py, scores the same targets)."""
    import torch.nn.functional as F

    batch = corrupt(rows, tokenizer, torch.Generator().manual_seed(EVAL_SEED))
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            inputs, labels = batch["input_ids"][i : i + batch_size], batch["labels"][i : i + batch_size]
            logits = model(input_ids=inputs, labels=labels).logits
            total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    model.train()
    return total / count


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from uptrain.checkpoint.atomic import atomic_directory

    started = time.perf_counter()
    tokenizer = reference_tokenizer()
    model = build_model(tokenizer, args.seed)
    from uptrain.objectives import span_corruption_lengths

    raw = span_corruption_lengths(args.seq_len)[0]
    train, valid = blocks("train", tokenizer, raw), blocks("validation", tokenizer, raw)
    valid = valid[: args.eval_blocks]
    tokens_per_step = args.batch_size * args.seq_len
    steps = -(-args.tokens // tokens_per_step)
    epochs = -(-steps * args.batch_size // len(train))
    generator = torch.Generator().manual_seed(args.seed)  # data order and corruption
    order = torch.cat([torch.randperm(len(train), generator=generator) for _ in range(epochs)])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "relative_attention_bias" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "relative_attention_bias" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    initial = validation_loss(model, tokenizer, valid)
    print(f"{steps} steps × {tokens_per_step} tokens; validation loss at step 0: {initial:.4f}", flush=True)
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, args.warmup_steps)
        batch = corrupt(train[order[step * args.batch_size : (step + 1) * args.batch_size]], tokenizer, generator)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step + 1}/{steps} loss {loss.item():.4f} ({elapsed:.0f} s)", flush=True)
    final = validation_loss(model, tokenizer, valid)
    card = {
        "architecture": "t5",
        **ARCHITECTURE,
        "vocab_size": len(tokenizer),
        "num_sentinels": NUM_SENTINELS,
        "parameters": sum(p.numel() for p in model.parameters()),
        "objective": "span_corruption",
        "noise_density": 0.15,
        "mean_span": 3.0,
        "pretrain_tokens": steps * tokens_per_step,
        "steps": steps,
        "seq_len": args.seq_len,
        "raw_block_len": raw,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "seed": args.seed,
        "validation_loss_initial": initial,
        "validation_loss": final,
        "validation_perplexity": math.exp(final),
        "eval_blocks": len(valid),
        "eval_seed": EVAL_SEED,
        "train_seconds": round(time.perf_counter() - started),
        "torch_threads": args.threads,
        # The arguments that shape the model (the output folder does not).
        "command": (
            f"python scripts/make_reference_t5.py --tokens {args.tokens} --seq-len {args.seq_len} "
            f"--batch-size {args.batch_size} --lr {args.lr} --warmup-steps {args.warmup_steps} "
            f"--eval-blocks {args.eval_blocks} --seed {args.seed}"
        ),
    }
    with atomic_directory(args.output_dir, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "reference.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
