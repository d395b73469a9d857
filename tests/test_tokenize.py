"""`uptrain tokenize`: the blocks training would build, read back with no tokenizing; a run killed
at every shard write resumes to the same bytes; one run per OUT; bad input refused in one line."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.train.train_helpers import build_llama, build_tokenizer, make_text, python_env, records, reset_accelerate
from uptrain import UptrainError
from uptrain.cli import main
from uptrain.data.blocks import Blocks
from uptrain.data.shards import INDEX, TokenShards
from uptrain.data.spec import TokenizeOptions
from uptrain.data.text import MAP_BATCH, TokenBlocks, load_blocks
from uptrain.data.tokenize import tokenize

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("shard_records")  # training reads the folders: shard checks recorded privately
# 3 shards of the .jsonl corpus (3 packing batches of 1809, 1808 and 902 blocks): the second
# shard starts inside the first batch, the third inside the second.
SHARD_TOKENS = 16 * 1700


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A .txt corpus, the same paragraphs as two .jsonl files (more documents than one packing
    batch, split off its boundary), a tiny Llama with its tokenizer, one with another tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    text = make_text(1, 300)
    (root / "train.txt").write_text(text)
    (root / "eval.txt").write_text(make_text(2, 40))
    docs = make_text(3, 2 * MAP_BATCH + 500).split("\n\n")
    (root / "jsonl").mkdir()
    cut = MAP_BATCH + 300
    for name, part in (("a.jsonl", docs[:cut]), ("b.jsonl", docs[cut:])):
        (root / "jsonl" / name).write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(part)))
    tokenizer = build_tokenizer(text + make_text(2, 40) + "\n".join(docs))
    model = build_llama(root / "model", tokenizer, num_kv_heads=2)
    other = build_llama(root / "other", build_tokenizer(text, eos="<end>"), num_kv_heads=2)
    return {"root": root, "txt": root / "train.txt", "eval": root / "eval.txt", "jsonl": root / "jsonl",
            "model": model, "other": other, "tokenizer": tokenizer}  # fmt: skip


def options(data, out, model, **more) -> TokenizeOptions:
    return TokenizeOptions(data=str(data), out=str(out), tokenizer=str(model), **{"seq_len": 16, **more})


def all_blocks(blocks: Blocks) -> torch.Tensor:
    return blocks.take(list(range(len(blocks))))


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_blocks_are_the_ones_training_builds(corpus, tmp_path, kind):
    out = tokenize(options(corpus[kind], tmp_path / "tokens", corpus["model"], shard_tokens=16 * 100), progress=False)
    common = dict(split="train", dataset_config=None, text_field="text", sample_by="paragraph", workers=None)
    expected, _ = load_blocks(str(corpus[kind]), "train_data", corpus["tokenizer"], 16, streaming=False, **common)
    read, source = load_blocks(str(out), "train_data", corpus["tokenizer"], 16, streaming=None, **common)
    assert isinstance(read, TokenShards) and isinstance(expected, TokenBlocks) and len(read) == len(expected) > 200
    assert torch.equal(all_blocks(read), all_blocks(expected))
    assert all_blocks(read).dtype == torch.int64
    index = json.loads((out / INDEX).read_text())
    assert index["blocks"] == len(expected) and index["dtype"] == "uint16"
    assert len(index["shards"]) == -(-len(expected) // 100) > 1
    assert [f["file"] for f in index["data"]["files"]] == (["train.txt"] if kind == "txt" else ["a.jsonl", "b.jsonl"])
    assert index["tokenizer"]["name"] == "model" and str(tmp_path) not in (out / INDEX).read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted([INDEX] + [s["name"] for s in index["shards"]])
    # Random access across shards, as training's shuffled order reads it.
    order = torch.randperm(len(read), generator=torch.Generator().manual_seed(0)).tolist()[:64]
    assert torch.equal(read.take(order), expected.take(order))
    # A DataLoader worker gets the paths, not the bytes, and maps the shards itself.
    copy = pickle.loads(pickle.dumps(read))
    shard_bytes = sum(p.stat().st_size for p in out.glob("*.bin"))
    assert len(pickle.dumps(read)) < shard_bytes / 10 and torch.equal(copy.take(order), expected.take(order))


def test_data_given_as_files_on_the_command_line(corpus, tmp_path, capsys):
    files = [str(corpus["jsonl"] / "a.jsonl"), str(corpus["jsonl"] / "b.jsonl")]
    argv = ["tokenize", *files, str(tmp_path / "files"), "--tokenizer", str(corpus["model"]), "--seq-len", "16"]
    assert main(argv) == 0 and f"wrote {tmp_path / 'files'}" in capsys.readouterr().out
    folder = tokenize(options(corpus["jsonl"], tmp_path / "folder", corpus["model"]), progress=False)
    assert folder_bytes(tmp_path / "files") == folder_bytes(folder)


def train_config(corpus, tmp_path, train_data, name, model=None) -> dict:
    return {
        "model": str(model or corpus["model"]),
        "train_data": str(train_data),
        "eval_data": str(corpus["eval"]),
        "output_dir": str(tmp_path / name),
        "seq_len": 16,
        "batch_size": 4,
        "lr": 3e-3,
        "warmup_steps": 1,
        "max_steps": 4,
        "eval_every": 2,
        "save_every": 100,
        "eval_blocks": 4,
        "report_to": ["jsonl"],
    }


def test_training_on_a_tokenized_folder_equals_training_on_the_text(corpus, tmp_path):
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training

    tokens = tokenize(options(corpus["jsonl"], tmp_path / "tokens", corpus["model"], shard_tokens=16 * 500), False)
    eval_tokens = tokenize(options(corpus["eval"], tmp_path / "eval-tokens", corpus["model"]), progress=False)
    losses = {}
    runs = (("run-raw", corpus["jsonl"], corpus["eval"]), ("run-tokens", tokens, eval_tokens))
    for name, train_data, eval_data in runs:
        config = {**train_config(corpus, tmp_path, train_data, name), "eval_data": str(eval_data)}
        run_training(TrainConfig(**config))
        reset_accelerate()
        losses[name] = [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in records(tmp_path / name)]
    assert len(losses["run-raw"]) == 5 and losses["run-tokens"] == losses["run-raw"]


def test_training_refuses_a_folder_of_another_tokenizer_or_seq_len(corpus, tmp_path):
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training

    tokens = tokenize(options(corpus["txt"], tmp_path / "tokens", corpus["model"]), progress=False)
    with pytest.raises(UptrainError, match=r"tokenized with tokenizer 'model', which is not the model's") as err:
        run_training(TrainConfig(**train_config(corpus, tmp_path, tokens, "other", model=corpus["other"])))
    assert "\n" not in str(err.value)
    reset_accelerate()
    with pytest.raises(UptrainError, match="tokenized into blocks of 16 tokens, this run's seq_len is 32"):
        run_training(TrainConfig(**{**train_config(corpus, tmp_path, tokens, "long"), "seq_len": 32}))
    reset_accelerate()


# Tokenizes argv[1] into argv[2] and, at the step named by argv[4] (`event:shard`), SIGKILLs itself
# (a deterministic kill -9) or, for `pause`, announces it in argv[5] and waits.
KILLER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from uptrain.data.spec import TokenizeOptions
    from uptrain.data.tokenize import tokenize

    data, out, model, at, action = sys.argv[1:6]

    def step(event, shard):
        if f"{event}:{shard}" == at:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            Path(out + ".paused").write_text("")
            time.sleep(120)

    tokenize(TokenizeOptions(data=data, out=out, tokenizer=model, seq_len=16, shard_tokens=int(sys.argv[6])),
             progress=False, on_step=step)
""")


def run_killer(corpus, out: Path, at: str, action: str = "kill") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", KILLER, str(corpus["jsonl"]), str(out), str(corpus["model"]), at, action,
         str(SHARD_TOKENS)],
        cwd=ROOT, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_killed_at_every_shard_write_resumes_to_the_same_bytes(corpus, tmp_path):
    reference = tokenize(
        options(corpus["jsonl"], tmp_path / "reference", corpus["model"], shard_tokens=SHARD_TOKENS), False
    )
    shards = json.loads((reference / INDEX).read_text())["shards"]
    assert len(shards) == 3
    out = tmp_path / "tokens"
    points = [f"{event}:{i}" for i in range(len(shards)) for event in ("shard-written", "shard-renamed")]
    for at in [*points, "index-written:-1", "done"]:
        proc = run_killer(corpus, out, at)
        _, stderr = proc.communicate(timeout=300)
        if at == "done":
            assert proc.returncode == 0, stderr
        else:
            assert proc.returncode == -9, (at, stderr)
            assert not out.exists(), at  # OUT appears only complete
    assert folder_bytes(out) == folder_bytes(reference)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left beside it


def test_a_second_run_to_one_out_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "tokens"
    first = run_killer(corpus, out, "shard-written:1", action="pause")
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{out}.paused").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        code = main(
            ["tokenize", str(corpus["jsonl"]), str(out), "--tokenizer", str(corpus["model"]), "--seq-len", "16"]
        )
        err = capsys.readouterr().err
        assert code == 2 and "is being written by another uptrain run (pid" in err and err.count("\n") == 1, err
    finally:
        first.kill()
        first.communicate()
    # The killed first run's shard 0 is kept; the same command finishes the job.
    done = tokenize(options(corpus["jsonl"], out, corpus["model"], shard_tokens=SHARD_TOKENS), progress=False)
    reference = tokenize(
        options(corpus["jsonl"], tmp_path / "reference", corpus["model"], shard_tokens=SHARD_TOKENS), False
    )
    assert folder_bytes(done) == folder_bytes(reference)


def refused(capsys, *argv: str) -> str:
    code = main(["tokenize", *argv])
    err = capsys.readouterr().err
    # The one line, after whatever the progress bar drew (on its own line, with \r).
    lines = [line for line in err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("uptrain tokenize: error: "), err
    return lines[0]


def test_bad_input_is_one_line_and_writes_nothing(corpus, tmp_path, capsys):
    model, out = str(corpus["model"]), str(tmp_path / "out")
    (tmp_path / "data").mkdir()
    empty = tmp_path / "data" / "empty.jsonl"
    empty.write_text("")
    short = tmp_path / "data" / "short.txt"
    short.write_text("the cat sees the river\n")
    cases = {
        "does not exist": [str(tmp_path / "missing.jsonl"), out, "--tokenizer", model, "--seq-len", "16"],
        "is empty": [str(empty), out, "--tokenizer", model, "--seq-len", "16"],
        "`uptrain tokenize` reads local text": ["some/dataset", out, "--tokenizer", model, "--seq-len", "16"],
        "has no column `body`": [str(corpus["jsonl"]), out, "--tokenizer", model, "--seq-len", "16",
                                 "--text-field", "body"],
        "gives no block of 16 tokens": [str(short), out, "--tokenizer", model, "--seq-len", "16"],
        "has no usable tokenizer": [str(corpus["txt"]), out, "--tokenizer", str(tmp_path / "nomodel"),
                                    "--seq-len", "16"],
        "must be at least 2": [str(corpus["txt"]), out, "--tokenizer", model, "--seq-len", "1"],
        "overlaps the DATA": [str(corpus["jsonl"]), str(corpus["jsonl"] / "tokens"), "--tokenizer", model,
                              "--seq-len", "16"],
    }  # fmt: skip
    for message, argv in cases.items():
        assert message in refused(capsys, *argv), message
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data"], message
    assert sorted(p.name for p in corpus["jsonl"].iterdir()) == ["a.jsonl", "b.jsonl"]

    done = tokenize(options(corpus["txt"], out, model), progress=False)
    assert "already exists; pass --overwrite" in refused(capsys, str(corpus["txt"]), out, "--tokenizer", model,
                                                        "--seq-len", "16")  # fmt: skip
    assert "is already tokenized" in refused(capsys, str(done), str(tmp_path / "again"), "--tokenizer", model,
                                             "--seq-len", "16")  # fmt: skip


def test_an_interrupted_run_with_other_settings_is_refused_unless_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "tokens"
    proc = run_killer(corpus, out, "shard-renamed:1")
    proc.communicate(timeout=300)
    assert proc.returncode == -9
    argv = [str(corpus["jsonl"]), str(out), "--tokenizer", str(corpus["model"]), "--seq-len", "8"]
    err = refused(capsys, *argv)
    assert "cannot resume the interrupted `uptrain tokenize` to" in err and "pass --overwrite to start over" in err
    assert "its settings changed (seq_len: 16 → 8; blocks_per_shard: " in err
    assert main(["tokenize", *argv, "--overwrite"]) == 0
    assert json.loads((out / INDEX).read_text())["seq_len"] == 8


@pytest.fixture(scope="module")
def txt_reference(corpus, tmp_path_factory) -> Path:
    """The .txt corpus tokenized with the default options, uninterrupted."""
    return tokenize(options(corpus["txt"], tmp_path_factory.mktemp("txt") / "tokens", corpus["model"]), False)


@pytest.mark.parametrize("damage", ["digits", "shards", "next", "not utf-8"])
def test_a_damaged_progress_record_starts_over(corpus, txt_reference, tmp_path, damage):
    """A progress.json a hand or a disk damaged (a number past Python's 4,300 digits, shards or the
    resume point of the wrong type, bytes that are not UTF-8) is not resumed from: the run starts
    over and writes the same folder."""
    reference = txt_reference
    out = tmp_path / "tokens"
    partial = tmp_path / ".tokens.uptrain-partial"
    partial.mkdir()
    state = json.loads((reference / INDEX).read_text())
    state["next"] = {"batch": 0, "block": 0}
    raw = {
        "digits": json.dumps({**state, "seq_len": 0}).replace('"seq_len": 0', '"seq_len": 1' + "0" * 4400).encode(),
        "shards": json.dumps({**state, "shards": 5}).encode(),
        "next": json.dumps({**state, "next": {"batch": "x"}}).encode(),
        "not utf-8": b'{"seq_len": "\xff"}',
    }[damage]
    (partial / "progress.json").write_bytes(raw)
    tokenize(options(corpus["txt"], out, corpus["model"]), progress=False)
    assert folder_bytes(out) == folder_bytes(reference) and not partial.exists()
