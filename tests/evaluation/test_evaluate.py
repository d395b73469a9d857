"""`uptrain evaluate` in the main environment (no metric library installed): QA's exact match and
F1 (SQuAD's, written here) on tiny real models, a G = h conversion scoring exactly what its
source scores, predictions kept, and one-line refusals — the missing `uptrain[eval]` extra among
them. The library-backed metrics run in their own environment (test_metric_libraries.py)."""

from __future__ import annotations

import json

import pytest

from tests.evaluation.models import build_all, convert, evaluate_json
from uptrain.cli import main
from uptrain.evaluation.scores import answer_f1, normalize_answer, qa_example_scores, qa_scores


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_all(tmp_path_factory.mktemp("evaluate"))


def test_squad_normalisation_and_scores():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    assert answer_f1("the big cat", "a cat sat") == 0.5  # one common token of two each
    assert answer_f1("", "cat") == 0.0
    assert qa_example_scores("Cat!", ["dog", "the cat"]) == {"exact_match": 1.0, "f1": 1.0}
    assert qa_example_scores("a cat", ["cat sat down"]) == {"exact_match": 0.0, "f1": 0.5}
    assert qa_scores([{"exact_match": 1.0, "f1": 1.0}, {"exact_match": 0.0, "f1": 0.5}]) == {
        "exact_match": 50.0,
        "f1": 75.0,
    }


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bart"])
def test_a_conversion_at_g_equal_h_scores_what_its_source_scores(built, kind, capsys):
    args = ("--task", "qa", "--data", str(built["qa"]), "--max-new-tokens", "6", "--batch-size", "4")
    source = evaluate_json(str(built[kind]), *args, capsys=capsys)
    converted = evaluate_json(str(built[f"{kind}-gqa"]), *args, capsys=capsys)
    assert source["examples"] == converted["examples"] == 6
    assert [p["prediction"] for p in converted["predictions"]] == [p["prediction"] for p in source["predictions"]]
    assert converted["scores"] == source["scores"] and converted["primary"] == source["primary"]
    assert source["primary"]["metric"] == "f1" and source["time_per_sample_s"] > 0
    # Each example's record: its place, source, reference, prediction and its own scores.
    first = source["predictions"][0]
    assert first["where"].endswith("qa.jsonl line 1") and first["source"].startswith("who :")
    assert set(first) >= {"reference", "prediction", "exact_match", "f1"}
    assert qa_scores(source["predictions"]) == source["scores"]  # the mean of the examples' scores


def test_the_comparison_can_fail(built, tmp_path, capsys):
    """A G = 1 mean-pooled conversion generates other tokens than its source: the equality above is not
    one that holds for any model."""
    args = ("--task", "qa", "--data", str(built["qa"]), "--max-new-tokens", "6")
    mqa = convert(built["llama"], tmp_path / "llama-mqa", 1)
    source = evaluate_json(str(built["llama"]), *args, capsys=capsys)
    pooled = evaluate_json(str(mqa), *args, capsys=capsys)
    assert [p["prediction"] for p in pooled["predictions"]] != [p["prediction"] for p in source["predictions"]]


def test_an_mla_conversion_is_evaluated_as_transformers_loads_it(built, tmp_path, capsys):
    """An `uptrain convert --target mla` output (DeepSeek-V2 layout) is evaluated like any causal LM:
    from a one-KV-head source at full rank, every rotary column kept, it generates its source's tokens."""
    from uptrain.convert import convert_checkpoint

    mqa = convert(built["llama"], tmp_path / "llama-mqa", 1)  # 4 heads × 8, hidden 32
    mla = convert_checkpoint(mqa, tmp_path / "llama-mla", target="mla", kv_rank=32, rope_dims=8, source_hash="none")
    args = ("--task", "qa", "--data", str(built["qa"]), "--max-new-tokens", "6", "--batch-size", "4")
    source = evaluate_json(str(mqa), *args, capsys=capsys)
    latent = evaluate_json(str(mla), *args, capsys=capsys)
    assert json.loads((mla / "config.json").read_text())["model_type"] == "deepseek_v2"
    assert latent["examples"] == 6
    assert [p["prediction"] for p in latent["predictions"]] == [p["prediction"] for p in source["predictions"]]
    assert latent["scores"] == source["scores"]


def test_writes_scores_and_predictions_and_limit(built, tmp_path, capsys):
    out = tmp_path / "scores"
    args = ["evaluate", str(built["bart"]), "--task", "qa", "--data", str(built["qa"]), "--max-new-tokens", "4"]
    assert main([*args, "--limit", "2", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "on qa (2 examples)" in printed and "f1:" in printed and "time per sample" in printed
    scores = json.loads((out / "scores.json").read_text())
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert scores["examples"] == len(lines) == 2 and "predictions" not in scores
    assert [line["index"] for line in lines] == [0, 1]
    assert main([*args, "--output-dir", str(out)]) == 2  # an existing folder is refused …
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--output-dir", str(out), "--overwrite"]) == 0  # … unless asked
    assert json.loads((out / "scores.json").read_text())["examples"] == 6
    # Never the model's folder (nor one holding it or its data), --overwrite or not.
    assert main([*args, "--output-dir", str(built["bart"]), "--overwrite"]) == 2
    assert "overlaps the model" in capsys.readouterr().err and (built["bart"] / "config.json").is_file()


@pytest.mark.parametrize(
    ("task", "library"),
    [("translation", "sacrebleu"), ("summarization", "rouge-score"), ("asr", "jiwer"), ("lm-eval:x.yaml", "lm-eval")],
)
def test_a_missing_library_is_one_line_naming_the_extra(built, tmp_path, capsys, task, library):
    data = [] if task.startswith("lm-eval") else ["--data", str(built["pairs"])]
    out = tmp_path / "out"
    assert main(["evaluate", str(built["bart"]), "--task", task, *data, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    needs = f"--task {task} needs {library}, which is not installed: pip install 'uptrain[eval]'"
    assert err == f"uptrain evaluate: error: {needs}"
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "qa"], "`data` is required for --task qa"),
        (["--task", "quiz", "--data", "x"], "unknown task 'quiz'; choose from asr, translation"),
        (["--task", "lm-eval:"], "name the lm-eval task after lm-eval:"),
        (["--task", "qa", "--data", "missing.jsonl"], "`data`: missing.jsonl does not exist"),
        (["--task", "qa", "--data", "{pairs}", "--max-new-tokens", "200"], "beyond the decoder's 64 positions"),
        (["--task", "qa", "--data", "{speech}"], "line 1: no `target` field"),
        (["--task", "qa", "--data", "{pairs}", "--num-fewshot", "2"], "`num_fewshot` is for lm-eval tasks"),
        (["--task", "lm-eval:x", "--max-new-tokens", "2"], "`max_new_tokens`: an lm-eval task sets its own lengths"),
    ],
)
def test_refusals_are_one_line(built, capsys, args, message):
    args = [a.format(**{k: str(v) for k, v in built.items()}) for a in args]
    assert main(["evaluate", str(built["bart"]), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_refuses_a_model_the_task_cannot_run_on(built, capsys):
    assert main(["evaluate", str(built["whisper"]), "--task", "qa", "--data", str(built["qa"])]) == 2
    assert "--task qa needs a text model" in capsys.readouterr().err


@pytest.mark.parametrize("positions", [8, 64])
def test_a_whisper_with_few_decoder_positions_gets_new_tokens_that_fit(built, tmp_path, positions):
    """The decoder holds its start and Whisper's prompt before the tokens generated: the default
    --max-new-tokens is clamped to what is left, and an asked number that does not fit is refused
    naming --max-new-tokens and the numbers (it named `target_len`, which evaluate has no flag
    for; issue #34). Through evaluate's own steps: the asr metric's library is not installed here."""
    import shutil

    from uptrain import UptrainError, loading
    from uptrain.evaluation import run
    from uptrain.evaluation.tasks import get_task
    from uptrain.model_info import read_config
    from uptrain.options import validated
    from uptrain.speed_checks import model_shape

    folder = tmp_path / "whisper"
    shutil.copytree(built["whisper"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_target_positions": positions}))
    task, config = get_task("asr"), read_config(folder)
    shape, tokenizer = model_shape(folder, "whisper"), loading.load_tokenizer(folder, "model")

    def steps(**asked):
        options = validated(
            run.EvaluateOptions, "evaluate", model=str(folder), task="asr", data=str(built["speech"]), **asked
        )
        framing = run._framing(options, task, tokenizer, folder, config)
        new = run._new_tokens(options, shape, framing)
        seq_len = run._source_length(options, shape, new)
        return new, run._read_examples(options, task, tokenizer, folder, config, seq_len, new, framing)

    ahead = 1  # the decoder start; this tokenizer's Whisper prompt adds no tokens
    new, examples = steps()
    assert new == min(run.DEFAULT_NEW_TOKENS, positions - ahead) and len(examples.targets) == 3  # the three tones
    assert steps(max_new_tokens=positions - ahead)[0] == positions - ahead
    with pytest.raises(UptrainError) as err:
        steps(max_new_tokens=positions)
    assert str(err.value) == (
        f"whisper: --max-new-tokens {positions} + the prompt <s> (1 token) = {positions + 1} is beyond the "
        f"decoder's {positions} positions; use --max-new-tokens {positions - 1} or fewer"
    )
