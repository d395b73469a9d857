"""scripts/recovery_study.py --quick end to end on the shipped reference model: real conversions,
real uptraining (compare's machinery and a distilled run), and a JSON whose numbers agree with
each other (targets from the curves, tokens-to-reach the first evaluation at or below them)."""

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

    # A rerun picks up every finished run and reports the same study.
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(out)], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == study
    assert "finished earlier" in again.stderr
