"""Streamed training data: tokens/s per process and per data worker, the training loop's wait
for data, and the cost of a resume at step 10 vs step 10^4, side by side.

    python scripts/bench_data.py                       # CPU: the shipped corpus as 8 files, seq 128
    python scripts/bench_data.py --processes 8 --workers 2 --resume-steps 10 10000

Data: the shipped corpus (uptrain/assets/corpus/train.jsonl.gz), its works cut into paragraphs
(the documents) and dealt round-robin into `--files` jsonl files, tokenized with the shipped
tokenizer. Measured:

* tokens/s: this process's share (rank 0 of `--processes`) read through `StreamedTrainBlocks`
  as fast as it is asked, with `--workers` DataLoader workers: `--read-tokens` delivered, timed
  from the first micro-batch (the first window is start-up; every later one is tokenized while
  the one before is consumed), per process and per worker. Beside it, what the previous design
  delivered to each process: the whole stream tokenized on the training thread, of which each
  process kept 1/processes.
* wait: a tiny `uptrain train` run on streamed data; the loop's own `perf/data_wait_s` as a
  share of `perf/step_time_s` (median over the steps after the first; target < 1%).
* resume: positions saved at each of `--resume-steps`; for each, a fresh `StreamedTrainBlocks`
  restored from it until its first micro-batch is in hand (workers started, at most one
  window re-read), `--repeats` times alternating, median; a fresh start (step 0) beside them.
  Also what replaying the consumed blocks (the previous resume) costs at the measured
  whole-stream rate.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=8, help="jsonl files the corpus is dealt into (default: 8)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2, help="blocks per micro-batch (default: 2)")
    p.add_argument("--processes", type=int, default=2, help="processes the data is split over (default: 2)")
    p.add_argument("--workers", type=int, default=1, help="data workers per process (default: 1)")
    p.add_argument("--window-tokens", type=int, default=None, help="shuffle window (default: WINDOW_TOKENS)")
    p.add_argument("--read-tokens", type=int, default=2_000_000, help="tokens read for tokens/s (default: 2M)")
    p.add_argument("--resume-steps", type=int, nargs="+", default=[10, 10_000])
    p.add_argument("--repeats", type=int, default=3, help="resumes timed per step, alternating (default: 3)")
    p.add_argument("--train-steps", type=int, default=12, help="steps of the tiny training run (default: 12)")
    return p.parse_args(argv)


def write_corpus(folder: Path, files: int) -> list[str]:
    from uptrain.data.corpus import read_documents

    outs = [open(folder / f"part{i:02d}.jsonl", "w") for i in range(files)]
    n = 0
    for work in read_documents("train"):
        for paragraph in work["text"].split("\n\n"):
            if paragraph.strip():
                outs[n % files].write(json.dumps({"text": paragraph}) + "\n")
                n += 1
    for f in outs:
        f.close()
    return [f.name for f in outs]


def load_stream(paths: list[str], seq_len: int):
    from uptrain.data.corpus import load_tokenizer
    from uptrain.data.text import load_blocks

    tokenizer = load_tokenizer()
    stream, _ = load_blocks(paths, "train_data", tokenizer, seq_len, "text", "train", None, "paragraph", True, None)
    return stream


def make_blocks(args, stream):
    from uptrain.data.batches import WINDOW_TOKENS, StreamedTrainBlocks

    window = args.window_tokens or WINDOW_TOKENS
    return StreamedTrainBlocks(stream, 0, args.batch_size, 1, args.processes, 0, args.workers, window)


def share_rate(args, stream) -> float:
    """Tokens/s delivered to rank 0 after its first micro-batch (worker start-up, first window)."""
    blocks = make_blocks(args, stream)
    blocks.micro_batches(0, 0)
    steps = max(1, args.read_tokens // (args.batch_size * args.seq_len))
    start = time.perf_counter()
    for step in range(1, steps + 1):
        blocks.micro_batches(step, 0)
    return steps * args.batch_size * args.seq_len / (time.perf_counter() - start)


def whole_stream_rate(stream, blocks_wanted: int) -> float:
    """Tokens/s of the whole stream tokenized on this thread (the previous design, per process)."""
    start, n = time.perf_counter(), 0
    for _ in zip(range(blocks_wanted), stream, strict=False):
        n += 1
    return n * stream.seq_len / (time.perf_counter() - start)


def resume_costs(args, stream) -> dict[int, float]:
    """Median seconds from a saved position to the first micro-batch in hand, per step (0: a fresh start)."""
    blocks, states, step = make_blocks(args, stream), {0: None}, 0
    for target in sorted(args.resume_steps):
        while step < target:
            blocks.micro_batches(step, 0)
            step += 1
        states[target] = json.loads(json.dumps(blocks.state_dict()))
    del blocks
    times: dict[int, list[float]] = {s: [] for s in states}
    for _ in range(args.repeats):
        for target, state in states.items():
            start = time.perf_counter()
            resumed = make_blocks(args, stream)
            if state is not None:
                resumed.load_state_dict(state)
            resumed.micro_batches(target, 0)
            times[target].append(time.perf_counter() - start)
            del resumed  # its worker stops before the next one is timed
    return {s: statistics.median(t) for s, t in times.items()}


def training_wait(args, paths: list[str], folder: Path) -> tuple[float, float]:
    """Median data wait and step time of a tiny streamed `uptrain train` run (its own metrics)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from uptrain.data.corpus import load_tokenizer
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training
    from uptrain.train.metrics import read_metrics

    tokenizer = load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(512, args.seq_len),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    run_training(
        TrainConfig(
            model=str(folder / "model"),
            train_data=paths,
            eval_data=paths[0],
            streaming=True,
            data_workers=args.workers,
            output_dir=str(folder / "run"),
            seq_len=args.seq_len,
            batch_size=8,
            lr=1e-3,
            max_steps=args.train_steps,
            eval_every=10**6,
            save_every=10**6,
            eval_blocks=1,
            report_to=["jsonl"],
        )
    )
    steps = [r for r in read_metrics(folder / "run" / "metrics.jsonl") if "perf/data_wait_s" in r][1:]
    return statistics.median(r["perf/data_wait_s"] for r in steps), statistics.median(
        r["perf/step_time_s"] for r in steps
    )


def main() -> int:
    from uptrain.data.batches import WINDOW_TOKENS

    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        paths = write_corpus(Path(tmp), args.files)
        stream = load_stream(paths, args.seq_len)
        steady = share_rate(args, stream)
        whole = whole_stream_rate(stream, max(1, args.read_tokens // args.seq_len))
        costs = resume_costs(args, stream)
        wait, step_time = training_wait(args, paths, Path(tmp))
    first, last = min(args.resume_steps), max(args.resume_steps)
    replay = {s: s * args.batch_size * args.processes * args.seq_len / whole for s in costs}
    print(
        f"data: shipped corpus in {args.files} jsonl files, seq {args.seq_len}, micro-batch {args.batch_size}, "
        f"{args.processes} processes × {args.workers} data workers (rank 0 measured)"
    )
    print(f"{'measure':<44} {'value':>14}")
    print(f"{'tokens/s to this process (steady)':<44} {steady:>14,.0f}")
    print(f"{'tokens/s per data worker':<44} {steady / args.workers:>14,.0f}")
    print(f"{'previous: whole stream on the training thread':<44} {whole:>14,.0f}")
    print(f"{'previous: kept by each process (÷ processes)':<44} {whole / args.processes:>14,.0f}")
    print(f"{'training: data wait / step time':<44} {wait / step_time:>14.2%}")
    print(f"{'fresh start: s to first micro-batch':<44} {costs[0]:>14.3f}")
    for s in sorted(args.resume_steps):
        print(f"{f'resume at step {s}: s to first micro-batch':<44} {costs[s]:>14.3f}")
        print(f"{f'  previous (replay {s} steps), s':<44} {replay[s]:>14.3f}")
    result = {
        "tokens_per_second_per_process": steady,
        "tokens_per_second_per_worker": steady / args.workers,
        "previous_tokens_per_second_per_process": whole / args.processes,
        "data_wait_share": wait / step_time,
        "data_wait_s": wait,
        "step_time_s": step_time,
        "resume_seconds": {str(s): c for s, c in costs.items()},
        "resume_ratio_last_vs_first": costs[last] / costs[first],
        "previous_replay_seconds": {str(s): r for s, r in replay.items() if s},
        "window_tokens": args.window_tokens or WINDOW_TOKENS,
        "processes": args.processes,
        "workers": args.workers,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
    }
    print(
        f"resume at step {last} / step {first}: {result['resume_ratio_last_vs_first']:.2f} (target ≈ 1); "
        f"data wait {result['data_wait_share']:.2%} of a step (target < 1%)"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
