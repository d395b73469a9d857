"""The tasks `uptrain evaluate` scores, one record each: what a line of its data holds (the pair
formats the `pairs` and `speech_pairs` objectives read), the metrics, the library they need, the
metric a comparison ranks by, and which way is better.

`lm-eval:NAME` is not a record here: it names a task of the lm-evaluation-harness (one it has
installed, or a local task YAML), which reads its own data (`uptrain.evaluation.harness`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from uptrain import UptrainError
from uptrain.evaluation import scores

HARNESS_PREFIX = "lm-eval:"


@dataclass(frozen=True)
class Task:
    """One generation task and how it is scored."""

    name: str
    what: str  # for --help
    objective: str  # the objective whose jsonl lines it reads: `pairs` or `speech_pairs`
    score: Callable[[list[str], list[str]], dict[str, float]] | None  # corpus scores; None: per example (qa)
    module: str  # the library's module, checked before anything loads
    package: str  # its PyPI name, for the message when it is missing
    primary: str  # the score a comparison shows
    higher_is_better: bool = True

    def check_library(self) -> None:
        """Refuse, in one line naming the extra, a task whose library is missing."""
        if self.module:
            scores.require(self.module, self.package, f"--task {self.name}")


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "asr",
            "speech recognition: jsonl `audio`/`text` pairs, WER and CER (jiwer)",
            "speech_pairs",
            scores.word_error_rates,
            "jiwer",
            "jiwer",
            "wer",
            higher_is_better=False,
        ),
        Task(
            "translation",
            "jsonl `source`/`target` pairs, BLEU and chrF (sacrebleu)",
            "pairs",
            scores.translation_scores,
            "sacrebleu",
            "sacrebleu",
            "bleu",
        ),
        Task(
            "summarization",
            "jsonl `source`/`target` pairs, ROUGE-1/2/L (rouge-score)",
            "pairs",
            scores.rouge_scores,
            "rouge_score",
            "rouge-score",
            "rougeL",
        ),
        Task(
            "qa",
            "jsonl `source` (question and context) / `target` (the answer; optional `answers`: more accepted "
            "answers) pairs, SQuAD's exact match and F1",
            "pairs",
            None,
            "",
            "",
            "f1",
        ),
    )
}


def task_choices() -> dict[str, str]:
    """The `--task` values and what each scores, for --help."""
    harness = "a task of the lm-evaluation-harness (lm-eval), installed or a local task YAML file"
    return {name: task.what for name, task in TASKS.items()} | {f"{HARNESS_PREFIX}NAME": harness}


def task_problem(value: str) -> str | None:
    """What is wrong with a `--task` value, or None."""
    if value in TASKS:
        return None
    if value.startswith(HARNESS_PREFIX):
        return None if value[len(HARNESS_PREFIX) :].strip() else f"name the lm-eval task after {HARNESS_PREFIX}"
    return f"unknown task {value!r}; choose from {', '.join(TASKS)} or {HARNESS_PREFIX}NAME"


def get_task(name: str) -> Task:
    """The registered task `name`; refuses, in one line, an unknown one."""
    if problem := task_problem(name):
        raise UptrainError(problem)
    return TASKS[name]
