"""The `uptrain` command. Each subcommand is a plain function taking the parsed arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys

from uptrain import UptrainError, __version__


def convert(args: argparse.Namespace) -> int:
    import torch

    from uptrain.convert.pipeline import calibrate, execute, prepare
    from uptrain.convert.spec import conversion_spec

    _pin_malloc_mmap_threshold()
    # Transparent huge pages for torch's large CPU buffers: each pooled K/V tensor is a fresh
    # allocation (see above), and faulting it in 4 KiB pages cost 0.2 s per 2 GB converted.
    # Read by torch at its first allocation, which has not happened yet.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    spec = conversion_spec(
        source=args.src, num_kv_heads=args.num_kv_heads, pooling=args.pooling, seed=args.seed,
        grouping=args.grouping, calibration_data=args.calibration_data, calibration_tokens=args.calibration_tokens,
        calibration_device=args.calibration_device, calibration_dtype=args.calibration_dtype, dtype=args.dtype,
        max_shard_size=args.max_shard_size, allow_pickle=args.allow_pickle, source_hash=args.source_hash)
    with prepare(spec, args.out, args.overwrite) as prepared:  # every check, before any work
        calibration = calibrate(prepared)
        # Streaming conversion does little arithmetic per byte; torch's OpenMP threads only stall
        # when the other cores are busy (measured in BENCHMARKS.md).
        torch.set_num_threads(1)
        out = execute(prepared, args.out, args.overwrite, calibration)
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


def _compare_and_report(spec) -> int:
    from uptrain.compare.report import write_report
    from uptrain.compare.study import run_compare

    files = write_report(run_compare(spec), spec.output_dir, spec)
    print(files["markdown"].read_text())
    print("plots:\n" + "\n".join(f"  {path}" for path in files.values() if path.suffix == ".png"))
    return 0


def demo(args: argparse.Namespace) -> int:
    from uptrain.demo import demo_spec, prepare_output

    spec = demo_spec(args.output_dir)
    prepare_output(args.output_dir, args.overwrite)
    return _compare_and_report(spec)


def compare(args: argparse.Namespace) -> int:
    from uptrain.compare.study import CompareSpec
    from uptrain.convert.spec import ConversionOptions, validated

    conversion = validated(ConversionOptions, "compare", grouping=args.grouping,
                           calibration_tokens=args.calibration_tokens, calibration_device=args.calibration_device,
                           calibration_dtype=args.calibration_dtype)
    return _compare_and_report(CompareSpec(
        model=args.model, num_kv_heads=args.num_kv_heads, pooling=args.pooling, train_data=args.train_data,
        eval_data=args.eval_data, output_dir=args.output_dir, max_tokens=args.max_tokens,
        uptrain_fraction=args.uptrain_fraction, pretrain_tokens=args.pretrain_tokens, seq_len=args.seq_len,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps, eval_every=args.eval_every,
        eval_blocks=args.eval_blocks, seed=args.seed, report_to=args.report_to, conversion=conversion))


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
    p.add_argument("--calibration-data", metavar="FILE",
                   help="text/jsonl/parquet file(s) or a datasets name; required by --pooling calibrated")
    _add_grouping_and_calibration(p)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="cast floating-point tensors (default: keep each tensor's dtype)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard, e.g. 5GB or 500MiB (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pytorch_model*.bin checkpoints (with torch.load(weights_only=True))")
    p.add_argument("--source-hash", default="blake3", choices=["blake3", "sha256", "none"],
                   help="digest of each source file recorded in uptrain.json, computed beside the conversion; "
                        "files from the Hub cache also get the Hub's sha256 for free, which sha256 checks "
                        "(default: blake3)")
    p.set_defaults(func=convert)


def _add_grouping_and_calibration(p: argparse.ArgumentParser) -> None:
    """Flags of the conversion's grouping and calibration, shared by convert and compare."""
    p.add_argument("--grouping", default="contiguous", choices=["contiguous", "similarity"],
                   help="which heads share a KV head: contiguous (query head i → KV head i // (h/G)) or "
                        "similarity (renumber heads exactly so that similar K/V heads are grouped; uses the "
                        "calibration data when given) (default: contiguous)")
    p.add_argument("--calibration-tokens", type=int, default=32768,
                   help="tokens of calibration data read by the source model (default: 32768)")
    p.add_argument("--calibration-device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where calibration runs the source model (default: auto, the first GPU when there is one)")
    p.add_argument("--calibration-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of calibration's forward pass; moments are accumulated in float64 (default: float32)")


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


def _add_train(sub, with_arguments: bool = True) -> None:
    p = sub.add_parser("train", help="uptrain a (converted) checkpoint with Accelerate",
                       description="Continue pretraining a checkpoint for a budget of tokens or steps; "
                                   "runs alone or under `accelerate launch -m uptrain train`.")
    if with_arguments:  # its flags come from the pydantic config: 0.16 s of imports other commands skip
        from uptrain.train.cli import add_arguments, train

        add_arguments(p)
        p.set_defaults(func=train)


def _add_compare(sub) -> None:
    from uptrain.corpus import split_path

    p = sub.add_parser("compare", help="compare pooling strategies and KV-head counts, before and after uptraining",
                       description="For every (G, pooling): convert, evaluate at α = 0, uptrain with identical data, "
                                   "seed and budget, evaluate along the way. The MHA model, trained with the same "
                                   "budget, is the reference row. Writes results.csv, results.md and PNG plots; a "
                                   "killed compare resumes where it stopped.")
    p.add_argument("--model", required=True, help="the MHA (or GQA) checkpoint folder")
    p.add_argument("--num-kv-heads", type=int, nargs="+", required=True, metavar="G", help="KV head counts to try")
    p.add_argument("--pooling", nargs="+", default=["mean", "first", "random"],
                   help="strategies to try (default: mean first random; calibrated also works: it is "
                        "calibrated on --train-data)")
    p.add_argument("--train-data", default=str(split_path("train")),
                   help="uptraining text (default: the shipped corpus's train split)")
    p.add_argument("--eval-data", default=str(split_path("validation")),
                   help="evaluation text (default: the shipped corpus's validation split)")
    p.add_argument("--output-dir", required=True, help="runs, results and plots go here")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--uptrain-fraction", type=float, help="α: share of the pretraining tokens (paper: 0.05)")
    budget.add_argument("--max-tokens", type=int, help="uptraining tokens per run")
    p.add_argument("--pretrain-tokens", type=float,
                   help="tokens the model was pretrained on (default: from its card, reference.json)")
    p.add_argument("--seq-len", type=int, default=256, help="default: 256")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per step (default: 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=10, help="default: 10")
    p.add_argument("--eval-every", type=int, default=10, help="evaluate (and checkpoint) every N steps (default: 10)")
    p.add_argument("--eval-blocks", type=int, default=64, help="eval blocks of seq-len tokens (default: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", nargs="+", default=["wandb", "jsonl"], help="wandb jsonl none (default: wandb jsonl)")
    _add_grouping_and_calibration(p)  # calibration reads --train-data
    p.set_defaults(func=compare)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the pooling study on the shipped reference model (about ten minutes on 2 cores)",
                       description="`uptrain compare` on the shipped MHA reference model and corpus: G = 2 and "
                                   "G = 1 with mean, first and random pooling, each uptrained for α = 5%% of the "
                                   "model's pretraining. Prints the table and where the plots are; rerunning picks "
                                   "up finished runs.")
    p.add_argument("--output-dir", default="demo-output", help="runs, results and plots (default: demo-output)")
    p.add_argument("--overwrite", action="store_true", help="discard an earlier demo in the output dir")
    p.set_defaults(func=demo)


def build_parser(command: str | None = "train") -> argparse.ArgumentParser:
    """The full parser; the `train` flags only when `command` is train (or unknown)."""
    parser = argparse.ArgumentParser(prog="uptrain", description="Convert MHA checkpoints to GQA and uptrain them.")
    parser.add_argument("--version", action="version", version=f"uptrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert(sub)
    _add_inspect(sub)
    _add_train(sub, with_arguments=command in ("train", None))
    _add_compare(sub)
    _add_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except UptrainError as err:
        print(f"uptrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the machine, not the input: a full disk, a vanished mount, a permission
        where = f": {err.filename}" if err.filename else ""
        print(f"uptrain {args.command}: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"uptrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
