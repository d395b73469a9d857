"""The `uptrain` command. Each subcommand is a schema of its options (`uptrain.options`) and a
plain function given the validated options; `COMMANDS` pairs them with their help. Every command
reads its flags the same way (`--snake_case` or `--kebab-case`, values checked by the schema,
one-line refusals); `uptrain train` also reads them from a YAML file (`--config`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uptrain import UptrainError, __version__
from uptrain.options import add_schema_arguments, from_args

if TYPE_CHECKING:  # each command imports its own schema, when it runs
    from uptrain.compare.spec import CompareSpec
    from uptrain.convert.spec import ConvertCommand
    from uptrain.data.spec import TokenizeOptions
    from uptrain.demo import DemoOptions
    from uptrain.evaluation.run import EvaluateOptions
    from uptrain.inspect_checkpoint import InspectOptions
    from uptrain.speed import SpeedOptions
    from uptrain.train.config import TrainConfig


def convert(options: ConvertCommand) -> int:
    import torch

    from uptrain.convert.pipeline import calibrate, execute, prepare

    _pin_malloc_mmap_threshold()
    # Transparent huge pages for torch's large CPU buffers: each pooled K/V tensor is a fresh
    # allocation (see above), and faulting it in 4 KiB pages cost 0.2 s per 2 GB converted.
    # Read by torch at its first allocation, which has not happened yet.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if options.target == "mla":
        from uptrain.convert.mla import convert_mla

        print(f"wrote {convert_mla(options.spec(), options.out, options.overwrite)}")
        return 0
    with prepare(options.spec(), options.out, options.overwrite) as prepared:  # every check, before any work
        calibration = calibrate(prepared)
        # Streaming conversion does little arithmetic per byte; torch's OpenMP threads only stall
        # when the other cores are busy (measured in BENCHMARKS.md).
        torch.set_num_threads(1)
        out = execute(prepared, options.out, options.overwrite, calibration)
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


def inspect(options: InspectOptions) -> int:
    from uptrain.inspect_checkpoint import format_report, inspect_checkpoint

    info = inspect_checkpoint(options.src, context=options.context, batch=options.batch, dtype=options.dtype)
    print(json.dumps(info, indent=2) if options.json else format_report(info))
    return 0


def speed(options: SpeedOptions) -> int:
    if options.engine == "vllm":
        return speed_in_vllm(options)
    from uptrain.speed import format_speed_table, measure_speed

    if options.concurrency != "batch":
        raise UptrainError(
            f"--concurrency {options.concurrency} is --engine vllm's (requests at once as its KV cache holds "
            "them); transformers decodes --batch sequences: add --engine vllm or drop --concurrency"
        )
    results = measure_speed(**_measured(options, "kv_cache_gib", "concurrency"))
    print("\n".join(json.dumps(r) for r in results) if options.json else format_speed_table(results))
    return 0


def _measured(options: SpeedOptions, *other_engine_keys: str) -> dict:
    """The options as the engine's measuring function's keywords: all of them, less how to print
    (`json`), the engine's choice, and the keys of the other engine's own."""
    not_measured = ("json", "engine", *other_engine_keys)
    return {name: value for name, value in options.to_dict().items() if name not in not_measured}


def evaluate(options: EvaluateOptions) -> int:
    from uptrain.evaluation.run import evaluate_model, format_result

    result = evaluate_model(options)
    print(json.dumps(result) if options.json else format_result(result))
    return 0


def speed_in_vllm(options: SpeedOptions) -> int:
    from uptrain.speed_vllm import format_vllm_table, measure_vllm_speed

    if options.device != "cpu":
        raise UptrainError("--engine vllm runs where its vLLM build does (CPU or GPU): drop --device")
    results = measure_vllm_speed(**_measured(options, "device"))
    print("\n".join(json.dumps(r) for r in results) if options.json else format_vllm_table(results))
    return 0


def tokenize(options: TokenizeOptions) -> int:
    from uptrain.data.tokenize import tokenize as write_tokens

    print(f"wrote {write_tokens(options)}")
    return 0


def train(config: TrainConfig) -> int:
    from uptrain.train.loop import run_training  # heavy imports only once the config is valid

    run_training(config)
    return 0


def compare(spec: CompareSpec) -> int:
    from uptrain.compare.report import write_report
    from uptrain.compare.study import hold_compare_dir, run_compare

    with hold_compare_dir(spec):  # the report, too, is written under the compare's lock
        files = write_report(run_compare(spec), spec.output_dir, spec)
    print(files["markdown"].read_text())
    print("plots:\n" + "\n".join(f"  {path}" for path in files.values() if path.suffix == ".png"))
    return 0


def demo(options: DemoOptions) -> int:
    from uptrain.demo import demo_spec, prepare_output

    spec = demo_spec(options.output_dir, options.reference)
    prepare_output(spec.output_dir, options.overwrite)
    return compare(spec)


def _convert_schema():
    from uptrain.convert.spec import ConvertCommand

    return ConvertCommand


def _inspect_schema():
    from uptrain.inspect_checkpoint import InspectOptions

    return InspectOptions


def _speed_schema():
    from uptrain.speed import SpeedOptions

    return SpeedOptions


def _evaluate_schema():
    from uptrain.evaluation.run import EvaluateOptions

    return EvaluateOptions


def _compare_schema():
    from uptrain.compare.spec import CompareSpec

    return CompareSpec


def _demo_schema():
    from uptrain.demo import DemoOptions

    return DemoOptions


def _tokenize_schema():
    from uptrain.data.spec import TokenizeOptions

    return TokenizeOptions


def _train_schema():
    from uptrain.train.config import TrainConfig

    return TrainConfig


@dataclass(frozen=True)
class Command:
    """A subcommand: the function that runs it, and its schema. The schema is imported only
    for the command being run, so no command's start-up pays for another's imports."""

    run: Callable[[Any], int]
    schema: Callable[[], type]
    help: str
    description: str
    epilog: str | None = None
    config_file: bool = False  # `--config FILE.yaml` gives the keys, flags override it

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_schema_arguments(parser, self.schema(), self.config_file)

    def options(self, args: argparse.Namespace, name: str) -> Any:
        """The validated options of a parsed command line."""
        return from_args(self.schema(), args, name, config=getattr(args, "config", None))


COMMANDS = {
    "convert": Command(
        convert,
        schema=_convert_schema,
        help="pool K/V heads of a checkpoint into fewer KV heads (MHA → GQA)",
        description="Convert a Hugging Face checkpoint to grouped-query attention with G KV heads (-g; or each "
        "layer its own: --kv-heads-per-layer, --kv-budget), streaming tensor by tensor. Query head i reads KV head "
        "i // (heads / G) (in each layer, that layer's G).",
    ),
    "inspect": Command(
        inspect,
        schema=_inspect_schema,
        help="attention layout and KV-cache size for every valid number of KV heads",
        description="Show a checkpoint's architecture, heads and parameter count, and its KV-cache bytes for the "
        "current layout and every G it can be pooled to.",
    ),
    "speed": Command(
        speed,
        schema=_speed_schema,
        help="inference speed and KV-cache memory of checkpoints, measured side by side",
        description="Time the N-token prompt and M greedy new tokens with the KV cache, for B sequences, of each "
        "checkpoint in turn: prefill_s, decode_s_per_token, time_per_sample_s, decode_tokens_per_s, "
        "and kv_cache_bytes and peak_memory_bytes measured on the run. Give the MHA original and its "
        "conversions together to see what each G buys.",
    ),
    "evaluate": Command(
        evaluate,
        schema=_evaluate_schema,
        help="task scores (WER, BLEU, ROUGE, QA F1, lm-eval tasks) of a checkpoint, with its predictions",
        description="Score a checkpoint on a task with the field's metric libraries (pip install 'uptrain[eval]'): "
        "greedy generation with the KV cache on local JSON-lines pairs (the `pairs` / `speech_pairs` formats "
        "`uptrain train` reads), or an lm-evaluation-harness task on the loaded model. Prints the scores and the "
        "time per sample; --json adds every prediction, --output-dir writes scores.json and predictions.jsonl.",
        epilog="Examples: uptrain evaluate gqa-model --task translation --data test.jsonl; "
        "uptrain evaluate gqa-model --task lm-eval:my_task.yaml --json",
    ),
    "tokenize": Command(
        tokenize,
        schema=_tokenize_schema,
        help="tokenize and pack text once into memory-mapped token shards that train_data reads",
        description="Tokenize text with a model's tokenizer and pack it into seq_len blocks exactly as "
        "`uptrain train` would, into token shards with their provenance (tokens.json). Give OUT as "
        "train_data or eval_data: training then reads token ids only. A killed run continues where it stopped.",
    ),
    "train": Command(
        train,
        schema=_train_schema,
        config_file=True,
        help="uptrain a (converted) checkpoint with Accelerate",
        description="Continue pretraining a checkpoint for a budget of tokens or steps; runs alone or under "
        "`accelerate launch -m uptrain train`.",
        epilog="Several processes: accelerate launch [options] -m uptrain train --config FILE.yaml",
    ),
    "compare": Command(
        compare,
        schema=_compare_schema,
        help="compare pooling strategies, KV-head counts and KV budgets (GQA and MLA), before and after uptraining",
        description="For every (G, pooling), every (KV budget, allocation, pooling) and, with --target mla, every "
        "(KV budget, MLA init): convert, evaluate at α = 0, "
        "uptrain with identical data, seed and budget, evaluate along the way. The MHA model, trained with the "
        "same budget, is the reference row. Writes results.csv, results.md and PNG plots; a killed compare "
        "resumes where it stopped.",
    ),
    "demo": Command(
        demo,
        schema=_demo_schema,
        help="the pooling study on the shipped reference model (about ten minutes on 2 cores)",
        description="`uptrain compare` on the shipped MHA reference model and corpus: G = 2 and G = 1 with mean, "
        "first and random pooling, each uptrained for α = 5% of the model's pretraining. Prints the "
        "table and where the plots are; rerunning picks up finished runs.",
    ),
}


def build_parser(command: str | None = "train") -> argparse.ArgumentParser:
    """The full parser, with the flags of `command` only: each command's start-up pays for its
    own schema alone (`uptrain convert` never imports a train module)."""
    parser = argparse.ArgumentParser(prog="uptrain", description="Convert MHA checkpoints to GQA and uptrain them.")
    parser.add_argument("--version", action="version", version=f"uptrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, spec in COMMANDS.items():
        p = sub.add_parser(name, help=spec.help, description=spec.description, epilog=spec.epilog)
        if name == command:
            spec.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    # transformers 5.25 asks the `kernels` package for hub flash-attention kernels as it sets a
    # model up, which offline (HF_HUB_OFFLINE, as here) warns once per kernel: noise on stderr
    # before any one-line error, about kernels a CPU run never uses. Its errors still show.
    logging.getLogger("kernels").setLevel(logging.ERROR)
    try:
        return COMMANDS[args.command].run(COMMANDS[args.command].options(args, args.command))
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
