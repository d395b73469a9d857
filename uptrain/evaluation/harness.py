"""Tasks of the lm-evaluation-harness (`lm-eval`), run through its Python API on the model already
in memory: `HFLM(pretrained=model, tokenizer=tokenizer)` and `simple_evaluate`, so a converted
`*_gqa` model is scored as loaded (no re-loading by name, no remote code).

`--task lm-eval:NAME` names a task lm-eval has installed, or a local task YAML file (its `task:`
key names it; the folder it is in is what lm-eval's `TaskManager(include_path=…)` indexes, without
lm-eval's own tasks). Its data
is whatever the task names: a local task reads local files (`dataset_path: json`,
`dataset_kwargs: {data_files: …}`, paths as `datasets` reads them: absolute, or relative to the
current folder); a Hub dataset needs the network. Scores are lm-eval's own, named and scaled as it reports them
(`acc,none`, `exact_match,none`, …: fractions in [0, 1]), with its per-example records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError, exception_line
from uptrain.evaluation.scores import require
from uptrain.evaluation.tasks import HARNESS_PREFIX


def harness_task(task: str) -> tuple[str, Path | None]:
    """(the lm-eval task name, the folder to include or None) of a `--task lm-eval:…` value."""
    name = task[len(HARNESS_PREFIX) :].strip()
    path = Path(name)
    if path.suffix not in (".yaml", ".yml"):
        return name, None
    if not path.is_file():
        raise UptrainError(f"--task {task}: no task YAML at {path}")
    name, folder = _yaml_task_name(path), path.resolve().parent
    # lm-eval indexes every task YAML under the folder with its own loader: each is read here
    # first, so that an alias bomb beside the task is refused rather than run without bound.
    for other in sorted(folder.rglob("*.y*ml")):
        if other.suffix in (".yaml", ".yml") and other.is_file() and other.resolve() != path.resolve():
            _yaml_task_name(other, named=False)
    return name, folder


def _yaml_task_name(path: Path, named: bool = True) -> str | None:
    from uptrain.options import read_yaml

    try:
        # uptrain's bounded loader, before lm-eval's own reads it: an alias bomb would run lm-eval's
        # without bound. lm-eval's tags (`!function utils.process`) matter to lm-eval only.
        config = read_yaml(path, ignore_tags=True)
    except UptrainError as err:
        raise UptrainError(f"cannot read the task YAML {path}: {err}") from None
    name = config.get("task") if isinstance(config, dict) else None
    if not named:
        return None
    if not isinstance(name, str) or not name:
        raise UptrainError(f"the task YAML {path} has no `task:` name")
    return name


@dataclass(frozen=True)
class HarnessTask:
    """An lm-eval task found in its task index, before any model is loaded."""

    option: str  # the --task value, for messages
    name: str
    manager: object  # lm-eval's TaskManager that indexes it


def find_harness_task(task: str) -> HarnessTask:
    """The lm-eval task of a `--task lm-eval:…` value; one line when lm-eval is missing (naming
    the extra), when a task YAML is not there, or when lm-eval knows no such task."""
    require("lm_eval", "lm-eval", f"--task {task}")
    from lm_eval.tasks import TaskManager

    name, include = harness_task(task)
    # A local YAML's folder alone: indexing lm-eval's own ~15k task files costs tens of seconds.
    manager = TaskManager() if include is None else TaskManager(include_path=str(include), include_defaults=False)
    if name not in manager.all_tasks:
        raise UptrainError(f"--task {task}: lm-eval knows no task {name!r} (`lm-eval ls tasks` lists them)")
    return HarnessTask(task, name, manager)


def run_harness(model, tokenizer, task: HarnessTask, *, batch_size: int, limit: int | None, num_fewshot: int | None):
    """Run one lm-eval task (or group) on `model`. Returns {"scores": {task: {metric: value}},
    "primary": the score a comparison shows, "predictions": [per-example records]} (a record: the
    task, the document, lm-eval's target, the filtered response and the example's metrics)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[task.name],
            task_manager=task.manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=True,
        )
    except (OSError, ValueError, KeyError, TypeError) as err:  # a dataset that is not there, a bad YAML field
        raise UptrainError(f"--task {task.option}: lm-eval failed: {exception_line(err)}") from None
    scores = {
        # lm-eval names each score `metric,filter`; its other numbers (`sample_len`) are not scores.
        task_name: {metric: value for metric, value in metrics.items() if "," in metric and _number(value)}
        for task_name, metrics in results["results"].items()
    }
    predictions = [
        {
            "task": task_name,
            "index": sample["doc_id"],
            "doc": _plain(sample["doc"]),
            "reference": _plain(sample["target"]),
            "prediction": _plain(sample["filtered_resps"]),
            **{metric: _plain(sample[metric]) for metric in sample["metrics"] if metric in sample},
        }
        for task_name, samples in results["samples"].items()
        for sample in samples
    ]
    return {
        "scores": scores,
        "primary": _primary(scores, results.get("higher_is_better", {})),
        "predictions": predictions,
    }


def _primary(scores: dict, higher_is_better: dict) -> dict | None:
    """The score a comparison shows: the first task's first metric that is not a standard error
    (`acc,none` of `acc,none` and `acc_stderr,none`), named `task/metric`."""
    for task_name, metrics in scores.items():
        for metric, value in metrics.items():
            if "_stderr" not in metric:
                better = higher_is_better.get(task_name, {}).get(metric.split(",")[0], True)
                return {"metric": f"{task_name}/{metric}", "value": value, "higher_is_better": bool(better)}
    return None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain(value):
    """`value` as JSON holds it (lm-eval's samples carry tuples and numpy numbers)."""
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
