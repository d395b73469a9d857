"""`uptrain compare` resumes from whatever a kill, a full disk or a hand leaves, and only from a
compare made as this one is (issue #17): its files are written whole under its own lock, a
rerun with other settings is refused in one line (unless --overwrite), damaged records are made
again, its output_dir never overlaps its inputs, and its wandb group is its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.robustness.compare_helpers import compare_argv, leftovers, results, run_compare_cli
from tests.robustness.faults import EVERY_STEP, run_and_kill_at
from tests.robustness.opened_files import _writes
from tests.robustness.test_kill_anywhere import snapshot
from tests.train.train_helpers import reset_accelerate
from uptrain.checkpoint.atomic import OutputLock
from uptrain.cli import main

# The training runs' and conversions' own folders: their kills are test_kill_anywhere's.
NOT_COMPARES = ("runs/mha/train", "runs/g2-calibrated/train", "converted/g2-calibrated")


@pytest.fixture(scope="module")
def finished(assets, tmp_path_factory) -> Path:
    """One finished compare, copied by each test that changes it."""
    out = tmp_path_factory.mktemp("finished") / "cmp"
    assert run_compare_cli(assets, out) == 0
    return out


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    out = tmp_path / "cmp"
    shutil.copytree(finished, out)
    return out


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("uptrain compare: error: "), err
    return last


def compare_steps(root: Path, body) -> list[tuple[str, str]]:
    """The file-system steps under `root` of `body()` run to the end (in a fork, as
    `run_and_kill_at` counts them): (audit event, path relative to root), in order."""
    record = root.parent / f"{root.name}.steps"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            prefix = str(root.absolute()) + os.sep
            steps = []

            def hook(event: str, args: tuple) -> None:
                if event not in EVERY_STEP or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
                    return
                if event == "open" and not _writes(args[1], args[2] if len(args) > 2 else 0):
                    return
                path = str(Path(os.fsdecode(args[0])).absolute())
                if (path + os.sep).startswith(prefix):
                    steps.append((event, path[len(prefix) :]))

            sys.addaudithook(hook)
            code = body()
            record.write_text(json.dumps(steps))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return [tuple(s) for s in json.loads(record.read_text())]


@pytest.mark.parametrize("kind", ["compare files", pytest.param("every step", marks=pytest.mark.slow)])
def test_compare_killed_at_every_step_resumes_to_the_same_results(assets, finished, tmp_path, kind):
    """kill -9 at each file-system step of the compare's own files (the lock, compare.json,
    calibration.safetensors, each result.json, the report): the same command then ends with the
    results of a compare never killed, and nothing left behind. Under -m slow, at every step of
    its conversions and training runs too."""
    out = tmp_path / "cmp"
    steps = compare_steps(out, lambda: run_compare_cli(assets, out))
    renamed = {path.split(".uptrain-tmp-")[0] for event, path in steps if event == "os.rename"}
    assert {".compare.json", ".calibration.safetensors", "runs/mha/.result.json", ".results.csv"} <= renamed
    kill_at = [n for n, (_, path) in enumerate(steps, 1) if kind == "every step" or not path.startswith(NOT_COMPARES)]
    expected = results(finished)
    for n in kill_at:
        shutil.rmtree(out, ignore_errors=True)
        code, _ = run_and_kill_at(n, out, lambda: run_compare_cli(assets, out))
        assert code == -signal.SIGKILL, f"step {n} {steps[n - 1]}: the child was not killed ({code})"
        assert run_compare_cli(assets, out) == 0, f"killed at step {n} {steps[n - 1]}"
        assert results(out) == expected, f"killed at step {n} {steps[n - 1]}"
        assert leftovers(out) == [], f"killed at step {n} {steps[n - 1]}: {leftovers(out)}"


# Damaged records: what a disk or a hand may leave (a kill no longer can). Each is made again.


def test_a_damaged_result_is_made_again_from_its_run(tmp_path, assets, finished, capsys):
    # A compare of its own: the run is resumed, and a run resumes only where it was made.
    copy = tmp_path / "cmp"
    assert run_compare_cli(assets, copy) == 0
    record = copy / "runs" / "g2-calibrated" / "result.json"
    good = record.read_bytes()

    @settings(
        max_examples=12,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(
        st.one_of(
            st.integers(0, len(good) - 1).map(lambda n: good[:n]),  # cut short
            st.sampled_from(
                [
                    b"[]",
                    b"{}",
                    b"null",
                    b"\xff\xfe",
                    b'{"name": 1}',
                    good.replace(b'"calibrated"', b'"mean"'),
                    good.replace(b'"curve": [', b'"curve": 7, "x": ['),
                    b'{"name": ' + b"9" * 5000 + b"}",
                ]
            ),
        )
    )
    def damaged(data: bytes) -> None:
        record.write_bytes(data)
        capsys.readouterr()
        assert run_compare_cli(assets, copy) == 0
        assert f"{record} is " in (out := capsys.readouterr().out) and "making it again from the run" in out
        assert record.read_bytes() == good and results(copy) == results(finished)

    damaged()


@pytest.mark.parametrize("damage", ["empty", "cut short", "not safetensors", "no description", "description not JSON"])
def test_a_damaged_calibration_is_computed_again(copy, assets, finished, capsys, damage):
    from safetensors.torch import load_file, save_file

    path = copy / "calibration.safetensors"
    moments = load_file(path)
    # The calibrated run is made again: its conversion needs the calibration.
    shutil.rmtree(copy / "converted" / "g2-calibrated")
    shutil.rmtree(copy / "runs" / "g2-calibrated")
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "cut short":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "not safetensors":
        path.write_bytes(b"not a safetensors file at all")
    elif damage == "no description":  # what an older compare killed between its two writes left
        save_file(moments, path)
    else:
        save_file(moments, path, metadata={"info": "{not json"})
    capsys.readouterr()
    assert run_compare_cli(assets, copy) == 0
    assert "calibrating again" in capsys.readouterr().out
    assert results(copy) == results(finished)
    assert load_file(path).keys() == moments.keys()


# Settings: a rerun continues only a compare made the same way.


def test_a_rerun_with_other_settings_is_refused_in_one_line(copy, assets, capsys):
    before = snapshot(copy)
    assert run_compare_cli(assets, copy, "--lr", "0.01") == 2
    message = one_line(capsys)
    assert "settings changed (lr: 0.001 → 0.01)" in message and "--overwrite" in message
    assert snapshot(copy) == before  # compare.json included: nothing rewritten


def test_overwrite_starts_over_with_the_new_settings(copy, assets, finished):
    group = json.loads((copy / "compare.json").read_text())["wandb_group"]
    assert run_compare_cli(assets, copy, "--lr", "0.01", "--overwrite") == 0
    assert results(copy) != results(finished)
    record = json.loads((copy / "compare.json").read_text())
    assert record["lr"] == 0.01 and record["wandb_group"] != group  # a new compare: a new group
    assert run_compare_cli(assets, copy, "--lr", "0.01") == 0  # and it resumes as itself


def test_operational_changes_reuse_the_finished_runs(copy, assets, finished, capsys):
    """Another set of runs, another reporter or evaluation cadence: every run is still made alike."""
    capsys.readouterr()
    assert run_compare_cli(assets, copy, "--report-to", "none", "--eval-every", "1") == 0
    assert capsys.readouterr().out.count("finished earlier") == 2
    assert results(copy) == results(finished)


@pytest.mark.parametrize("record", [b"", b"{", b"[1, 2]", b'{"lr": ' + b"9" * 5000 + b"}", None])
def test_a_damaged_or_missing_compare_record_is_refused_in_one_line(copy, assets, capsys, record):
    if record is None:
        (copy / "compare.json").unlink()  # a folder of results, but not one this compare can vouch for
    else:
        (copy / "compare.json").write_bytes(record)
    before = snapshot(copy)
    assert run_compare_cli(assets, copy) == 2
    message = one_line(capsys)
    assert ("something else" if record is None else "cannot resume") in message and "--overwrite" in message
    assert snapshot(copy) == before


def test_a_folder_of_something_else_is_refused(tmp_path, assets, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run_compare_cli(assets, out) == 2
    assert "already holds files of something else" in one_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# The lock and the overlap rule: nothing written before either refuses.


def test_a_second_compare_is_refused_before_it_writes(copy, assets, capsys):
    before = snapshot(copy)
    with OutputLock(copy / ".uptrain-lock", copy):  # as a compare (or `uptrain train`) in progress holds it
        assert run_compare_cli(assets, copy, "--lr", "0.5") == 2
        assert "is being written by another uptrain run" in one_line(capsys)
    assert snapshot(copy) == before


@pytest.mark.parametrize("key", ["model", "train_data", "eval_data"])
@pytest.mark.parametrize("relation", ["same", "inside", "around"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_output_dir_never_overlaps_an_input(tmp_path, assets, capsys, key, relation, overwrite):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    model, train, evaluation = inputs / "mha", inputs / "train.txt", inputs / "eval.txt"
    shutil.copytree(assets["mha"], model)
    shutil.copyfile(assets["train"], train)
    shutil.copyfile(assets["eval"], evaluation)
    path = {"model": model, "train_data": train, "eval_data": evaluation}[key]
    if relation == "inside" and path.is_file():
        pytest.skip("nothing lies inside a file")
    out = {"same": path, "inside": path / "cmp", "around": inputs}[relation]
    mine = {"mha": model, "train": train, "eval": evaluation}
    argv = compare_argv(mine, out, *(["--overwrite"] if overwrite else []))
    before = snapshot(inputs)
    assert main(argv) == 2
    assert "overlaps the" in one_line(capsys)
    assert snapshot(inputs) == before and sorted(p.name for p in inputs.iterdir()) == ["eval.txt", "mha", "train.txt"]


# wandb: one group per compare.


def test_two_compares_of_one_name_have_their_own_wandb_groups(assets, finished, tmp_path):
    other = tmp_path / "elsewhere" / finished.name
    assert run_compare_cli(assets, other) == 0

    def groups(out: Path) -> set[str]:
        recorded = {json.loads((out / "compare.json").read_text())["wandb_group"]}
        return recorded | {
            yaml.safe_load((run / "train" / "run_config.yaml").read_text())["wandb_group"]
            for run in (out / "runs").iterdir()
        }

    first, second = groups(finished), groups(other)
    assert len(first) == len(second) == 1 and first != second  # every run of a compare in its group, alone
    assert first.pop().startswith(finished.name + "-")
    # Stable across resumes, and across a move of the folder.
    moved = tmp_path / "moved"
    shutil.move(other, moved)
    assert run_compare_cli(assets, moved) == 0
    assert groups(moved) == second


@pytest.mark.parametrize("spelling", ["relative", "trailing slash", "absolute"])
def test_an_unfinished_run_resumes_however_the_folder_is_spelled(tmp_path, assets, finished, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    assert run_compare_cli(assets, Path("cmp")) == 0
    run = tmp_path / "cmp" / "runs" / "g2-calibrated"
    shutil.rmtree(run / "train" / "final")  # as a kill before the run's end leaves it
    (run / "result.json").unlink()
    other = {"relative": "./x/../cmp", "trailing slash": "cmp/", "absolute": str(tmp_path / "cmp")}[spelling]
    (tmp_path / "x").mkdir()
    assert run_compare_cli(assets, other) == 0  # (a str: Path("cmp/") would drop the slash)
    assert results(tmp_path / "cmp") == results(finished)


def test_a_budget_compare_killed_around_its_allocation_resumes_to_the_same_results(assets, tmp_path):
    """kill -9 as the shared calibration lands (the rerun chooses the allocation from the file), as a
    calibrated allocation's conversion lands (its heads chosen, nothing trained yet) and as its row
    is written: the same command then ends with the results of a compare never
    killed (the heads, the KV bytes, the curves), and nothing left behind."""
    budget = ["--kv-budget", "0.5", "--allocation", "calibrated", "--allocation-cost", "merge"]
    argv = compare_argv(assets, "OUT", *budget)
    at = argv.index("--num-kv-heads")
    del argv[at : at + 2]  # the budget run alone beside MHA

    def body(out: Path) -> int:
        reset_accelerate()
        return main([str(out) if a == "OUT" else a for a in argv])

    out = tmp_path / "cmp"
    steps = compare_steps(out, lambda: body(out))  # run to the end: the results of a compare never killed
    expected = results(out)
    assert ",calibrated,0.5,calibrated," in expected  # the budget row: pooling, budget, allocation
    landing = [
        n
        for n, (event, path) in enumerate(steps, 1)
        if event == "os.rename"
        and path.startswith(
            (
                ".calibration.safetensors",
                "converted/.b0.5-calibrated-calibrated",
                "runs/b0.5-calibrated-calibrated/.result.json",
            )
        )
    ]
    assert len(landing) == 3, steps
    for n in landing:
        shutil.rmtree(out, ignore_errors=True)
        code, _ = run_and_kill_at(n, out, lambda: body(out))
        assert code == -signal.SIGKILL, f"step {n} {steps[n - 1]}: the child was not killed ({code})"
        assert body(out) == 0, f"killed at step {n} {steps[n - 1]}"
        assert results(out) == expected, f"killed at step {n} {steps[n - 1]}"
        assert leftovers(out) == [], f"killed at step {n} {steps[n - 1]}: {leftovers(out)}"
