"""scripts/recovery_study.py --quick end to end on the shipped reference model: real conversions,
real uptraining (compare's machinery and a distilled run), real task scoring (`uptrain evaluate`
on task data the script writes from the corpus' test split), and a JSON whose numbers agree with
each other (targets from the curves, tokens-to-reach the first evaluation at or below them, task
scores from the predictions kept)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "recovery_study.py"


def check_reach(reach: dict, curve: list, target: float) -> None:
    """`reach` names the first evaluation at or below `target`, or none where no evaluation is."""
    assert reach["target"] == target
    if reach["tokens"] is None:
        assert reach["loss"] is None and all(loss > target for _, loss in curve)
        return
    assert [reach["tokens"], reach["loss"]] in curve and reach["loss"] <= target
    before = curve[: curve.index([reach["tokens"], reach["loss"]])]
    assert all(loss > target for _, loss in before)


def check_tasks(study: dict, out: Path) -> None:
    """Every run scored at α = 0 and after uptraining on each task, on the task data the script
    wrote (sources from the test split, one-word answers for next-word), each score the mean of
    the per-example records `uptrain evaluate` kept."""
    slugs = [t["slug"] for t in study["tasks"]]
    assert slugs == ["next-word", "continuation"]
    lines = {s: [json.loads(line) for line in (out / "task-data" / f"{s}.jsonl").open()] for s in slugs}
    assert all(len(examples) == 4 for examples in lines.values())
    assert all(len(e["target"].split()) == 1 and e["target"].isalpha() for e in lines["next-word"])
    runs = {r["name"]: r for r in study["runs"]}
    for name, run in runs.items():
        for when, folder in (("before", "start"), ("after", "final")):
            start = "mha" if name == "mha" else name.removesuffix("-distill")
            place = out / "tasks" / folder / (start if when == "before" else name)
            for task in study["tasks"]:
                score = run["tasks"][when][task["slug"]]
                records = [json.loads(line) for line in (place / task["slug"] / "predictions.jsonl").open()]
                assert [r["reference"] for r in records] == [e["target"] for e in lines[task["slug"]]]
                mean = 100 * sum(r[task["metric"]] for r in records) / len(records)
                assert score["score"] == mean and score["examples"] == 4 and score["time_per_sample_s"] > 0
    # One generated token per next-word example: its prediction is at most one word.
    records = (out / "tasks" / "final" / "g1-mean" / "next-word" / "predictions.jsonl").open()
    assert all(len(json.loads(line)["prediction"].split()) <= 1 for line in records)
    # The distilled run starts where the calibrated one does: its α = 0 scores are those.
    assert runs["g1-calibrated-distill"]["tasks"]["before"] == runs["g1-calibrated"]["tasks"]["before"]


def test_recovery_study_quick(tmp_path):
    out = tmp_path / "study"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(out)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    study = json.loads(lines[-1])
    assert any(line.startswith("g1-calibrated-distill ") for line in lines[:-1]), "the table comes before the JSON"

    runs = {r["name"]: r for r in study["runs"]}
    assert list(runs) == ["mha", "g1-mean", "g1-calibrated", "g1-calibrated-distill"]
    assert [r["distillation"] for r in runs.values()] == [False, False, False, True]
    budget = study["budget_tokens"]
    assert budget >= study["fraction"] * study["pretrain_tokens"]
    for run in runs.values():
        tokens = [t for t, _ in run["curve"]]
        assert tokens[0] == 0 and tokens[-1] == budget and tokens == sorted(set(tokens))
        assert len(tokens) >= 3, "evaluated every --eval-every steps, not only at the ends"
        assert (run["loss_before"], run["loss_after"]) == (run["curve"][0][1], run["curve"][-1][1])

    # The targets are read from the curves: mean's last evaluation, MHA's last plus the margin.
    assert study["targets"]["mha"] == runs["mha"]["loss_after"] + study["mha_margin"]
    assert study["targets"]["mean"] == {"1": runs["g1-mean"]["loss_after"]}
    for run in runs.values():
        check_reach(run["to_mha"], run["curve"], study["targets"]["mha"])
        if run["name"] != "mha":
            check_reach(run["to_mean"], run["curve"], study["targets"]["mean"]["1"])
    assert runs["g1-mean"]["to_mean"]["tokens"] is not None  # mean reaches its own quality by the end
    # Distillation starts from the same calibrated conversion, evaluated on the same blocks...
    assert runs["g1-calibrated-distill"]["loss_before"] == runs["g1-calibrated"]["loss_before"]
    # ...and trains otherwise: the teacher's term changes the updates.
    assert runs["g1-calibrated-distill"]["loss_after"] != runs["g1-calibrated"]["loss_after"]
    assert runs["g1-mean"]["loss_before"] != runs["g1-calibrated"]["loss_before"]

    check_tasks(study, out)

    # A rerun picks up every finished run and task score and reports the same study.
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(out)], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == study
    assert "finished earlier" in again.stderr and "scoring" not in again.stderr
