"""`uptrain compare --task`: every run's uptrained checkpoint scored with `uptrain evaluate` — one
column per task, the Table-1 view (task scores and time per sample per G and pooling), the
quality-vs-time plot per task (Fig. 3), wandb tables of sample predictions (offline, read back), a
rerun that reuses the scores, and refusals before any work. QA (whose metric needs no library) in
the main environment; the library-backed tasks are `uptrain evaluate`'s tests."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.compare.test_study import compare, setup  # noqa: F401  (the fixture)
from tests.train.test_seq2seq import write_jsonl
from tests.train.test_tracking import leet
from tests.train.train_helpers import make_text


def qa_data(root):
    rows = [{"source": f"who sees {w} ?", "target": w, "answers": [f"the {w}"]} for w in ("king", "queen", "sailor")]
    return write_jsonl(root / "qa.jsonl", rows)


# Two runs (MHA and G = 2 mean: the flags override the helper's lists), short generations and speed.
TASK_ARGS = ["--num-kv-heads", "2", "--pooling", "mean", "--task-max-new-tokens", "3", "--speed-repeats", "1"]
TASK_ARGS += ["--speed-context", "16"]


def test_compare_scores_every_run_on_each_task(setup, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "cmp"
    data = qa_data(tmp_path)
    args = ["--task", "qa", "--task-data", str(data), *TASK_ARGS, "--report-to", "jsonl", "wandb"]
    assert compare(setup, out, *args) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(math.isfinite(float(r["qa:f1"])) for r in rows)
    for name in ("mha", "g2-mean"):
        scores = json.loads((out / "runs" / name / "tasks" / "qa" / "scores.json").read_text())
        lines = (out / "runs" / name / "tasks" / "qa" / "predictions.jsonl").read_text().splitlines()
        assert scores["examples"] == len(lines) == 3 and scores["setting"]["task"] == "qa"
        assert scores["model"].endswith("final")  # the uptrained checkpoint
    text = (out / "results.md").read_text()
    assert "the paper's Table 1" in text and "| G | pooling | qa:f1 | time/sample s |" in text
    assert "qa:f1: higher is better" in text
    assert (out / "task_qa_vs_time_per_sample.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # wandb: the results table has the task's column, and a table of sample predictions per task.
    run_dir = next((out / "wandb").glob("*compare-*"))
    item = next(r["history"]["item"] for r in leet(run_dir) if r["type"] == "history")
    results = json.loads((run_dir / "files" / item["results.path"]).read_text())
    assert results["columns"][-1] == "qa:f1"
    table = json.loads((run_dir / "files" / item["predictions/qa.path"]).read_text())
    assert table["columns"] == ["num_kv_heads", "pooling", "index", "reference", "prediction"]
    assert len(table["data"]) == 2 * 3 and table["data"][0][:4] == [4, "mha", 0, "king"]
    assert [row[1] for row in table["data"]] == ["mha"] * 3 + ["mean"] * 3
    assert item["task_qa_vs_time_per_sample._type"] == "image-file"
    # A rerun reuses every run and every score; a changed task option scores again, training nothing.
    capsys.readouterr()
    assert compare(setup, out, *args) == 0
    printed = capsys.readouterr().out
    assert printed.count("qa scored earlier") == 2 and "scoring qa" not in printed
    assert compare(setup, out, *args, "--task-limit", "2") == 0
    printed = capsys.readouterr().out
    assert printed.count("scoring qa") == 2 and printed.count("finished earlier") == 2
    assert json.loads((out / "runs" / "mha" / "tasks" / "qa" / "scores.json").read_text())["examples"] == 2


def test_task_refusals_come_before_any_work(setup, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "cmp"
    data = str(qa_data(tmp_path))
    for args, message in [
        (["--task", "qa"], "`task_data`: give one file for each --task but lm-eval ones (1), in their order; got 0"),
        (["--task", "qa", "--task-data", str(tmp_path / "none.jsonl")], "none.jsonl does not exist"),
        (["--task", "translation", "--task-data", data], "--task translation needs sacrebleu"),
        (["--task", "lm-eval:x.yaml"], "pip install 'uptrain[eval]'"),
        (["--task", "qa", "--task-data", data, "--task-device", "gpu"], "--device 'gpu'"),
    ]:
        assert compare(setup, out, *args) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not out.exists()
    # Task data in the folder that --overwrite would empty is refused, and stays.
    out.mkdir()
    inside = out / "qa.jsonl"
    inside.write_text(Path(data).read_text())
    assert compare(setup, out, "--task", "qa", "--task-data", str(inside), "--overwrite") == 2
    assert "overlaps the `task_data`" in capsys.readouterr().err and inside.is_file()


BAD_LINES = {
    "not JSON": b'{"source": "who sees the king ?", "target": ',
    "not UTF-8": b'{"source": "who sees the \xff king ?", "target": "king"}',
    "too many digits": b'{"source": "who", "target": "king", "id": ' + b"7" * 5000 + b"}",
    "no target": json.dumps({"source": "who sees the king ?"}).encode(),
    "empty target": json.dumps({"source": "who sees the king ?", "target": " "}).encode(),
    "not an object": b'["who sees the king ?", "king"]',
    "answers not texts": json.dumps({"source": "who ?", "target": "king", "answers": [1]}).encode(),
}


@settings(
    max_examples=6,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.sampled_from(sorted(BAD_LINES)), st.integers(0, 3))
def test_a_bad_line_of_task_data_is_refused_before_any_run(setup, tmp_path_factory, capsys, kind, place):  # noqa: F811
    """A bad line anywhere in the task data is refused in one line, naming it, before anything is
    converted or trained (the scoring would refuse it only once every run had trained)."""
    root = tmp_path_factory.mktemp("bad-line")
    good = [json.dumps({"source": f"who sees {w} ?", "target": w}).encode() for w in ("king", "queen", "sailor")]
    data = root / "qa.jsonl"
    data.write_bytes(b"\n".join(good[:place] + [BAD_LINES[kind]] + good[place:]) + b"\n")
    out = root / "cmp"
    assert compare(setup, out, "--task", "qa", "--task-data", str(data), *TASK_ARGS) == 2
    err = capsys.readouterr().err.strip()
    assert f"qa.jsonl line {place + 1}" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_task_the_model_cannot_run_is_refused_before_any_run(setup, tmp_path, capsys):  # noqa: F811
    """A task for another kind of model (qa on Whisper), or lengths past the model's positions,
    are refused in one line before anything is converted or trained."""
    from tests.train.test_seq2seq import build_model, build_tokenizer

    whisper = build_model("whisper", tmp_path / "whisper", build_tokenizer(make_text(1, 20), sentinels=False))
    data = str(qa_data(tmp_path))
    out = tmp_path / "cmp"
    capsys.readouterr()  # the model's build
    speechless = ["--num-kv-heads", "2", "--pooling", "mean", "--speed-repeats", "0", "--pretrain-tokens", "20480"]
    for model, args, message in [
        (whisper, speechless, "--task qa needs a text model"),
        (
            setup / "mha",
            [*TASK_ARGS, "--task-max-new-tokens", "80"],
            "--max-new-tokens 80 leaves none of the model's 64",
        ),
    ]:
        argv = ["--task", "qa", "--task-data", data, *args, "--model", str(model)]
        assert compare(setup, out, *argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not out.exists()


def test_an_lm_eval_task_in_the_report(tmp_path):
    """The report of a compare with an lm-eval task (whose scores and records lm-eval shapes), made
    from hand-made rows: its column, the Table-1 view, its plot and its wandb table."""
    from tests.compare.test_study import small_spec
    from uptrain.compare.report import write_report
    from uptrain.compare.study import RunResult, _start

    task = "lm-eval:/somewhere/tiny_task.yaml"
    out = tmp_path / "cmp"
    out.mkdir()
    spec = small_spec(out, report_to=["wandb"])
    _start(spec, out)

    def row(name: str, g: int, pooling: str, acc: float, seconds: float) -> RunResult:
        predictions = write_jsonl(
            tmp_path / f"{name}.jsonl",
            [{"index": 0, "reference": 0, "prediction": [[-1.5, False], [-2.0, False]], "acc": acc}],
        )
        primary = {"metric": "tiny/acc,none", "value": acc, "higher_is_better": True}
        summary = {"scores": {"tiny": {"acc,none": acc}}, "primary": primary, "time_per_sample_s": None}
        speed = {"time_per_sample_s": seconds, "decode_tokens_per_s": 8 / seconds, "kv_cache_bytes": 1024 * g}
        speed.update(spread={"time_per_sample_s": {"min": seconds, "max": seconds}}, machine="a CPU")
        speed.update(context=16, new_tokens=4, batch=8, device="cpu", dtype="float32", repeats=1)
        curve = [(0, 5.0), (200, 4.0)]
        tasks = {task: {**summary, "examples": 1, "predictions": str(predictions)}}
        return RunResult(name, g, pooling, 5.0, 4.0, 200, 64 * g, curve, speed, tasks)

    results = [row("mha", 4, "mha", 0.75, 2.0), row("g2-mean", 2, "mean", 0.5, 1.0)]
    files = write_report(results, out, spec)
    column = "lm-eval-tiny_task:tiny/acc,none"
    with open(out / "results.csv") as f:
        assert [r[column] for r in csv.DictReader(f)] == ["0.75", "0.5"]
    text = (out / "results.md").read_text()
    assert f"| G | pooling | {column} | time/sample s |" in text and "| 2 | mean | 0.5 | 1.000 |" in text
    assert (out / "task_lm-eval-tiny_task_vs_time_per_sample.png").is_file()
    item = next(r["history"]["item"] for r in leet(files["wandb"]) if r["type"] == "history")
    table = json.loads((files["wandb"] / "files" / item["predictions/lm-eval-tiny_task.path"]).read_text())
    assert table["data"] == [
        [4, "mha", 0, "0", "[[-1.5, false], [-2.0, false]]"],
        [2, "mean", 0, "0", "[[-1.5, false], [-2.0, false]]"],
    ]


def test_each_task_is_scored_with_the_runs_prompt_keys(tmp_path):
    """compare's prompt keys (train's data group, which its runs are trained with) reach evaluate:
    every run's checkpoint is scored with the prompt it was trained on; lm-eval tasks take none."""
    from uptrain.compare.spec import CompareSpec
    from uptrain.compare.task_rows import evaluate_options, task_settings
    from uptrain.options import validated

    data = str(qa_data(tmp_path))
    keys = {"source_lang": "deu_Latn", "target_lang": "spa_Latn"}
    spec = validated(
        CompareSpec,
        "compare",
        model="m",
        num_kv_heads=[2],
        output_dir="o",
        max_steps=1,
        task=["qa"],
        task_data=[data],
        **keys,
    )
    (setting,) = task_settings(spec)
    assert {k: setting[k] for k in ("language", "speech_task", *keys)} == {
        "language": None,
        "speech_task": None,
        **keys,
    }
    prompt = evaluate_options("final", setting).prompt_keys()
    assert (prompt.source_lang, prompt.target_lang, prompt.language) == ("deu_Latn", "spa_Latn", None)
