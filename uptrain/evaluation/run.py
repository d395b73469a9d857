"""`uptrain evaluate`: a checkpoint's task scores, with its predictions kept — the quality half of
the paper's Table 1, beside the time per sample.

For the generation tasks (`uptrain.evaluation.tasks`) the data is a local JSON-lines file in the
pair formats `uptrain train` reads for the `pairs` and `speech_pairs` objectives (read and checked
by the same reader, `uptrain.data.pairs`); every prediction is a greedy generation with the KV
cache (`uptrain.evaluation.generation`). The family's prompt keys are train's (`language`,
`speech_task`, `source_lang`, `target_lang`, embedded with `option_like`): the examples are read
with train's framing (`uptrain.objectives.prompts`) and generation starts with the same prompt,
so a model is scored on what users decode with. `lm-eval:NAME` runs an lm-evaluation-harness task on the
loaded model (`uptrain.evaluation.harness`). Plain transformers checkpoints and uptrain's `*_gqa`
conversions load alike; a conversion at G = h scores exactly what its source scores.

Every cheap refusal comes before the model is loaded: an unknown task, a missing metric library
(one line naming `uptrain[eval]`), data a task cannot read, lengths past the model's positions,
a prompt key train would refuse, an output folder that exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from uptrain import UptrainError, loading
from uptrain.architecture import auto_class_name
from uptrain.checkpoint.atomic import atomic_directory, check_apart, check_output_path
from uptrain.checkpoint.source import resolve_source
from uptrain.evaluation import harness
from uptrain.evaluation.generation import generate_predictions
from uptrain.evaluation.scores import qa_example_scores, qa_scores
from uptrain.evaluation.tasks import HARNESS_PREFIX, TASKS, Task, get_task, task_choices, task_problem
from uptrain.model_info import read_config
from uptrain.options import Schema, option, option_like
from uptrain.speed import DTYPES, load_model
from uptrain.speed_checks import ModelShape, model_shape, parse_device
from uptrain.train.config import TrainData

DEFAULT_SEQ_LEN = 1024  # sources are cut here unless the model's positions are fewer
DEFAULT_NEW_TOKENS = 128
SPEECH_AUTO_CLASS = "AutoModelForSpeechSeq2Seq"
# The keys of `PromptKeys` (uptrain.objectives.prompts, which imports torch), named here for the
# schema and for compare, which passes its runs' keys on.
PROMPT_KEYS = ("language", "speech_task", "source_lang", "target_lang")


def _task_help() -> str:
    return "what to score: " + "; ".join(f"{name}: {what}" for name, what in task_choices().items())


@dataclass(kw_only=True)
class EvaluateOptions(Schema):
    """`uptrain evaluate`: the options of `evaluate_model`, as flags."""

    model: str = option(
        positional=True, metavar="MODEL", help="checkpoint folder or Hub id: a plain transformers model or a conversion"
    )
    task: str = option(metavar="TASK", check=task_problem, help=_task_help())
    data: str | None = option(
        None,
        metavar="FILE",
        help="the task's local JSON-lines pairs (required, except for lm-eval tasks, which name their own data)",
    )
    output_dir: str | None = option(
        None, metavar="DIR", help="also write scores.json and predictions.jsonl (one line per example) into DIR"
    )
    overwrite: bool = option(False, help="replace an existing --output-dir")
    max_new_tokens: int | None = option(
        None,
        at_least=1,
        help=f"most tokens generated per example, greedily with the KV cache (default: {DEFAULT_NEW_TOKENS}, or fewer "
        "where the decoder's positions end after its start and the family's prompt; a decoder-only model's: at most "
        "half its positions)",
    )
    seq_len: int | None = option(
        None,
        at_least=1,
        help=f"sources cut at this many tokens (default: {DEFAULT_SEQ_LEN}, or fewer where the model's positions "
        "end; a decoder-only model's source and new tokens share its positions)",
    )
    batch_size: int = option(8, at_least=1, help="examples generated together")
    limit: int | None = option(None, at_least=1, help="score the first N examples only")
    num_fewshot: int | None = option(None, at_least=0, help="lm-eval tasks: few-shot examples (default: the task's)")
    device: str = option("cpu", metavar="cpu|cuda[:N]", help="where the model runs")
    dtype: str | None = option(None, choices=DTYPES, help="weights dtype (default: float32 on CPU, bfloat16 on CUDA)")
    json: bool = option(False, help="print the result, predictions included, as one JSON object")
    # The prompt keys are `uptrain train`'s (declared there): the targets are read, and generation
    # starts, with the prompt the model was trained and is decoded with.
    language: str | None = option_like(TrainData, "language", None)
    speech_task: Literal["transcribe", "translate"] | None = option_like(TrainData, "speech_task", None)
    source_lang: str | None = option_like(TrainData, "source_lang", None)
    target_lang: str | None = option_like(TrainData, "target_lang", None)

    def problems(self) -> list[str]:
        found = super().problems()
        harness_task = self.task.startswith(HARNESS_PREFIX)
        if harness_task and (given := self.prompt_keys().given()):
            found.append(f"`{given[0]}`: an lm-eval task writes its own prompts; drop it")
        if harness_task and self.data is not None:
            found.append("`data`: an lm-eval task reads the data its task names; drop --data")
        if not harness_task and self.data is None:
            found.append(f"`data` is required for --task {self.task}")
        if not harness_task and self.num_fewshot is not None:
            found.append("`num_fewshot` is for lm-eval tasks")
        for key in ("max_new_tokens", "seq_len"):
            if harness_task and getattr(self, key) is not None:
                found.append(f"`{key}`: an lm-eval task sets its own lengths; drop it")
        return found

    def prompt_keys(self):
        """The `PromptKeys` that choose the targets' prompt (`uptrain.objectives.prompts`, which
        imports torch: asked only when the options are checked or used)."""
        from uptrain.objectives.prompts import PromptKeys

        return PromptKeys(**{key: getattr(self, key) for key in PROMPT_KEYS})


@dataclass
class _Generation:
    """A generation task's lengths, prompt and examples, read and checked before the model loads."""

    new_tokens: int
    seq_len: int
    framing: object  # `TargetFraming` or None
    examples: object  # `PairExamples`


@dataclass
class PreparedEvaluation:
    """What `evaluate_model` checks and reads before its model loads (`prepare_evaluation`)."""

    task: Task | None  # None: an lm-eval task
    lm_task: harness.HarnessTask | None
    source: object  # `checkpoint.source.Source`
    device: object  # torch.device
    dtype: str
    tokenizer: object
    generation: _Generation | None


def prepare_evaluation(options: EvaluateOptions) -> PreparedEvaluation:
    """Every check of `evaluate_model` that needs no model loaded, in its order, and what they read:
    the task and its library (lm-eval's task too), the output folder, the device, whether the
    model can run the task, and a generation task's lengths, prompt and examples (every line of
    the data read and checked). Compare runs it on its model before any run trains."""
    harness_task = options.task.startswith(HARNESS_PREFIX)
    task = None if harness_task else get_task(options.task)
    lm_task = harness.find_harness_task(options.task) if task is None else None
    if task is not None:
        task.check_library()
    source = resolve_source(options.model)
    if options.output_dir is not None:
        out = Path(options.output_dir)
        inputs = [("model", Path(source.folder))] + ([("`data`", Path(options.data))] if options.data else [])
        check_apart(out, inputs, "output_dir")  # --overwrite never replaces the model or its data
        check_output_path(out, options.overwrite)
    device = parse_device(options.device)
    dtype = options.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    config = read_config(source.folder)
    shape = model_shape(source.folder, source.label)
    _check_model_fits_task(options.task, task, config, shape, source.label)
    tokenizer = loading.load_tokenizer(source.folder, "model")
    generation = None
    if task is not None:
        framing = _framing(options, task, tokenizer, source.folder, config)
        new_tokens = _new_tokens(options, shape, framing)
        seq_len = _source_length(options, shape, new_tokens)
        examples = _read_examples(options, task, tokenizer, source.folder, config, seq_len, new_tokens, framing)
        if task.score is None:  # QA: every line's further answers, read when it is scored
            for where, line in examples.records:
                _further_answers(line, where)
        generation = _Generation(new_tokens, seq_len, framing, examples)
    return PreparedEvaluation(task, lm_task, source, device, dtype, tokenizer, generation)


def evaluate_model(options: EvaluateOptions) -> dict:
    """Score `options.model` on `options.task`. Returns the result (the --json output): model,
    task, data, examples, scores ({metric: value}; an lm-eval task's {task: {metric: value}}),
    primary ({metric, value, higher_is_better}: what a comparison shows; an lm-eval task's first
    metric, named `task/metric`), time_per_sample_s (generation's seconds over the examples;
    None for lm-eval), the settings, and predictions (one record per example: its place, source,
    reference, prediction; QA's exact match and F1 too)."""
    ready = prepare_evaluation(options)  # every refusal, before the model loads
    source, device = ready.source, ready.device
    model = load_model(source.folder, ready.dtype, device)
    if ready.task is None:
        result = _run_harness(model, ready.tokenizer, ready.lm_task, options)
    else:
        result = _run_generation(options, ready.task, ready.tokenizer, model, ready.generation, device)
    result = {
        "model": source.label,
        "task": options.task,
        "data": None if options.data is None else Path(options.data).name,
        "examples": len(result["predictions"]),
        **result,
        "batch_size": options.batch_size,
        "device": str(device),
        "dtype": ready.dtype,
    }
    if options.output_dir is not None:
        write_result(result, Path(options.output_dir), options.overwrite)
    return result


def _run_harness(model, tokenizer, task: harness.HarnessTask, options: EvaluateOptions) -> dict:
    limits = {"limit": options.limit, "num_fewshot": options.num_fewshot}
    run = harness.run_harness(model, tokenizer, task, batch_size=options.batch_size, **limits)
    return {**run, "time_per_sample_s": None}


def _run_generation(options: EvaluateOptions, task: Task, tokenizer, model, generation: _Generation, device) -> dict:
    """Generate for the examples `prepare_evaluation` read, and score."""
    predictions, seconds = generate_predictions(
        model,
        tokenizer,
        generation.examples,
        batch_size=options.batch_size,
        max_new_tokens=generation.new_tokens,
        device=device,
        framing=generation.framing,
    )
    scored = _score_generations(task, generation.examples, predictions, seconds)
    prompt = None if generation.framing is None else generation.framing.shown
    return {**scored, "max_new_tokens": generation.new_tokens, "seq_len": generation.seq_len, "prompt": prompt}


def _framing(options: EvaluateOptions, task: Task, tokenizer, folder, config: dict):
    """The family's prompt, as `uptrain train` builds it (its refusals too), before the model loads."""
    from uptrain.architecture import find_architecture
    from uptrain.objectives import OBJECTIVES
    from uptrain.objectives.prompts import target_framing

    arch = find_architecture(config.get("model_type"))
    return target_framing(arch, OBJECTIVES[task.objective], options.prompt_keys(), tokenizer, str(folder), config)


def _check_model_fits_task(name: str, task: Task | None, config: dict, shape: ModelShape, label: str) -> None:
    """Refuse a model the task cannot run on, in one line, before it loads."""
    speech = auto_class_name(config) == SPEECH_AUTO_CLASS
    if task is None and shape.cross is not None:
        raise UptrainError(f"--task {name}: lm-eval tasks run on decoder-only models; {label} is an encoder–decoder")
    if task is not None and (task.objective == "speech_pairs") != speech:
        needs = "a speech encoder–decoder (Whisper)" if task.objective == "speech_pairs" else "a text model"
        raise UptrainError(f"--task {name} needs {needs}; {label} is {'one of speech' if speech else 'not one'}")


def _new_tokens(options: EvaluateOptions, shape: ModelShape, framing=None) -> int:
    """The most tokens generated per example: as asked, else the default within the positions.
    An encoder–decoder's decoder holds its start and the family's prompt (`framing`: Whisper's
    language and task tokens) before them; an asked number that leaves them no room is refused."""
    ahead = 0 if framing is None or framing.label_prefix is None else len(framing.label_prefix) + 1
    tokens = f"{ahead} token{'s' if ahead != 1 else ''}"
    if shape.cross is not None and shape.max_positions is not None and ahead:
        room = shape.max_positions - ahead
        if room < 1:
            raise UptrainError(
                f"{shape.label}: the prompt {framing.shown} ({tokens}) fills the decoder's "
                f"{shape.max_positions} positions; no token can be generated after it"
            )
        asked = options.max_new_tokens
        if asked is not None and asked > room:
            raise UptrainError(
                f"{shape.label}: --max-new-tokens {asked} + the prompt {framing.shown} ({tokens}) = "
                f"{asked + ahead} is beyond the decoder's {shape.max_positions} positions; use --max-new-tokens "
                f"{room} or fewer"
            )
    if options.max_new_tokens is not None:
        return options.max_new_tokens
    if shape.max_positions is None:
        return DEFAULT_NEW_TOKENS
    room = shape.max_positions - ahead if shape.cross is not None else shape.max_positions // 2
    return max(1, min(DEFAULT_NEW_TOKENS, room))


def _source_length(options: EvaluateOptions, shape: ModelShape, new: int) -> int:
    """The tokens a source is cut at, checked with `new` generated tokens against the model's positions."""
    if shape.cross is None:  # decoder-only: the source and what it generates share the positions
        room = DEFAULT_SEQ_LEN if shape.max_positions is None else shape.max_positions - new
        if room < 1:
            raise UptrainError(
                f"{shape.label}: --max-new-tokens {new} leaves none of the model's {shape.max_positions} positions "
                "for the source; lower it"
            )
        seq_len = options.seq_len or min(DEFAULT_SEQ_LEN, room)
        if shape.max_positions is not None and seq_len + new > shape.max_positions:
            raise UptrainError(
                f"{shape.label}: --seq-len {seq_len} + --max-new-tokens {new} is beyond the model's "
                f"{shape.max_positions} positions"
            )
        return seq_len
    if shape.max_positions is not None and new > shape.max_positions:
        raise UptrainError(
            f"{shape.label}: --max-new-tokens {new} is beyond the decoder's {shape.max_positions} positions"
        )
    limit = shape.source_positions
    seq_len = options.seq_len or (DEFAULT_SEQ_LEN if limit is None else min(DEFAULT_SEQ_LEN, limit))
    if limit is not None and seq_len > limit and not shape.fixed_source:
        raise UptrainError(f"{shape.label}: --seq-len {seq_len} is beyond the encoder's {limit} positions")
    return seq_len


def _read_examples(
    options: EvaluateOptions, task: Task, tokenizer, folder, config: dict, seq_len: int, new: int, framing
):
    """The task's examples (the first `limit`), every one read and checked by train's pair reader,
    with the family's prompt (`framing`) as train reads them."""
    from uptrain.data.pairs import PairExamples, load_pairs
    from uptrain.objectives import OBJECTIVES

    objective = OBJECTIVES[task.objective]
    # The references are the lines' texts; the targets are read for their checks, a prompt's then
    # with room for it: the decoder holds its start, the prompt and the `new` tokens generated after.
    prompt = framing.label_prefix if framing is not None else None
    target_len = new if prompt is None else len(prompt) + 1 + new
    examples = load_pairs(options.data, "data", objective, tokenizer, str(folder), config, seq_len, target_len, framing)
    n = len(examples) if options.limit is None else min(options.limit, len(examples))
    return PairExamples(
        examples.sources[:n],
        examples.targets[:n],
        examples.pad_id,
        examples.feature_extractor,
        seconds=examples.seconds[:n] if examples.seconds is not None else None,
        records=examples.records[:n],
    )


def _score_generations(task: Task, examples, predictions: list[str], seconds: float) -> dict:
    """The scores, primary, time per sample and every example's record (`predictions`)."""
    source_field, target_field = _fields(task)
    records = []
    for i, ((where, line), prediction) in enumerate(zip(examples.records, predictions)):
        source = line[source_field]
        records.append(
            {
                "index": i,
                "where": str(where),
                "source": source if isinstance(source, str) else f"<{len(source)} audio samples>",
                "reference": line[target_field],
                "prediction": prediction,
            }
        )
    references = [r["reference"] for r in records]
    if task.score is not None:
        scores = task.score(predictions, references)
    else:  # QA: each example against all its accepted answers
        for record, (where, line) in zip(records, examples.records):
            golds = [record["reference"], *_further_answers(line, where)]
            record.update(qa_example_scores(record["prediction"], golds))
        scores = qa_scores(records)
    primary = {"metric": task.primary, "value": scores[task.primary], "higher_is_better": task.higher_is_better}
    return {"scores": scores, "primary": primary, "time_per_sample_s": seconds / len(records), "predictions": records}


def _fields(task: Task) -> tuple[str, str]:
    from uptrain.objectives import OBJECTIVES

    return OBJECTIVES[task.objective].fields


def _further_answers(line: dict, where) -> list[str]:
    answers = line.get("answers", [])
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise UptrainError(f"`data` {where}: `answers` must be a list of texts")
    return answers


def write_result(result: dict, out: Path, overwrite: bool) -> None:
    """`scores.json` (the result without its predictions) and `predictions.jsonl` in `out`, a
    folder that appears whole or not at all."""
    with atomic_directory(out, overwrite) as tmp:
        scores = {k: v for k, v in result.items() if k != "predictions"}
        (tmp / "scores.json").write_text(json.dumps(scores, indent=1) + "\n")
        (tmp / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in result["predictions"]))


def format_result(result: dict) -> str:
    """The result of `evaluate_model` for people: the scores, then the time per sample."""
    lines = [f"{result['model']} on {result['task']} ({result['examples']} examples)"]
    scores = result["scores"]
    nested = {"": scores} if all(isinstance(v, (int, float)) for v in scores.values()) else scores
    for group, metrics in nested.items():
        for metric, value in metrics.items():
            lines.append(f"  {group + ' ' if group else ''}{metric}: {value:.4g}")
    if result["time_per_sample_s"] is not None:
        lines.append(f"  time per sample: {result['time_per_sample_s']:.4f} s (batch {result['batch_size']})")
    return "\n".join(lines)


__all__ = [
    "PROMPT_KEYS",
    "TASKS",
    "EvaluateOptions",
    "PreparedEvaluation",
    "evaluate_model",
    "format_result",
    "prepare_evaluation",
    "write_result",
]
