"""Which of the source's rotary frequencies `uptrain convert --target mla` keeps rotary
(`--rope-stride S`, `--rope-dims D`), on the shipped reference Llama at α = 0: the source's
frequencies 0, S, 2S, … (D/2 of them, from the highest) stay rotary, shared by every head in one
key; the others lose their rotation. Rows at full rank (R = 256, the hidden size: the latent
compresses nothing, so a row measures the rotary part alone), then at 1/4 and 1/8 of MHA's KV
bytes (R = budget − D). Each row: the principal rotary key (weight space) and, with
`--calibrated`, the calibrated latent and rotary key on the default 32,768 tokens of the train
split. Perplexity on the validation split's first blocks of 256 tokens, as scripts/mla_study.py.

    python scripts/mla_rope_study.py [--eval-blocks 64] [--calibrated] [--rows D:S[:N] ...] [--budgets full 0.25 0.125]
    python scripts/mla_rope_study.py --cosines [--eval-blocks 8]

N (`--rope-residual`): the lowest N kept frequencies keep what the shared key misses, unrotated.
`--cosines` prints instead, per source frequency i, E[cos θ_i Δ] over the distances Δ the source's
attention reads, weighted by its attention probabilities (every layer, head and query alike):
keeping a residual r unrotated errs by r (e^{iθΔ} − 1), dropping it by r, so the first is the
smaller on average where E[2 − 2 cos θΔ] < 1, i.e. E[cos θΔ] > ½ — the candidate criterion for N.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from mla_study import MHA_ELEMENTS, REFERENCE, perplexity, validation_blocks  # scripts/ is on the path

from uptrain.convert import convert_checkpoint
from uptrain.data.corpus import split_path
from uptrain.loading import load_model

DEFAULT_ROWS = ["16:1", "16:2", "12:1", "12:2", "12:3", "8:1", "8:2", "8:3", "8:4", "8:5", "24:1", "4:1", "4:5"]


def attention_cosines(blocks: torch.Tensor) -> list[float]:
    """E[cos θ_i Δ] per source frequency i under the source's attention on `blocks` (module docstring)."""
    model = load_model(REFERENCE, "the reference", dtype=torch.float32).eval()
    model.set_attn_implementation("eager")  # the attention probabilities are returned by eager only
    config = model.config
    d = config.head_dim
    theta = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    mass = None
    with torch.no_grad():
        for block in blocks:
            attentions = model(block[None], output_attentions=True).attentions  # per layer [1, h, q, k]
            weights = torch.stack(attentions).double().sum(dim=(0, 1, 2))  # [q, k]
            n = weights.shape[0]
            distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
            by_distance = torch.zeros(n, dtype=torch.float64).index_add_(
                0, distance.clamp(min=0).flatten(), (weights * (distance >= 0)).flatten()
            )
            mass = by_distance if mass is None else mass + by_distance
    p = mass / mass.sum()
    return [(p * torch.cos(t * torch.arange(len(p), dtype=torch.float64))).sum().item() for t in theta]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--rows", nargs="*", default=DEFAULT_ROWS, help="D:S[:N] (rotary columns, stride, residual)")
    parser.add_argument("--budgets", nargs="*", default=["full", "0.25", "0.125"])
    parser.add_argument("--calibrated", action="store_true", help="also the calibrated latent and rotary key")
    parser.add_argument("--cosines", action="store_true", help="print E[cos θΔ] per frequency instead")
    parser.add_argument("--out", default=None, help="keep the conversions here (default: a temporary folder)")
    args = parser.parse_args()
    start = time.perf_counter()
    blocks = validation_blocks(args.eval_blocks)
    if args.cosines:
        print("| frequency i | θ_i (rad per token) | E[cos θ_i Δ] under the source's attention |\n|---|---|---|")
        for i, value in enumerate(attention_cosines(blocks)):
            print(f"| {i} | {10000.0 ** (-i / 16):.4g} | {value:.3f} |")
        print(f"wall time {time.perf_counter() - start:.0f} s")
        return
    root = Path(args.out or tempfile.mkdtemp(prefix="mla-rope-study-"))
    convert = dict(overwrite=True, progress=False, source_hash="none", target="mla")
    train = str(split_path("train"))
    print("| R | D | stride S | frequencies kept | residual N | principal key | calibrated latent and key |")
    print("|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        for pair in args.rows:
            d, s, n = (int(x) for x in (pair + ":0").split(":")[:3])
            rank = 256 if budget == "full" else round(float(budget) * MHA_ELEMENTS) - d
            keep = list(range(0, s * (d // 2), s))
            shape = dict(kv_rank=rank, rope_dims=d, rope_stride=s, rope_residual=n)
            out = convert_checkpoint(REFERENCE, root / f"p-{rank}-{d}-{s}-{n}", **shape, **convert)
            principal = f"{perplexity(out, blocks):.2f}"
            calibrated = "—"
            if args.calibrated:
                both = dict(mla_init="calibrated", rotary_key="calibrated", calibration_data=train)
                out = convert_checkpoint(REFERENCE, root / f"c-{rank}-{d}-{s}-{n}", **shape, **both, **convert)
                calibrated = f"{perplexity(out, blocks):.2f}"
            keep_text = ",".join(map(str, keep))
            print(f"| {rank} | {d} | {s} | {keep_text} | {n} | {principal} | {calibrated} |", flush=True)
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
