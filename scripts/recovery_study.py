"""The recovery study: how many uptraining tokens each start needs, on the shipped reference Llama.

    python scripts/recovery_study.py                       # the demo's settings at α = 5%, every 2 steps
    python scripts/recovery_study.py --fraction 0.02       # a smaller budget where time is short
    python scripts/recovery_study.py --quick               # tiny settings, G = 1 only (the test's)

On the decoder-only reference model (`uptrain demo`'s, `uptrain.demo.REFERENCE`) this converts to
G = 2 and G = 1 with mean and calibrated pooling and uptrains each with `uptrain compare`'s own
machinery (`run_compare`, the demo's settings, the MHA model trained alike as its reference row);
then it uptrains each calibrated conversion once more with distillation from the MHA original
(train's `teacher` key), with the same `TrainConfig` the compare gave its run. Every run evaluates
its held-out loss every `--eval-every` steps, so each curve is loss against tokens seen.

Two targets per G, read from those curves:
- mean's α quality: mean pooling's held-out loss at the end of the α budget (its last evaluation);
- MHA + 0.05: the MHA model trained alike, its loss at the end of the same budget, plus 0.05 nats.
For each run the table gives the first evaluated token count at which its loss is at or below each
target, or "not reached within N tokens" (N: the budget). Resolution is one evaluation interval.

Prints the table, then one JSON line: the settings, the targets and every run's curve and result.
A rerun with the same settings picks up finished runs (compare's resume; a distillation run's
`result.json`). `--plot` also writes recovery.png (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from uptrain.checkpoint.atomic import write_file
from uptrain.compare.study import RESULT, run_compare
from uptrain.demo import REFERENCE, demo_spec

MHA_MARGIN = 0.05  # nats: "within 0.05 of MHA trained alike"
POOLINGS = ("mean", "calibrated")
# --quick: G = 1 only, blocks of 32 tokens, 2 per step, 4 held-out blocks, a budget of five steps.
QUICK = dict(seq_len=32, batch_size=2, eval_blocks=4, warmup_steps=1, calibration_tokens=512)
QUICK_FRACTION, QUICK_EVAL_EVERY, QUICK_KV_HEADS = 0.0001, 2, [1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--output-dir", default="recovery-study", help="runs and results (default: recovery-study)")
    parser.add_argument(
        "--fraction", type=float, default=None, help="α: the uptraining budget as a share of pretraining (default 0.05)"
    )
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every K steps (default 2)")
    parser.add_argument(
        "--kv-heads", type=int, nargs="+", default=None, metavar="G", help="KV head counts (default 2 1; --quick: 1)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny settings for a test: G = 1, blocks of 32 tokens, a five-step budget"
    )
    parser.add_argument("--plot", action="store_true", help="also write recovery.png (loss against tokens)")
    parser.add_argument("--overwrite", action="store_true", help="discard an earlier study in --output-dir")
    args = parser.parse_args(argv)
    args.fraction = args.fraction or (QUICK_FRACTION if args.quick else 0.05)
    args.eval_every = args.eval_every or (QUICK_EVAL_EVERY if args.quick else 2)
    args.kv_heads = args.kv_heads or (QUICK_KV_HEADS if args.quick else [2, 1])
    if not 0 < args.fraction <= 1 or args.eval_every < 1:
        parser.error("--fraction must be in (0, 1] and --eval-every at least 1")
    return args


def study_spec(args: argparse.Namespace):
    """The demo's comparison, narrowed to this study: mean and calibrated pooling, α = --fraction,
    evaluated every --eval-every steps, no speed measurement (this study is about loss)."""
    root = Path(args.output_dir).absolute()
    spec = demo_spec(root / "compare")
    return dataclasses.replace(
        spec,
        num_kv_heads=list(args.kv_heads),
        pooling=list(POOLINGS),
        uptrain_fraction=args.fraction,
        eval_every=args.eval_every,
        speed_repeats=0,
        overwrite=args.overwrite,
        **(QUICK if args.quick else {}),
    )


def distilled_run(spec, g: int, log) -> dict:
    """G's calibrated conversion uptrained as the compare trained its run, plus distillation from
    the MHA original (`teacher`); its curve (tokens seen, held-out loss), picked up when finished."""
    from uptrain.train.loop import run_training
    from uptrain.train.metrics import read_metrics

    name = f"g{g}-calibrated-distill"
    root = Path(spec.output_dir).parent / "distill" / name
    if (root / RESULT).exists():
        log(f"[recovery] {name}: finished earlier, reusing {root / RESULT}")
        return json.loads((root / RESULT).read_text())
    log(f"[recovery] {name}: G = {g}, calibrated pooling, distilled from {spec.model}")
    model = Path(spec.output_dir) / "converted" / f"g{g}-calibrated"
    config = dataclasses.replace(spec.train_config(model, root / "train", name), teacher=str(spec.model))
    run_training(config)
    records = read_metrics(root / "train" / "metrics.jsonl")
    curve = [[r["train/tokens_seen"], r["eval/loss"]] for r in records if "eval/loss" in r]
    result = {"name": name, "num_kv_heads": g, "pooling": "calibrated", "distillation": True, "curve": curve}
    write_file(root / RESULT, json.dumps(result) + "\n")  # whole or not at all
    return result


def first_reaching(curve: list, target: float) -> dict:
    """The first evaluation at or below `target`: its tokens and loss (None: not reached)."""
    for tokens, loss in curve:
        if loss <= target:
            return {"target": target, "tokens": tokens, "loss": loss}
    return {"target": target, "tokens": None, "loss": None}


def analyse(runs: list[dict], fraction: float, pretrain_tokens: float) -> dict:
    """The targets per G and, for each run, the tokens to reach each (see the module's docstring)."""
    mha = next(r for r in runs if r["num_kv_heads"] is None)
    mha_target = mha["curve"][-1][1] + MHA_MARGIN
    mean_target = {r["num_kv_heads"]: r["curve"][-1][1] for r in runs if r["pooling"] == "mean"}
    for run in runs:
        run["loss_before"], run["loss_after"] = run["curve"][0][1], run["curve"][-1][1]
        run["to_mha"] = first_reaching(run["curve"], mha_target)
        g = run["num_kv_heads"]
        run["to_mean"] = first_reaching(run["curve"], mean_target[g]) if g is not None else None
    return {
        "model": str(REFERENCE),
        "fraction": fraction,
        "pretrain_tokens": pretrain_tokens,
        "budget_tokens": mha["curve"][-1][0],
        "mha_margin": MHA_MARGIN,
        "targets": {"mha": mha_target, "mean": {str(g): t for g, t in mean_target.items()}},
        "runs": runs,
    }


def reached(result: dict | None, budget: int, pretrain_tokens: float) -> str:
    if result is None:
        return "—"
    if result["tokens"] is None:
        return f"not reached within {budget:,}"
    return f"{result['tokens']:,} (α = {100 * result['tokens'] / pretrain_tokens:.2g}%)"


def print_table(study: dict) -> None:
    budget, pretrain = study["budget_tokens"], study["pretrain_tokens"]
    print(f"recovery study: {study['model']}, α = {100 * study['fraction']:g}% = {budget:,} tokens")
    header = ("run", "loss α=0", "loss end", "tokens to mean's α quality", f"tokens to MHA + {MHA_MARGIN}")
    rows = [
        (
            r["name"],
            f"{r['loss_before']:.3f}",
            f"{r['loss_after']:.3f}",
            reached(r["to_mean"], budget, pretrain),
            reached(r["to_mha"], budget, pretrain),
        )
        for r in study["runs"]
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    means = ", ".join(f"G = {g}: {t:.3f}" for g, t in study["targets"]["mean"].items())
    print(f"targets: mean's α quality {means}; MHA + {MHA_MARGIN}: {study['targets']['mha']:.3f}")


def plot(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in study["runs"]:
        tokens, losses = zip(*run["curve"][1:]) if len(run["curve"]) > 1 else zip(*run["curve"])
        ax.plot(tokens, losses, marker=".", label=run["name"])
    ax.axhline(study["targets"]["mha"], color="grey", linestyle=":", label=f"MHA + {MHA_MARGIN}")
    ax.set(xlabel="uptraining tokens", ylabel="held-out loss (nats)", title="recovery after conversion")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    spec = study_spec(args)
    runs = [
        {
            "name": r.name,
            "num_kv_heads": None if r.pooling == "mha" else r.num_kv_heads,
            "pooling": r.pooling,
            "distillation": False,
            "curve": [list(p) for p in r.curve],
        }
        for r in run_compare(spec, log)
    ]
    for g in spec.num_kv_heads:
        runs.append(distilled_run(spec, g, log))
    study = analyse(runs, args.fraction, spec.pretrain_tokens)
    study["settings"] = {
        k: getattr(spec, k) for k in ("seq_len", "batch_size", "lr", "warmup_steps", "eval_every", "eval_blocks")
    }
    print_table(study)
    if args.plot:
        plot(study, Path(args.output_dir) / "recovery.png")
    print(json.dumps(study))


if __name__ == "__main__":
    from uptrain import UptrainError

    try:
        main()
    except UptrainError as err:
        sys.exit(f"error: {err}")
