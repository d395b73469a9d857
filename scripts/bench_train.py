"""Training-loop overhead: uptrain's Accelerate loop vs a bare PyTorch loop, side by side.

    python scripts/bench_train.py                      # CPU: a 7M-parameter Llama, seq 256 × batch 8
    python scripts/bench_train.py --device cuda --hidden 2048 --layers 16 --heads 16 --batch-size 8 --seq-len 2048
    python scripts/bench_train.py --device cuda --hidden 2048 --layers 22 --heads 16 --kv-heads 4 \
        --batch-size 8 --seq-len 2048 --repeats 1        # ~1B parameters (scripts/device_check.sh)

Both loops train the same model (built from a config, same seed) with the same batch, sequence
length, AdamW settings, gradient clipping and thread count. uptrain's loop runs through
`run_training` (data packing, accumulation normalised by target tokens, metrics, no
checkpoints); the bare loop is forward → cross-entropy → backward → clip → step on random
token blocks. Repetitions alternate between the two; each reports the median step time after
warm-up steps. On CUDA both use bf16 autocast and uptrain also reports MFU. uptrain's loop also
reports how long each step waited for its data (its own `perf/data_wait_s`) as a share of the
step; `--streaming` reads the data streamed (tokenized in `--data-workers` DataLoader workers
while the model trains; target < 1%) instead of tokenized up front.

`--compile` also runs uptrain's loop with `compile: true` (each decoder layer torch.compiled in
place, `--compile-backend`, default inductor) in every repetition: its tokens/s beside the eager
loop's, and its first step (which pays for the compilation) apart. `--fused-adamw` is the
loops' optimizer setting (uptrain's `fused_adamw`: auto = fused on CUDA, torch's default on CPU);
the bare loop uses the same. Then AdamW's step alone on the model's parameters, with fixed
gradients, for torch's three implementations (for-loop, foreach, fused), interleaved step by
step so that a loaded machine slows each alike (`--optimizer-steps`, 0 to skip).

Prints a table, then one JSON line with `tokens_per_second_ratio` (uptrain / bare; target ≥
0.97), `data_wait_share`, with --compile `compile_speedup` (compiled / eager uptrain tokens/s),
and `optimizer_step_s` with `fused_vs_foreach` (fused / foreach step time: below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="steps per repetition (default: 12)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of each median (default: 3)")
    p.add_argument("--repeats", type=int, default=2, help="repetitions of each loop, alternating (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default: 1)")
    p.add_argument("--streaming", action="store_true", help="stream the training data (DataLoader workers)")
    p.add_argument("--data-workers", type=int, default=1, help="data workers with --streaming (default: 1)")
    p.add_argument("--compile", action="store_true", help="also time uptrain's loop with compile: true")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument(
        "--fused-adamw", default="auto", choices=["auto", "true", "false"], help="both loops' AdamW (default: auto)"
    )
    p.add_argument(
        "--optimizer-steps", type=int, default=10, help="timed AdamW steps per implementation (default: 10; 0: skip)"
    )
    return p.parse_args(argv)


def build_model(args, folder: Path) -> tuple[Path, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from uptrain.data.corpus import load_tokenizer

    tokenizer = load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(512, args.seq_len),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


def fused_setting(args) -> str | bool:
    return {"auto": "auto", "true": True, "false": False}[args.fused_adamw]


def uptrain_steps(
    args, model: Path, out: Path, compile: bool = False
) -> tuple[list[float], list[float], float | None, float]:
    """Step times and data waits of uptrain's loop (from its own metrics), its MFU where known and
    its first step's time."""
    from uptrain.data.corpus import split_path
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training
    from uptrain.train.metrics import read_metrics

    config = TrainConfig(
        model=str(model),
        train_data=str(split_path("validation")),
        eval_data=str(split_path("validation")),
        output_dir=str(out),
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=1e-3,
        warmup_steps=0,
        max_steps=args.steps,
        eval_every=10**6,
        save_every=10**6,
        eval_blocks=1,
        report_to=["jsonl"],
        overwrite=True,
        mixed_precision="bf16" if args.device == "cuda" else "no",
        streaming=args.streaming,
        data_workers=args.data_workers,
        compile=compile,
        compile_backend=args.compile_backend,
        fused_adamw=fused_setting(args),
    )
    run_training(config)
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "perf/step_time_s" in r]
    mfu = [r["perf/mfu"] for r in steps[args.warmup :] if "perf/mfu" in r]
    timed = steps[args.warmup :]
    waits = [r["perf/data_wait_s"] for r in timed]
    median_mfu = statistics.median(mfu) if mfu else None
    return [r["perf/step_time_s"] for r in timed], waits, median_mfu, steps[0]["perf/step_time_s"]


def param_groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def bare_steps(args, model_dir: Path) -> list[float]:
    from transformers import AutoModelForCausalLM

    from uptrain.train.optimizer import fused_adamw

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(
        param_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=fused_adamw(fused_setting(args), device)
    )
    vocab = model.config.vocab_size
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), device=device)
        start = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


OPTIMIZERS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def optimizer_step_times(args, model_dir: Path) -> dict[str, float]:
    """Median seconds of one AdamW step per implementation, each on its own copy of the
    parameters with the same fixed gradients; the first step (state allocation) left out."""
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    optimizers, times = {}, {}
    for name, kwargs in OPTIMIZERS.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device)
        try:
            optimizers[name] = torch.optim.AdamW(param_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, **kwargs)
        except RuntimeError as err:  # an implementation this torch lacks on this device
            print(f"AdamW {name}: not available here ({str(err).splitlines()[0]})")
        times[name] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(args.optimizer_steps + 1):
        for name, optimizer in optimizers.items():  # interleaved: load changes hit all alike
            sync()
            start = time.perf_counter()
            optimizer.step()
            sync()
            if step:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items() if t}


def main() -> int:
    args = parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    tokens = args.seq_len * args.batch_size
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        model, n_params = build_model(args, Path(tmp) / "model")
        ours, waits, bare, mfus, compiled, compiled_first, compiled_mfus = [], [], [], [], [], [], []
        for i in range(args.repeats):
            steps, waited, mfu, _ = uptrain_steps(args, model, Path(tmp) / f"run{i}")
            ours += steps
            waits += waited
            mfus += [mfu] if mfu is not None else []
            bare += bare_steps(args, model)
            if args.compile:
                steps, _, mfu, first = uptrain_steps(args, model, Path(tmp) / f"compiled{i}", compile=True)
                compiled += steps
                compiled_first.append(first)
                compiled_mfus += [mfu] if mfu is not None else []
        optimizer_s = optimizer_step_times(args, model) if args.optimizer_steps else {}
    ours_tps, bare_tps = tokens / statistics.median(ours), tokens / statistics.median(bare)
    print(
        f"train: Llama {n_params / 1e6:.1f}M params, h={args.heads} kv={args.kv_heads} hidden {args.hidden} × "
        f"{args.layers} layers, "
        f"seq {args.seq_len} × batch {args.batch_size}, {args.device}"
        + (f", {args.threads} threads" if args.device == "cpu" else ", bf16 autocast")
        + (f", streamed data ({args.data_workers} data workers)" if args.streaming else ", data tokenized up front")
        + f", fused_adamw {args.fused_adamw}"
    )
    rows = [("uptrain", ours), ("bare", bare)] + (
        [(f"uptrain+compile ({args.compile_backend})", compiled)] * bool(compiled)
    )
    width = max(len(name) for name, _ in rows)
    print(f"{'loop':<{width}} {'median step s':>14} {'tokens/s':>10} {'steps timed':>12}")
    for name, times in rows:
        median = statistics.median(times)
        print(f"{name:<{width}} {median:>14.4f} {tokens / median:>10,.0f} {len(times):>12}")
    if compiled:
        print(f"compiled first step (with the compilation): {statistics.median(compiled_first):.1f} s")
    if optimizer_s:
        print("AdamW step alone: " + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in optimizer_s.items()))
    wait_share = sum(waits) / sum(ours)
    print(f"uptrain data wait: {wait_share:.2%} of step time (median wait {statistics.median(waits) * 1e3:.2f} ms)")
    result = {
        "tokens_per_second_ratio": ours_tps / bare_tps,
        "data_wait_share": wait_share,
        "streaming": args.streaming,
        "uptrain_tokens_per_second": ours_tps,
        "bare_tokens_per_second": bare_tps,
        "mfu": statistics.median(mfus) if mfus else None,
        "device": args.device,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "params": n_params,
        "fused_adamw": args.fused_adamw,
        "optimizer_step_s": optimizer_s,
        "fused_vs_foreach": optimizer_s["fused"] / optimizer_s["foreach"]
        if {"fused", "foreach"} <= set(optimizer_s)
        else None,
    }
    if compiled:
        compiled_tps = tokens / statistics.median(compiled)
        result.update(
            compile_backend=args.compile_backend,
            compiled_tokens_per_second=compiled_tps,
            compile_speedup=compiled_tps / ours_tps,
            compiled_first_step_s=statistics.median(compiled_first),
            compiled_mfu=statistics.median(compiled_mfus) if compiled_mfus else None,
        )
        print(f"tokens/s ratio compiled/eager uptrain: {result['compile_speedup']:.3f}")
    if result["fused_vs_foreach"] is not None:
        print(f"AdamW step time fused/foreach: {result['fused_vs_foreach']:.3f}")
    print(f"tokens/s ratio uptrain/bare: {result['tokens_per_second_ratio']:.3f} (target ≥ 0.97)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
