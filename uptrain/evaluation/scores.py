"""The task metrics, each computed by the library its field uses: WER and CER (`jiwer`) for speech
recognition, BLEU and chrF (`sacrebleu`) for translation, ROUGE-1/2/L (`rouge-score`) for
summarisation; exact match and F1 for extractive QA are SQuAD's own definitions, written here.

Every score is on a 0–100 scale (WER and CER as percentages), so that a table of tasks reads
alike. The libraries are the optional extra `uptrain[eval]`: a missing one is one line naming it
(`require`), checked before any model is loaded.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import re
import string

from uptrain import UptrainError

EXTRA = "uptrain[eval]"


def require(module: str, package: str, what: str):
    """The imported `module` (of the PyPI package `package`), or one line naming the extra that
    installs it; `what` says who needs it (`--task translation`)."""
    if importlib.util.find_spec(module) is None:
        raise UptrainError(f"{what} needs {package}, which is not installed: pip install '{EXTRA}'")
    return importlib.import_module(module)


def word_error_rates(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus WER and CER in percent (jiwer: edits over the references' words, characters), on the
    text as written: normalise both sides first if casing and punctuation should not count."""
    jiwer = require("jiwer", "jiwer", "--task asr")
    return {
        "wer": 100 * jiwer.wer(references, predictions),
        "cer": 100 * jiwer.cer(references, predictions),
    }


def translation_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU and chrF with sacrebleu's defaults (13a tokenisation), one reference per line."""
    sacrebleu = require("sacrebleu", "sacrebleu", "--task translation")
    return {
        "bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
        "chrf": sacrebleu.corpus_chrf(predictions, [references]).score,
    }


def rouge_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-L F-measures (rouge-score, with its Porter stemmer, as
    summarisation papers report them), times 100."""
    rouge_scorer = require("rouge_score.rouge_scorer", "rouge-score", "--task summarization")
    names = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(names), use_stemmer=True)
    totals = dict.fromkeys(names, 0.0)
    for prediction, reference in zip(predictions, references):
        for name, score in scorer.score(reference, prediction).items():
            totals[name] += score.fmeasure
    return {name: 100 * total / len(predictions) for name, total in totals.items()}


# SQuAD's answer normalisation (the v1.1 evaluation script's): lower case, no punctuation, no
# English articles, single spaces.
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """An answer as SQuAD compares answers."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_f1(prediction: str, gold: str) -> float:
    """SQuAD's token F1 of one prediction against one gold answer, in [0, 1]."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def qa_example_scores(prediction: str, golds: list[str]) -> dict[str, float]:
    """Exact match and F1 of one prediction, each its best over the gold answers, in [0, 1]."""
    return {
        "exact_match": max(float(normalize_answer(prediction) == normalize_answer(g)) for g in golds),
        "f1": max(answer_f1(prediction, g) for g in golds),
    }


def qa_scores(per_example: list[dict[str, float]]) -> dict[str, float]:
    """Mean exact match and F1 over the examples (from `qa_example_scores`), times 100."""
    return {name: 100 * sum(s[name] for s in per_example) / len(per_example) for name in ("exact_match", "f1")}
