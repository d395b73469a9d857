"""The recovery study: how many uptraining tokens each start needs, on a shipped reference model.

    python scripts/recovery_study.py --plot                      # the Llama at α = 5%, every 2 steps
    python scripts/recovery_study.py --reference t5 --plot       # the T5 at α = 5%, every step
    python scripts/recovery_study.py --fraction 0.02             # a smaller budget where time is short
    python scripts/recovery_study.py --quick                     # tiny settings, G = 1 only (the test's)

On the reference model (`--reference llama`: `uptrain demo`'s decoder-only model; `t5`: the
shipped T5 v1.1, converted in its decoder's self- and cross-attention and uptrained with its own
span corruption, as `uptrain demo --reference t5` does) this converts to G = 2 and G = 1 with mean
and calibrated pooling and uptrains each with `uptrain compare`'s own machinery (`run_compare`,
the demo's settings, the MHA model trained alike as its reference row); then it uptrains each
calibrated conversion once more with distillation from the MHA original (train's `teacher` key),
with the same `TrainConfig` the compare gave its run. Every run evaluates its held-out loss every
`--eval-every` steps, so each curve is loss against tokens seen.

Two targets per G, read from those curves:
- mean's α quality: mean pooling's held-out loss at the end of the α budget (its last evaluation);
- MHA + 0.05: the MHA model trained alike, its loss at the end of the same budget, plus 0.05 nats.
For each run the table gives the first evaluated token count at which its loss is at or below each
target, or "not reached within N tokens" (N: the budget). Resolution is one evaluation interval.

Task metrics beside the loss (the paper's Table 1 view): the reference models ship with no task
data, so the script writes its own from the corpus' test split (text no run trained on; seeded,
`--task-examples` per task, into `--output-dir`/task-data) and scores every run's start (α = 0)
and its uptrained checkpoint with `uptrain evaluate --task qa` (greedy generation with the KV
cache, SQuAD's exact match and F1, no extra library), timing the generation per sample:
- Llama: `next-word`, the word after 96 tokens of text (a whole one-token word, not "the" or
  "and"; one generated token, exact match), and `continuation`, the 24 tokens after 128 (24
  generated tokens, token F1 against the true text);
- T5: `infill-word`, one such word replaced by `<extra_id_0>` with 64 tokens either side, as span
  corruption writes it (two generated tokens: the sentinel, the word; exact match).

Prints the table, the task table, then one JSON line: the settings, the targets and every run's
curve, result and task scores. A rerun with the same settings picks up finished runs (compare's
resume; a distillation run's `result.json`) and task scores (each kept with its setting in
`--output-dir`/tasks). `--plot` also writes recovery.png (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
from pathlib import Path

from uptrain.checkpoint.atomic import write_file
from uptrain.compare.study import RESULT, run_compare
from uptrain.demo import REFERENCES, demo_spec

MHA_MARGIN = 0.05  # nats: "within 0.05 of MHA trained alike"
POOLINGS = ("mean", "calibrated")
EVAL_EVERY = {"llama": 2, "t5": 1}  # T5's α = 5% is 8 steps: every step
# --quick: G = 1 only, blocks of 32 tokens, 2 per step, 4 held-out blocks, a budget of five steps
# (T5's pretraining is 18× shorter than the Llama's, hence its fraction), 4 examples per task.
QUICK = dict(seq_len=32, batch_size=2, eval_blocks=4, warmup_steps=1, calibration_tokens=512)
QUICK_FRACTION, QUICK_EVAL_EVERY, QUICK_KV_HEADS = {"llama": 0.0001, "t5": 0.0019}, 2, [1]
QUICK_TASK_EXAMPLES = 4


@dataclasses.dataclass(frozen=True)
class StudyTask:
    """A task built from the corpus' test split and scored by `uptrain evaluate --task qa`
    (SQuAD's exact match and F1 of the generation against the held-out text)."""

    slug: str
    what: str
    metric: str  # the score the table shows: exact_match or f1
    max_new_tokens: int
    context: int  # tokens of text before the answer (T5's infilling: also after it)


# The tasks per reference model; every answer is text the model never trained on (the test split).
STUDY_TASKS = {
    "llama": (
        StudyTask("next-word", "the next word after 96 tokens (a one-token word, no article)", "exact_match", 1, 96),
        StudyTask("continuation", "the next 24 tokens after 128, greedily (token F1)", "f1", 24, 128),
    ),
    "t5": (StudyTask("infill-word", "one word replaced by <extra_id_0>, 64 tokens either side", "exact_match", 2, 64),),
}
TASK_SEED = 1234
WORD = re.compile(r"^ [A-Za-z]{3,}$")  # a whole word with its leading space, as the tokenizer splits text


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--output-dir", default="recovery-study", help="runs and results (default: recovery-study)")
    parser.add_argument(
        "--reference", choices=tuple(REFERENCES), default="llama", help="the shipped reference model (default llama)"
    )
    parser.add_argument(
        "--fraction", type=float, default=None, help="α: the uptraining budget as a share of pretraining (default 0.05)"
    )
    parser.add_argument(
        "--eval-every", type=int, default=None, help="evaluate every K steps (default: llama 2, t5 1; --quick 2)"
    )
    parser.add_argument(
        "--kv-heads", type=int, nargs="+", default=None, metavar="G", help="KV head counts (default 2 1; --quick: 1)"
    )
    parser.add_argument(
        "--task-examples", type=int, default=None, help="examples per task (default 64; --quick 4; 0: no tasks)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny settings for a test: G = 1, blocks of 32 tokens, a five-step budget"
    )
    parser.add_argument("--plot", action="store_true", help="also write recovery.png (loss against tokens)")
    parser.add_argument("--overwrite", action="store_true", help="discard an earlier study in --output-dir")
    args = parser.parse_args(argv)
    args.fraction = args.fraction or (QUICK_FRACTION[args.reference] if args.quick else 0.05)
    args.eval_every = args.eval_every or (QUICK_EVAL_EVERY if args.quick else EVAL_EVERY[args.reference])
    args.kv_heads = args.kv_heads or (QUICK_KV_HEADS if args.quick else [2, 1])
    if args.task_examples is None:
        args.task_examples = QUICK_TASK_EXAMPLES if args.quick else 64
    if not 0 < args.fraction <= 1 or args.eval_every < 1 or args.task_examples < 0:
        parser.error("--fraction must be in (0, 1], --eval-every at least 1 and --task-examples at least 0")
    return args


def study_spec(args: argparse.Namespace):
    """The demo's comparison of --reference, narrowed to this study: mean and calibrated pooling,
    α = --fraction, evaluated every --eval-every steps, no speed measurement (the tasks time their
    generation)."""
    root = Path(args.output_dir).absolute()
    spec = demo_spec(root / "compare", args.reference)
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


def task_data(task: StudyTask, tokenizer, count: int, folder: Path) -> Path:
    """`count` examples of `task` from the corpus' test split as `qa` pairs (jsonl `source` /
    `target`) in `folder`, the same for the same tokenizer, task and count (seeded)."""
    from uptrain.data.corpus import read_documents

    streams = [tokenizer(doc["text"], add_special_tokens=False)["input_ids"] for doc in read_documents("test")]
    rng, seen, lines = random.Random(f"{TASK_SEED}-{task.slug}"), set(), []
    for _ in range(100 * count):  # positions are drawn until `count` fit
        if len(lines) == count:
            break
        doc = rng.choices(range(len(streams)), weights=[len(ids) for ids in streams])[0]  # uniform over tokens
        ids = streams[doc]
        at = rng.randrange(task.context, len(ids) - max(task.context, task.max_new_tokens) - 1)
        if (doc, at) in seen or (example := _example(task, tokenizer, ids, at)) is None:
            continue
        seen.add((doc, at))
        lines.append(json.dumps(dict(zip(("source", "target"), example))) + "\n")
    path = folder / f"{task.slug}.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    write_file(path, "".join(lines))
    return path


def _example(task: StudyTask, tokenizer, ids: list[int], at: int) -> tuple[str, str] | None:
    """The (source, answer) of `task` at token `at` of a text, or None where none fits there: a
    word task needs a whole one-token word at `at`; a continuation starts at a word."""
    word = tokenizer.decode(ids[at : at + 1])
    after = tokenizer.decode(ids[at + 1 : at + 2])
    before = tokenizer.decode(ids[at - task.context : at])
    if task.slug == "continuation":
        answer = tokenizer.decode(ids[at : at + task.max_new_tokens]).strip()
        return (before, answer) if word.startswith(" ") and len(answer.split()) >= 3 else None
    if not WORD.match(word) or after[:1].isalpha() or word.strip().lower() in ("the", "and"):
        return None
    if task.slug == "infill-word":  # T5's sentinel where the word was, as span corruption writes it
        return before + "<extra_id_0>" + tokenizer.decode(ids[at + 1 : at + 1 + task.context]), word.strip()
    return before, word.strip()


def score_tasks(model: Path, place: Path, tasks: list[tuple[StudyTask, Path]], examples: int, log) -> dict:
    """`model` scored on the first `examples` of each task with `uptrain evaluate` (kept in
    `place`/SLUG: scores.json with its setting, predictions.jsonl), picked up when made with the
    same setting."""
    from uptrain.evaluation.run import EvaluateOptions, evaluate_model, write_result
    from uptrain.options import validated

    scores = {}
    for task, data in tasks:
        setting = {"task": "qa", "data": str(data), "max_new_tokens": task.max_new_tokens, "limit": examples}
        setting["batch_size"] = 16
        folder, stored = place / task.slug, None
        try:
            stored = json.loads((folder / "scores.json").read_text())
        except (OSError, ValueError):
            pass
        if not isinstance(stored, dict) or stored.get("setting") != setting:
            log(f"[recovery] {model}: scoring {task.slug}")
            stored = evaluate_model(validated(EvaluateOptions, "evaluate", model=str(model), **setting))
            place.mkdir(parents=True, exist_ok=True)
            write_result({**stored, "setting": setting}, folder, overwrite=True)
        scores[task.slug] = {
            "metric": task.metric,
            "score": stored["scores"][task.metric],
            "time_per_sample_s": stored["time_per_sample_s"],
            "examples": stored["examples"],
        }
    return scores


def first_reaching(curve: list, target: float) -> dict:
    """The first evaluation at or below `target`: its tokens and loss (None: not reached)."""
    for tokens, loss in curve:
        if loss <= target:
            return {"target": target, "tokens": tokens, "loss": loss}
    return {"target": target, "tokens": None, "loss": None}


def analyse(runs: list[dict], model: str, fraction: float, pretrain_tokens: float) -> dict:
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
        "model": model,
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


def print_task_table(study: dict) -> None:
    """The paper's Table 1 view: per run, the loss and each task's score at α = 0 and after
    uptraining, and the time per sample of each task's generation after uptraining."""
    tasks = study["tasks"]
    header = ["run", "G", "loss α=0 → end"]
    header += [f"{t['slug']} {t['metric']} α=0 → end" for t in tasks]
    header += [f"{t['slug']} s/sample" for t in tasks]
    rows = []
    for r in study["runs"]:
        before, after = r["tasks"]["before"], r["tasks"]["after"]
        row = [r["name"], str(r["num_kv_heads"] or "h"), f"{r['loss_before']:.3f} → {r['loss_after']:.3f}"]
        row += [f"{before[t['slug']]['score']:.1f} → {after[t['slug']]['score']:.1f}" for t in tasks]
        row += [f"{after[t['slug']]['time_per_sample_s']:.4f}" for t in tasks]
        rows.append(row)
    what = "; ".join(f"{t['slug']}: {t['what']}" for t in tasks)
    count = study["runs"][0]["tasks"]["after"][tasks[0]["slug"]]["examples"]
    print(f"\ntask scores, α = 0 → after uptraining (0–100, {count} examples each; {what})")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))


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


def study_runs(spec, log) -> list[dict]:
    """Every run of the study (compare's, then the distilled ones) with its curve and the folders
    of the model it starts from and of its uptrained checkpoint."""
    root = Path(spec.output_dir)
    runs = [
        {
            "name": r.name,
            "num_kv_heads": None if r.pooling == "mha" else r.num_kv_heads,
            "pooling": r.pooling,
            "distillation": False,
            "curve": [list(p) for p in r.curve],
            "start": str(spec.model if r.pooling == "mha" else root / "converted" / r.name),
            "final": str(root / "runs" / r.name / "train" / "final"),
        }
        for r in run_compare(spec, log)
    ]
    for g in spec.num_kv_heads:
        run = distilled_run(spec, g, log)
        start = root / "converted" / f"g{g}-calibrated"
        final = root.parent / "distill" / run["name"] / "train" / "final"
        runs.append({**run, "start": str(start), "final": str(final)})
    return runs


def with_task_scores(runs: list[dict], args, log) -> None:
    """Each run's task scores at α = 0 (the model it starts from) and after uptraining (`tasks`:
    {before, after}: {slug: metric, score, time per sample, examples}); none with --task-examples 0."""
    if not args.task_examples:
        return
    from uptrain import loading

    root = Path(args.output_dir).absolute()
    tokenizer = loading.load_tokenizer(REFERENCES[args.reference], "model")
    tasks = [(t, task_data(t, tokenizer, args.task_examples, root / "task-data")) for t in STUDY_TASKS[args.reference]]
    for run in runs:
        start = "mha" if run["num_kv_heads"] is None else Path(run["start"]).name
        places = {"before": (run["start"], root / "tasks" / "start" / start)}
        places["after"] = (run["final"], root / "tasks" / "final" / run["name"])
        run["tasks"] = {
            when: score_tasks(Path(model), place, tasks, args.task_examples, log)
            for when, (model, place) in places.items()
        }


def main(argv=None) -> None:
    args = parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    spec = study_spec(args)
    runs = study_runs(spec, log)
    with_task_scores(runs, args, log)
    study = analyse(runs, str(spec.model), args.fraction, spec.pretrain_tokens)
    study["reference"] = args.reference
    study["settings"] = {
        k: getattr(spec, k)
        for k in ("objective", "seq_len", "batch_size", "lr", "warmup_steps", "eval_every", "eval_blocks")
    }
    study["tasks"] = [dataclasses.asdict(t) for t in STUDY_TASKS[args.reference]] if args.task_examples else []
    print_table(study)
    if args.task_examples:
        print_task_table(study)
    if args.plot:
        plot(study, Path(args.output_dir) / "recovery.png")
    print(json.dumps(study))


if __name__ == "__main__":
    from uptrain import UptrainError

    try:
        main()
    except UptrainError as err:
        sys.exit(f"error: {err}")
