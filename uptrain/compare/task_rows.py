"""Task metrics beside loss and speed in `uptrain compare --task`: every run's uptrained checkpoint
(`runs/NAME/train/final`) scored on each task with `uptrain evaluate` — the paper's Table 1 (task
scores and time per sample, per G and pooling) and Fig. 3 per task.

Each run's score on a task is kept whole in `runs/NAME/tasks/SLUG/` (evaluate's `scores.json`
with the setting it was made with, and `predictions.jsonl`, one line per example): a resumed
compare reuses it unless the task options changed, and a new task scores every run without
training any again. What the scoring would refuse (a missing library, a task lm-eval does not
know, data that is not there or has a bad line, a task the model cannot run) is refused before
any run (`check_task_scoring`).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from uptrain import UptrainError
from uptrain.compare.spec import CompareSpec
from uptrain.data.text import resolve_data
from uptrain.evaluation.harness import find_harness_task
from uptrain.evaluation.run import PROMPT_KEYS, EvaluateOptions, evaluate_model, prepare_evaluation, write_result
from uptrain.evaluation.tasks import HARNESS_PREFIX, get_task
from uptrain.options import validated
from uptrain.speed_checks import parse_device

TASKS_FOLDER = "tasks"


def task_settings(spec: CompareSpec) -> list[dict]:
    """One setting per --task (its data and the scoring options), in order. Refuses, in one
    line, what scoring it would refuse before the model loads."""
    data = iter(spec.task_data)
    settings = []
    if spec.task:
        parse_device(spec.task_device)
    for task in spec.task:
        if task.startswith(HARNESS_PREFIX):
            find_harness_task(task)
            path = None
        else:
            get_task(task).check_library()
            path = str(Path(next(data)).absolute())
            resolve_data(path, "task_data")  # there, and a kind of file a reader takes
        setting = {
            "task": task,
            "data": path,
            "max_new_tokens": None if path is None else spec.task_max_new_tokens,  # lm-eval: the task's own
            "batch_size": spec.task_batch_size,
            "limit": spec.task_limit,
            "device": spec.task_device,
            # The runs' prompt keys (train's, in the embedded data group): each is scored with the
            # prompt it was trained on. An lm-eval task writes its own prompts.
            **({} if path is None else {key: getattr(spec, key) for key in PROMPT_KEYS}),
        }
        evaluate_options(spec.model, setting)  # the options' own checks
        settings.append(setting)
    return settings


def check_task_scoring(spec: CompareSpec) -> None:
    """Refuse, in one line and before any run, what scoring a run's checkpoint would refuse once
    it has trained: evaluate's every check that needs no model loaded (`prepare_evaluation`), on
    compare's model, whose conversions share its family, tokenizer and positions — a task the
    model cannot run (asr on a text model, lm-eval on an encoder–decoder), a line of task data
    the pair reader refuses, lengths past the positions, a prompt key the family refuses."""
    for setting in task_settings(spec):
        prepare_evaluation(evaluate_options(spec.model, setting))


def evaluate_options(model: str | Path, setting: dict) -> EvaluateOptions:
    """The `uptrain evaluate` options of one task's scoring of `model` (compare's task keys are
    evaluate's, bounds included, so only a cross-key rule of evaluate's can refuse them here)."""
    return validated(EvaluateOptions, "evaluate", model=str(model), **setting)


def task_slug(task: str) -> str:
    """A task's folder name: `qa`, `lm-eval-NAME` (a task YAML's by its file name)."""
    if task.startswith(HARNESS_PREFIX):
        name = task[len(HARNESS_PREFIX) :]
        task = "lm-eval-" + (Path(name).stem if name.endswith((".yaml", ".yml")) else name)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", task)


def task_column(task: str, summary: dict) -> str:
    """The results column of a task: its folder name and the metric a comparison shows (`qa:f1`)."""
    return f"{task_slug(task)}:{summary['primary']['metric']}"


def with_tasks(spec: CompareSpec, results: list, log=print) -> list:
    """`results` (study's RunResults) with each row's `tasks`: per --task, its score summary
    (scores, primary, time per sample, examples, the predictions file), stored or scored now."""
    settings = task_settings(spec)
    if not settings:
        return results
    root = Path(spec.output_dir)
    scored = []
    for r in results:
        final = root / "runs" / r.name / "train" / "final"
        tasks = {}
        for setting in settings:
            place = root / "runs" / r.name / TASKS_FOLDER / task_slug(setting["task"])
            summary = _stored(place, setting)
            if summary is not None:
                log(f"[compare] {r.name}: {setting['task']} scored earlier, reusing {place}")
            elif not (final / "config.json").is_file():
                log(f"[compare] {r.name}: no {final} left to score {setting['task']} on; not scored")
                continue
            else:
                log(f"[compare] {r.name}: scoring {setting['task']}")
                result = evaluate_model(evaluate_options(final, setting))
                place.parent.mkdir(parents=True, exist_ok=True)
                write_result({**result, "setting": setting}, place, overwrite=True)
                summary = _summary(result, place)
            tasks[setting["task"]] = summary
        scored.append(replace(r, tasks=tasks))
    return scored


def _summary(result: dict, place: Path) -> dict:
    keys = ("scores", "primary", "time_per_sample_s", "examples")
    return {**{k: result[k] for k in keys}, "predictions": str(place / "predictions.jsonl")}


def _stored(place: Path, setting: dict) -> dict | None:
    """The stored score at `place` if it was made with `setting`, else None (scored again)."""
    try:
        stored = json.loads((place / "scores.json").read_text())
    except (OSError, ValueError):  # absent, or edited by hand: scored again
        return None
    if not isinstance(stored, dict) or stored.get("setting") != setting or not (place / "predictions.jsonl").is_file():
        return None
    try:
        return _summary(stored, place)
    except KeyError:
        return None


def sample_predictions(summary: dict, count: int) -> list[dict]:
    """The first `count` per-example records a run's task score kept (for wandb's tables)."""
    lines = []
    try:
        with open(summary["predictions"]) as f:
            for line, _ in zip(f, range(count)):
                lines.append(json.loads(line))
    except (OSError, ValueError) as err:
        raise UptrainError(f"cannot read {summary['predictions']}: {err}") from None
    return lines
