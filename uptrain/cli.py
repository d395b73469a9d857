"""The `uptrain` command. Each subcommand is a plain function taking the parsed arguments."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from uptrain import UptrainError, __version__


def convert(args: argparse.Namespace) -> int:
    from uptrain.convert import convert_checkpoint

    from uptrain.convert.run import resolve_source
    from uptrain.fsutil import check_output_path

    _pin_malloc_mmap_threshold()
    calibration = calibration_info = None
    if args.calibration_data:
        from uptrain.calibration import collect_attention_moments

        check_output_path(Path(args.out).absolute(), args.overwrite)  # before minutes of calibration
        folder, _ = resolve_source(args.src)
        calibration, calibration_info = collect_attention_moments(folder, args.calibration_data,
                                                                  num_tokens=args.calibration_tokens)
    out = convert_checkpoint(args.src, args.out, args.num_kv_heads, pooling=args.pooling, seed=args.seed,
                             dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                             allow_pickle=args.allow_pickle, grouping=args.grouping, calibration=calibration,
                             calibration_info=calibration_info)
    print(f"wrote {out}")
    return 0


def _pin_malloc_mmap_threshold() -> None:
    """Make glibc return every freed tensor buffer to the OS at once.

    After each large free glibc raises its mmap threshold, so later tensors come from the heap
    and the resident size drifts upward with the number of tensors converted. Pinning the
    threshold keeps conversion's peak memory at one tensor's worth. Only for the dedicated
    `convert` process: a training process would pay page faults on every activation.
    """
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    if sys.platform.startswith("linux") and libc_name:
        try:
            ctypes.CDLL(libc_name).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):  # not glibc (musl): nothing to pin
            pass


def inspect(args: argparse.Namespace) -> int:
    from uptrain.inspect_checkpoint import format_report, inspect_checkpoint

    info = inspect_checkpoint(args.src, context=args.context, batch=args.batch, dtype=args.dtype)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def demo(args: argparse.Namespace) -> int:
    from uptrain.demo import format_rows, run_demo

    print(format_rows(run_demo(args.output_dir, overwrite=args.overwrite)))
    print("Random weights: the Δ logit column shows how far pooling moves an untrained model. "
          "G = 8 is the identity.")
    return 0


def _add_convert(sub) -> None:
    from uptrain.convert.pooling import STRATEGIES

    p = sub.add_parser("convert", help="pool K/V heads of a checkpoint into fewer KV heads (MHA → GQA)",
                       description="Convert a Hugging Face checkpoint to grouped-query attention with G KV heads, "
                                   "streaming tensor by tensor. Query head i reads KV head i // (heads / G).")
    p.add_argument("src", help="checkpoint folder (safetensors, single or sharded) or a Hub id")
    p.add_argument("out", help="output folder; written to a temporary sibling and renamed when complete")
    p.add_argument("--num-kv-heads", "-g", type=int, required=True, metavar="G",
                   help="KV heads after conversion; must divide the attention heads and the current KV heads")
    p.add_argument("--pooling", default="mean", choices=sorted(STRATEGIES),
                   help="how each group's heads become one: " + "; ".join(
                       f"{s.name}: {s.reference}" for s in STRATEGIES.values()) + " (default: mean)")
    p.add_argument("--seed", type=int, default=0, help="seed for --pooling random (default: 0)")
    p.add_argument("--grouping", default="contiguous", choices=["contiguous", "similarity"],
                   help="which heads share a KV head: contiguous (query head i → KV head i // (h/G)) or "
                        "similarity (renumber heads exactly so that similar K/V heads are grouped; uses the "
                        "calibration data when given) (default: contiguous)")
    p.add_argument("--calibration-data", metavar="FILE",
                   help="text/jsonl/parquet file(s) or a datasets name; required by --pooling calibrated")
    p.add_argument("--calibration-tokens", type=int, default=32768,
                   help="tokens of calibration data read by the source model (default: 32768)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="cast floating-point tensors (default: keep each tensor's dtype)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard, e.g. 5GB or 500MiB (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pytorch_model*.bin checkpoints (with torch.load(weights_only=True))")
    p.set_defaults(func=convert)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="attention layout and KV-cache size for every valid number of KV heads",
                       description="Show a checkpoint's architecture, heads and parameter count, and its KV-cache "
                                   "bytes for the current layout and every G it can be pooled to.")
    p.add_argument("src", help="checkpoint folder or Hub id")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default: 1)")
    p.add_argument("--dtype", help="cache dtype (default: the checkpoint's dtype)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=inspect)


def _add_train(sub) -> None:
    from uptrain.train.cli import add_arguments, train

    p = sub.add_parser("train", help="uptrain a (converted) checkpoint with Accelerate",
                       description="Continue pretraining a checkpoint for a budget of tokens or steps; "
                                   "runs alone or under `accelerate launch -m uptrain train`.")
    add_arguments(p)
    p.set_defaults(func=train)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="build a small MHA checkpoint and convert it to every number of KV heads",
                       description="Build a small random-weight MHA Llama, convert it to each valid G with mean "
                                   "pooling, load every result with transformers and show its KV cache.")
    p.add_argument("--output-dir", default="demo-output", help="where checkpoints go (default: demo-output)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dir")
    p.set_defaults(func=demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uptrain", description="Convert MHA checkpoints to GQA and uptrain them.")
    parser.add_argument("--version", action="version", version=f"uptrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_convert, _add_inspect, _add_train, _add_demo):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UptrainError as err:
        print(f"uptrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"uptrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
