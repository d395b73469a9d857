"""`uptrain evaluate` with the metric libraries of `uptrain[eval]`: WER/CER (jiwer) on a tiny
Whisper, BLEU/chrF (sacrebleu) and ROUGE (rouge-score) on tiny BART and GPT-2, an
lm-evaluation-harness task from a local YAML over a local jsonl (offline) on GPT-2 — each model
and its G = h conversion scoring exactly alike — and `uptrain compare --task` with both kinds.
Skipped where the extra is not installed: test_metric_environment.py runs this file in a cached
environment that has it."""

from __future__ import annotations

import json

import pytest

for _module in ("jiwer", "sacrebleu", "rouge_score", "lm_eval"):
    pytest.importorskip(_module)

from tests.compare.test_study import compare, setup  # noqa: E402, F401  (the fixture)
from tests.evaluation.models import build_all, evaluate_json  # noqa: E402
from tests.train.test_seq2seq import write_jsonl  # noqa: E402
from uptrain.cli import main  # noqa: E402
from uptrain.evaluation.scores import rouge_scores, translation_scores, word_error_rates  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("libraries")
    paths = build_all(root)
    rows = [{"question": w, "choices": [w, "the queen"], "label": 0, "answer": w} for w in ("the cat", "a dog")]
    data = write_jsonl(root / "lm-task.jsonl", rows)
    paths["yaml"] = root / "tiny_task.yaml"
    paths["yaml"].write_text(
        "task: uptrain_tiny_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}} :'\ndoc_to_target: label\n"
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n"
    )
    return paths


def test_the_metrics_are_the_libraries_own():
    assert word_error_rates(["the cat"], ["the cat sat"]) == pytest.approx({"wer": 100 / 3, "cer": 100 * 4 / 11})
    perfect = translation_scores(["the cat sat on the mat"], ["the cat sat on the mat"])
    assert perfect["bleu"] == pytest.approx(100) and perfect["chrf"] == pytest.approx(100)
    assert rouge_scores(["the cats sat"], ["the cat sat"]) == pytest.approx(
        dict.fromkeys(["rouge1", "rouge2", "rougeL"], 100)
    )


@pytest.mark.parametrize(
    ("kind", "task"), [("bart", "translation"), ("gpt2", "summarization"), ("bart", "summarization")]
)
def test_text_tasks_score_the_conversion_as_the_source(built, tmp_path, capsys, kind, task):
    args = ("--task", task, "--data", str(built["pairs"]), "--max-new-tokens", "6", "--batch-size", "4")
    source = evaluate_json(str(built[kind]), *args, capsys=capsys)
    converted = evaluate_json(str(built[f"{kind}-gqa"]), *args, capsys=capsys)
    assert converted["predictions"] == source["predictions"] and converted["scores"] == source["scores"]
    assert set(source["scores"]) == ({"bleu", "chrf"} if task == "translation" else {"rouge1", "rouge2", "rougeL"})


@pytest.mark.parametrize("task", ["translation", "summarization"])
def test_each_prediction_is_scored_against_its_own_example(built, tmp_path, capsys, task):
    """References that are the predictions a run made score perfectly when scored again, which holds
    only if each prediction meets its own example's reference."""
    args = ("--task", task, "--max-new-tokens", "6", "--batch-size", "4")
    first = evaluate_json(str(built["gpt2"]), *args, "--data", str(built["pairs"]), capsys=capsys)
    rows = [{"source": p["source"], "target": p["prediction"]} for p in first["predictions"]]
    assert all(row["target"] for row in rows) and len({row["target"] for row in rows}) > 1
    again = evaluate_json(
        str(built["gpt2"]), *args, "--data", str(write_jsonl(tmp_path / "own.jsonl", rows)), capsys=capsys
    )
    # (ROUGE-2 of a one-word prediction is 0: it has no bigram to share.)
    perfect = ("bleu", "chrf") if task == "translation" else ("rouge1", "rougeL")
    assert all(again["scores"][name] == pytest.approx(100) for name in perfect), again["scores"]
    assert first["scores"][first["primary"]["metric"]] < 50  # and the references first given did not


def test_speech_recognition_scores_wer_and_cer(built, tmp_path, capsys):
    args = ("--task", "asr", "--data", str(built["speech"]), "--max-new-tokens", "4")
    source = evaluate_json(str(built["whisper"]), *args, capsys=capsys)
    converted = evaluate_json(str(built["whisper-gqa"]), *args, capsys=capsys)
    assert converted["predictions"] == source["predictions"] and converted["scores"] == source["scores"]
    assert source["primary"] == {"metric": "wer", "value": source["scores"]["wer"], "higher_is_better": False}
    assert source["predictions"][0]["source"] == "audio/low.wav"
    folder = built["speech"].parent
    rows = [{"audio": str(folder / p["source"]), "text": p["prediction"]} for p in source["predictions"]]
    again = evaluate_json(
        str(built["whisper"]),
        *args[:2],
        "--data",
        str(write_jsonl(tmp_path / "own.jsonl", rows)),
        *args[4:],
        capsys=capsys,
    )
    assert again["scores"] == {"wer": 0.0, "cer": 0.0} and source["scores"]["wer"] > 0


def test_an_lm_eval_task_from_a_local_yaml(built, tmp_path, capsys):
    args = ("--task", f"lm-eval:{built['yaml']}", "--batch-size", "2")
    source = evaluate_json(str(built["gpt2"]), *args, capsys=capsys)
    converted = evaluate_json(str(built["gpt2-gqa"]), *args, capsys=capsys)
    assert set(source["scores"]) == {"uptrain_tiny_choice"} and "acc,none" in source["scores"]["uptrain_tiny_choice"]
    assert converted["scores"] == source["scores"] and converted["predictions"] == source["predictions"]
    assert [p["index"] for p in source["predictions"]] == [0, 1]
    assert source["primary"]["metric"] == "uptrain_tiny_choice/acc,none" and source["primary"]["higher_is_better"]
    assert source["predictions"][0]["doc"]["question"] == "the cat" and "acc" in source["predictions"][0]
    out = tmp_path / "out"
    assert main(["evaluate", str(built["gpt2"]), *args, "--output-dir", str(out)]) == 0
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "scores.json").read_text())["scores"] == source["scores"]


@pytest.mark.parametrize(
    ("model", "task", "message"),
    [
        ("gpt2", "lm-eval:no_such_task_here", "lm-eval knows no task 'no_such_task_here'"),
        ("gpt2", "lm-eval:missing.yaml", "no task YAML at missing.yaml"),
        ("bart", "lm-eval:{yaml}", "lm-eval tasks run on decoder-only models"),
        ("gpt2", "asr", "--task asr needs a speech encoder–decoder"),
    ],
)
def test_refusals_are_one_line(built, capsys, model, task, message):
    task = task.format(yaml=built["yaml"])
    data = ["--data", str(built["speech"])] if task == "asr" else []
    assert main(["evaluate", str(built[model]), "--task", task, *data]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_compare_scores_library_tasks_and_an_lm_eval_task(setup, built, tmp_path, capsys):  # noqa: F811
    """`uptrain compare --task` with a library-backed task and a local lm-eval task: one column
    each, and every run's predictions kept."""
    import csv

    out = tmp_path / "cmp"
    tasks = ["--task", "translation", f"lm-eval:{built['yaml']}", "--task-data", str(built["pairs"])]
    runs = ["--num-kv-heads", "2", "--pooling", "mean", "--task-max-new-tokens", "3", "--speed-repeats", "0"]
    assert compare(setup, out, *tasks, *runs) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["pooling"] for r in rows] == ["mha", "mean"]
    assert all(float(r["translation:bleu"]) >= 0 for r in rows)
    assert all(0 <= float(r["lm-eval-tiny_task:uptrain_tiny_choice/acc,none"]) <= 1 for r in rows)
    for name in ("mha", "g2-mean"):
        lines = (out / "runs" / name / "tasks" / "lm-eval-tiny_task" / "predictions.jsonl").read_text().splitlines()
        assert [json.loads(line)["doc"]["question"] for line in lines] == ["the cat", "a dog"]
    assert (
        "| G | pooling | translation:bleu | lm-eval-tiny_task:uptrain_tiny_choice/acc,none |"
        in (out / "results.md").read_text()
    )
