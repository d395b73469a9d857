"""Greedy-decode speed and KV-cache size: an MHA Llama versus the same model converted to GQA.

The MHA model is built from a config with random weights (decode speed does not depend on
weight values), saved, and converted with `uptrain.convert.convert_checkpoint` to G KV heads,
so the GQA side is exactly what `uptrain convert` produces. Every measurement is
`uptrain.speed`'s (the one behind `uptrain speed`): for every context length and batch size
both models generate greedily from the same prompt with the cache, one warm-up sample each,
then the timed samples with MHA and GQA alternating so machine noise hits both alike. Each
sample times the prompt's pass (prefill) and every decode step on its own.

KV-cache bytes are summed from the real cache tensors (`cache.layers[i].keys/values`) after a
sample; their ratio must be exactly G/h (asserted). Decode reads the whole cache for every
new token, so it is bound by memory bandwidth once the cache outgrows the weights: that is
where GQA is faster (docs/concepts/kv_cache.md). At short contexts the weights dominate each step and
both models decode at about the same speed; prefill costs the same attention FLOPs for both.
No decode step can beat the bytes it reads, so each setting also reports its bound: h/G once
the cache dominates, (weights + MHA cache) / (weights + GQA cache) in general, and the measured
speed-up as a fraction of that bandwidth bound.

CPU (default): fp32, a 28M-parameter model, 8 new tokens × 3 samples, 1 torch thread.
    python scripts/bench_decode.py                                  # minutes: each sample prefills again
    python scripts/bench_decode.py --contexts 256,1024 --batches 1,8  # quick
GPU: bf16, SDPA attention, CUDA-synchronised timing; use a bigger model and more tokens, e.g.
    python scripts/bench_decode.py --device cuda --contexts 256,1024,4096 --batches 1,8 \\
        --hidden 2048 --heads 16 --layers 16 --new-tokens 64
    python scripts/bench_decode.py --device cuda --contexts 1024,4096,16384 --batches 1,8 \\
        --hidden 2048 --heads 16 --num-kv-heads 4 --layers 22 --vocab 32000 --new-tokens 32  # ~1B, 16k

Prints a table, then as its last line one JSON object:
kv_bytes_ratio (= G/h exactly), decode_speedup per setting ("ctx{C}_batch{B}"), the bounds
(head_ratio_bound = h/G; bandwidth_bound_speedup and fraction_of_bound per setting), and the
per-setting tokens/s, KV bytes, prefill and time-per-sample seconds (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from fractions import Fraction
from pathlib import Path


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " On a GPU: --device cuda (bf16, SDPA attention).",
        epilog="GPU example: python scripts/bench_decode.py --device cuda --contexts 256,1024,4096 "
        "--batches 1,8 --hidden 2048 --heads 16 --layers 16 --new-tokens 64",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights and cache dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--contexts",
        default="256,1024,4096",
        help="prompt lengths, comma-separated (default: 256,1024,4096; on 2 CPU cores the 4096 × 8 "
        "prefill takes ~30 s, pass 256,1024 for a quick run)",
    )
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated (default: 1,8)")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=8,
        help="greedy tokens generated per sample, at least 2: the prompt's pass gives the first, one "
        "decode step each other one (default: 8)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed samples per model after a warm-up, alternating; medians are reported (default: 3)",
    )
    p.add_argument(
        "--num-kv-heads", "-g", type=int, default=2, metavar="G", help="KV heads after conversion (default: 2)"
    )
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default: 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads h (default: 8)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default: 6)")
    p.add_argument("--intermediate", type=int, help="MLP width (default: 2.75 × hidden)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default: 8192)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default: 1: on a shared machine a second OpenMP thread that gets "
        "preempted stalls every op; use all cores on a quiet one)",
    )
    p.add_argument("--workdir", help="where the two checkpoints go (default: a temporary folder, removed)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keep the output to the table
    import torch

    from uptrain import UptrainError
    from uptrain.speed_checks import parse_device

    torch.set_num_threads(args.threads)
    try:
        device = parse_device(args.device)
    except UptrainError as err:
        raise SystemExit(str(err)) from None
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    contexts, batches = parse_ints(args.contexts), parse_ints(args.batches)
    h, g = args.heads, args.num_kv_heads
    if h % g:
        raise SystemExit(f"--num-kv-heads {g} must divide --heads {h}")

    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        workdir = Path(args.workdir or tmp)
        models = build_models(args, workdir, max(contexts) + args.new_tokens, dtype, device)
        n_params = sum(p.numel() for p in models["mha"].parameters())
        weight_bytes = {name: model_bytes(model) for name, model in models.items()}
        rows = []
        for batch in batches:
            for context in contexts:
                try:
                    row = measure(models, workdir, context, batch, args, dtype, device)
                except UptrainError as err:
                    raise SystemExit(str(err)) from None
                rows.append(with_bound(row, weight_bytes))
                print(f"  measured context {context}, batch {batch}", file=sys.stderr, flush=True)

    for row in rows:
        # Bytes per cached token are 2·layers·kv_heads·head_dim·itemsize, so the ratio is exact.
        assert Fraction(row["gqa_kv_bytes"], row["mha_kv_bytes"]) == Fraction(g, h), row
    print_table(rows, args, device, dtype, n_params)
    result = {
        "device": str(device),
        "dtype": dtype,
        "threads": args.threads,
        "params": n_params,
        "num_heads": h,
        "num_kv_heads": g,
        "layers": args.layers,
        "head_dim": args.hidden // h,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "kv_bytes_ratio": g / h,
        "head_ratio_bound": h / g,
        "weight_bytes": weight_bytes,
        "decode_speedup": {key(r): r["decode_speedup"] for r in rows},
        "bandwidth_bound_speedup": {key(r): r["bandwidth_bound_speedup"] for r in rows},
        "fraction_of_bound": {key(r): r["fraction_of_bound"] for r in rows},
        "settings": rows,
    }
    print(json.dumps(result))
    return 0


def key(row: dict) -> str:
    return f"ctx{row['context']}_batch{row['batch']}"


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def with_bound(row: dict, weight_bytes: dict[str, int]) -> dict:
    """Add the speed-up that reading fewer bytes allows: every decode step reads all weights and
    the whole cache, so (weights + MHA cache) / (weights + GQA cache) bounds it, below h/G."""
    bound = (weight_bytes["mha"] + row["mha_kv_bytes"]) / (weight_bytes["gqa"] + row["gqa_kv_bytes"])
    row["bandwidth_bound_speedup"] = round(bound, 3)
    row["fraction_of_bound"] = round(row["decode_speedup"] / bound, 3)
    return row


def build_models(args, workdir: Path, max_positions: int, dtype: str, device) -> dict:
    """The MHA model with random weights, and the same checkpoint converted by uptrain, loaded
    as `uptrain speed` loads them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from uptrain.convert import convert_checkpoint
    from uptrain.speed import load_model

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(workdir / "mha")
    convert_checkpoint(workdir / "mha", workdir / "gqa", args.num_kv_heads, overwrite=True, progress=False)
    models = {name: load_model(workdir / name, dtype, device) for name in ("mha", "gqa")}
    assert models["gqa"].config.num_key_value_heads == args.num_kv_heads
    return models


def measure(models: dict, workdir: Path, context: int, batch: int, args, dtype: str, device) -> dict:
    """One setting, measured by uptrain.speed with MHA and GQA samples alternating; refused with
    one line (UptrainError) where the cache would not fit in free memory."""
    from uptrain.speed import measure_models
    from uptrain.speed_checks import model_shape

    for name in models:
        model_shape(workdir / name, name).check(context, args.new_tokens, batch, dtype, device)
    measured = measure_models(
        models, context=context, new_tokens=args.new_tokens, batch=batch, repeats=args.repeats, device=device
    )
    row: dict = {"context": context, "batch": batch}
    for name, m in measured.items():
        row[f"{name}_prefill_s"] = round(m["prefill_s"], 4)
        row[f"{name}_time_per_sample_s"] = round(m["time_per_sample_s"], 4)
        row[f"{name}_kv_bytes"] = m["kv_cache_bytes"]
        row[f"{name}_tokens_per_s"] = round(m["decode_tokens_per_s"], 2)
    row["decode_speedup"] = round(row["gqa_tokens_per_s"] / row["mha_tokens_per_s"], 3)
    return row


def print_table(rows: list[dict], args, device, dtype, n_params: int) -> None:
    h, g = args.heads, args.num_kv_heads
    print(
        f"decode: Llama {n_params / 1e6:.1f}M params, {args.layers} layers, h={h} → G={g} KV heads, "
        f"{device} {dtype}, {args.threads} threads, "
        f"median of {args.repeats} samples of {args.new_tokens} new tokens"
    )
    header = (
        f"{'context':>7} {'batch':>5} {'MHA KV MiB':>10} {'GQA KV MiB':>10} {'prefill MHA s':>13} "
        f"{'prefill GQA s':>13} {'MHA tok/s':>9} {'GQA tok/s':>9} {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['context']:>7} {r['batch']:>5} {r['mha_kv_bytes'] / 2**20:>10.1f} {r['gqa_kv_bytes'] / 2**20:>10.1f} "
            f"{r['mha_prefill_s']:>13.3f} {r['gqa_prefill_s']:>13.3f} {r['mha_tokens_per_s']:>9.1f} "
            f"{r['gqa_tokens_per_s']:>9.1f} {r['decode_speedup']:>6.2f}x"
        )
    print(f"KV-cache bytes GQA/MHA = {g}/{h} = {g / h} exactly, in every setting")
    print(
        "bandwidth bound on the speed-up (weights + cache read per step) and the share of it measured: "
        + ", ".join(f"{key(r)} {r['bandwidth_bound_speedup']:.2f}x ({r['fraction_of_bound']:.0%})" for r in rows)
        + f"; h/G = {h / g:g}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
