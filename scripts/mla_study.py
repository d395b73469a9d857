"""MLA (`uptrain convert --target mla`, initialisations svd and calibrated) against GQA (mean,
calibrated) at equal KV bytes, on the shipped reference Llama, at α = 0 (no uptraining); the shared
rotary key principal (the default), mean (the ablation, SVD rows only) and calibrated (calibrated
rows only).

    python scripts/mla_study.py [--eval-blocks 64] [--rope-dims 8 16 32] [--out DIR]

The reference caches 2 · 8 heads · 32 = 512 elements per token and layer. At 1/4 of that (128:
G = 2) and 1/8 (64: G = 1), each MLA row spends the budget as rank R = budget − D on the latent and
D on the shared rotary key. Rows at full rank (R = 256, the hidden size) isolate what the rotary
choices cost (the shared, head-averaged rotary key; the frequencies that lose their rotation);
rows "no latent norm" score the same weights with `kv_a_layernorm` removed, the latent going
straight to `kv_b_proj`, which both initialisations fit to the latent before the norm (the layout
cannot do that: it measures what the norm costs). The calibrated rows (MLA's and GQA's) read the
default 32,768 tokens of the train split. Perplexity on the validation
split's first blocks of 256 tokens, as scripts/allocation_study.py scores them.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from uptrain.convert import convert_checkpoint
from uptrain.convert.layer_loss import mean_loss
from uptrain.convert.mla import ROTARY_KEYS
from uptrain.data.corpus import split_path
from uptrain.data.text import load_blocks
from uptrain.loading import load_model, load_tokenizer

REFERENCE = "uptrain/assets/reference"
MHA_ELEMENTS = 2 * 8 * 32  # per token and layer


class NoNorm(torch.nn.Module):
    """In place of `kv_a_layernorm`: the latent as `kv_a_proj_with_mqa` computes it, which is what
    `kv_b_proj` was fitted to (the norm's weight is 1 for svd, the latent's rms for calibrated)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def perplexity(folder: Path, blocks: torch.Tensor, without_norm: bool = False) -> float:
    model = load_model(folder, "a conversion", dtype=torch.float32).eval()
    if without_norm:
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm = NoNorm()
    return math.exp(mean_loss(model, blocks))


def validation_blocks(count: int) -> torch.Tensor:
    """The validation split's first `count` blocks of 256 tokens (scripts/allocation_study.py's)."""
    tokenizer = load_tokenizer(REFERENCE, "the reference")
    blocks, _ = load_blocks(
        str(split_path("validation")), "eval_data", tokenizer, 256, "text", "train", None, "document", False, None
    )
    return blocks.take(list(range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--rope-dims", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--out", default=None, help="keep the conversions here (default: a temporary folder)")
    args = parser.parse_args()
    start = time.perf_counter()
    blocks = validation_blocks(args.eval_blocks)
    root = Path(args.out or tempfile.mkdtemp(prefix="mla-study-"))
    convert = dict(overwrite=True, progress=False, source_hash="none")

    def row(name: str, elements: int, ppl: float) -> None:
        print(f"| {name} | {elements} ({elements / MHA_ELEMENTS:.4g}) | {ppl:.2f} |", flush=True)

    print("| conversion | KV elements per token and layer (of MHA's) | perplexity |\n|---|---|---|")
    source = load_model(REFERENCE, "the reference", dtype=torch.float32).eval()
    row("MHA (source)", MHA_ELEMENTS, math.exp(mean_loss(source, blocks)))
    for d in args.rope_dims:
        for key in ROTARY_KEYS:
            mla = dict(target="mla", kv_rank=256, rope_dims=d, rotary_key=key)
            out = convert_checkpoint(REFERENCE, root / f"mla-full-{d}-{key}", **mla, **convert)
            row(f"MLA full rank R=256, D={d}, {key} rotary key", 256 + d, perplexity(out, blocks))
    train = str(split_path("train"))
    for fraction, g in ((1 / 4, 2), (1 / 8, 1)):
        budget = round(fraction * MHA_ELEMENTS)
        for pooling in ("mean", "calibrated"):
            data = {"calibration_data": train} if pooling == "calibrated" else {}
            out = convert_checkpoint(REFERENCE, root / f"gqa-{pooling}-{g}", g, pooling=pooling, **data, **convert)
            row(f"GQA {pooling} G={g}", 2 * g * 32, perplexity(out, blocks))
        for d in args.rope_dims:
            rank = budget - d
            for key in ROTARY_KEYS:
                mla = dict(target="mla", kv_rank=rank, rope_dims=d, rotary_key=key)
                out = convert_checkpoint(REFERENCE, root / f"mla-{rank}-{d}-{key}", **mla, **convert)
                row(f"MLA SVD R={rank}, D={d}, {key} rotary key", budget, perplexity(out, blocks))
                if key == "principal":
                    name = f"MLA SVD R={rank}, D={d}, {key}, no latent norm (not the layout)"
                    row(name, budget, perplexity(out, blocks, True))
            calibrated = dict(target="mla", kv_rank=rank, rope_dims=d, mla_init="calibrated", calibration_data=train)
            out = convert_checkpoint(REFERENCE, root / f"mla-{rank}-{d}-calibrated", **calibrated, **convert)
            row(f"MLA calibrated R={rank}, D={d}, principal rotary key", budget, perplexity(out, blocks))
            name = f"MLA calibrated R={rank}, D={d}, principal, no latent norm (not the layout)"
            row(name, budget, perplexity(out, blocks, True))
            both = dict(calibrated, rotary_key="calibrated")
            out = convert_checkpoint(REFERENCE, root / f"mla-{rank}-{d}-calibrated-key", **both, **convert)
            row(f"MLA calibrated R={rank}, D={d}, calibrated rotary key", budget, perplexity(out, blocks))
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
