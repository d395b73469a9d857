"""Generated token folders, valid and damaged: `tokens.json` and the shards `uptrain tokenize` wrote.

For every generated folder, opening it for training either gives exactly the blocks the folder's
bytes hold, each id one the tokenizer makes, or stops with an UptrainError of one line; never
another exception (the IndexError of an id past the embedding, a ValueError of 4,300 digits),
never a read outside the folder, never a write but the record of a verified shard. A decoy with
the shards' very bytes sits beside the folder for links and names to point at.

A flipped bit inside the vocabulary is caught by the shard's digest; an id beyond it, with the
digest made to match, by the id check; a shard is read once per version of the file (the record
of its check, `shard_digests`), and read again once it is written. `uptrain train` refuses a
damaged folder in one line before its output_dir exists.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.robustness.opened_files import files_opened
from tests.train.train_helpers import build_llama, build_tokenizer, make_text
from uptrain import UptrainError
from uptrain.cli import main
from uptrain.data.shards import INDEX, open_token_folder
from uptrain.data.spec import TokenizeOptions
from uptrain.data.tokenize import tokenize

FAST = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SEQ_LEN = 16
BLOCKS_PER_SHARD = 20

_BASE = Path(tempfile.mkdtemp(prefix="uptrain-token-folders-"))
atexit.register(shutil.rmtree, _BASE, ignore_errors=True)  # hypothesis runs examples outside pytest's tmp_path
REFERENCE, MODEL = _BASE / "tokens", _BASE / "model"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
ESCAPES = ["../decoy.bin", "{decoy}", "sub/../../decoy.bin", "./shard-00000.bin", "", ".", "..", "/", "shard-00001.bin"]


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny model and the folder `uptrain tokenize` makes of a corpus for it: 3 shards, the last short."""
    text = make_text(1, 24)  # 42 blocks: shards of 20, 20 and 2 (even counts: read as uint32, they agree)
    tokenizer = build_tokenizer(text)
    (_BASE / "train.txt").write_text(text)
    build_llama(MODEL, tokenizer, num_kv_heads=2)
    options = TokenizeOptions(
        data=str(_BASE / "train.txt"), out=str(REFERENCE), tokenizer=str(MODEL), seq_len=SEQ_LEN,
        shard_tokens=SEQ_LEN * BLOCKS_PER_SHARD,
    )  # fmt: skip
    tokenize(options, progress=False)
    assert len(json.loads((REFERENCE / INDEX).read_text())["shards"]) == 3
    return tokenizer


def reference_rows() -> np.ndarray:
    shards = sorted(REFERENCE.glob("shard-*.bin"))
    return np.concatenate([np.fromfile(p, dtype="<u2").reshape(-1, SEQ_LEN) for p in shards]).astype(np.int64)


@st.composite
def damaged_folders(draw) -> tuple[str, dict]:
    """One way to change the reference folder: (its name, what to do), applied by `make_folder`."""
    index = json.loads((REFERENCE / INDEX).read_text())
    shard = draw(st.integers(0, len(index["shards"]) - 1))
    kind = draw(
        st.sampled_from(
            ["valid", "key", "shard key", "name", "digits", "raw", "flip", "flip and digest", "dtype",
             "blocks_per_shard", "resize", "link out", "swap files"]
        )
    )  # fmt: skip
    change: dict = {"shard": shard}
    if kind == "key":
        key = draw(st.sampled_from(["seq_len", "blocks_per_shard", "dtype", "shards", "tokenizer", "format_version"]))
        change.update(key=key, value=draw(json_values))
    elif kind == "shard key":
        change.update(key=draw(st.sampled_from(["name", "blocks", "blake3"])), value=draw(json_values))
    elif kind == "name":
        change.update(key="name", value=draw(st.sampled_from(ESCAPES)))
    elif kind == "digits":
        change.update(key=draw(st.sampled_from(["seq_len", "blocks_per_shard", "format_version"])))
    elif kind == "raw":
        raw = (REFERENCE / INDEX).read_bytes()
        at = draw(st.integers(0, len(raw) - 1))
        change.update(at=at, byte=draw(st.integers(0, 255)), cut=draw(st.booleans()))
    elif kind in ("flip", "flip and digest"):
        size = (REFERENCE / f"shard-{shard:05d}.bin").stat().st_size
        change.update(at=draw(st.integers(0, size - 1)), bit=draw(st.integers(0, 7)))
    elif kind == "blocks_per_shard":
        change.update(value=draw(st.integers(1, 3 * BLOCKS_PER_SHARD)))
    elif kind == "resize":
        change.update(delta=draw(st.sampled_from([-SEQ_LEN * 2, -2, -1, 1, 2, SEQ_LEN * 2])))
    return kind, change


def make_folder(root: Path, kind: str, change: dict) -> tuple[Path, np.ndarray]:
    """A copy of the reference folder changed as `change` says, and the blocks its bytes hold if it
    is valid (the reference's, or with one token changed)."""
    folder = root / "tokens"
    shutil.copytree(REFERENCE, folder)
    decoy = root / "decoy.bin"
    shutil.copyfile(REFERENCE / "shard-00000.bin", decoy)
    index_path = folder / INDEX
    index = json.loads(index_path.read_text())
    entry = index["shards"][change["shard"]]
    shard_path = folder / entry["name"]
    expected = reference_rows()
    raw = None
    if kind == "key":
        index[change["key"]] = change["value"]
    elif kind in ("shard key", "name"):
        value = change["value"]
        entry[change["key"]] = str(decoy) if value == "{decoy}" else value
    elif kind == "digits":
        key = change["key"]
        raw = json.dumps(index).replace(f'"{key}": {index[key]}', f'"{key}": 1{"0" * 4400}').encode()
    elif kind == "raw":
        data = bytearray(index_path.read_bytes())
        raw = bytes(data[: change["at"]]) if change["cut"] else None
        if not change["cut"]:
            data[change["at"]] = change["byte"]
            raw = bytes(data)
    elif kind in ("flip", "flip and digest"):
        data = bytearray(shard_path.read_bytes())
        data[change["at"]] ^= 1 << change["bit"]
        shard_path.write_bytes(bytes(data))
        if kind == "flip and digest":
            entry["blake3"] = blake3.blake3(bytes(data)).hexdigest()
            token = change["at"] // 2
            flat = expected[change["shard"] * BLOCKS_PER_SHARD :].reshape(-1)
            flat[token] = int.from_bytes(data[2 * token : 2 * token + 2], "little")
    elif kind == "dtype":  # the same bytes read as uint32, the counts made to agree
        index["dtype"], index["blocks_per_shard"] = "uint32", BLOCKS_PER_SHARD // 2
        for s in index["shards"]:
            s["blocks"] //= 2
    elif kind == "blocks_per_shard":
        index["blocks_per_shard"] = change["value"]
    elif kind == "resize":
        data = shard_path.read_bytes()
        delta = change["delta"]
        shard_path.write_bytes(data[:delta] if delta < 0 else data + bytes(delta))
    elif kind == "link out":  # to the decoy, to the reference folder's own shard, or a loop
        shard_path.unlink()
        shard_path.symlink_to([decoy, REFERENCE / entry["name"], shard_path][change["shard"]])
    elif kind == "swap files":
        other = folder / index["shards"][(change["shard"] + 1) % 3]["name"]
        tmp = folder / "swap"
        shard_path.rename(tmp)
        other.rename(shard_path)
        tmp.rename(other)
    index_path.write_bytes(raw if raw is not None else json.dumps(index).encode())
    return folder, expected


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


OUTCOMES: dict[str, int] = {}


@FAST
@given(damaged_folders())
def test_generated_token_folders(tokenizer, shard_records, case):
    kind, change = case
    root = Path(tempfile.mkdtemp(dir=_BASE))
    try:
        folder, expected = make_folder(root, kind, change)
        before = snapshot(folder)
        with files_opened() as opened:
            try:
                shards = open_token_folder(folder, "train_data", tokenizer, SEQ_LEN)
                error = None
            except UptrainError as err:
                error = str(err)
        outcome = f"{kind}: {'refused' if error else 'accepted'}"
        OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
        for f in opened:
            if f.writes:
                assert shard_records in f.path.parents, f"wrote {f.path}"
            elif _BASE in f.path.parents and f.path.parent != MODEL:
                assert f.path.parent == folder, f"read {f.path}"
        assert snapshot(folder) == before
        if error is not None:
            assert kind != "valid" and error and "\n" not in error, error
            return
        # What may be accepted: a change that leaves the folder as it was (a key set to its own value,
        # a byte of a record the reader does not use), or one token changed to another the tokenizer makes.
        assert kind in ("valid", "key", "shard key", "name", "raw", "blocks_per_shard", "flip and digest"), kind
        rows = shards.take(list(range(len(shards)))).numpy()
        assert rows.shape == expected.shape and (rows == expected).all(), kind
        assert expected.max() < len(tokenizer)
    finally:
        shutil.rmtree(root)


def test_what_each_damage_gives(tokenizer, shard_records, tmp_path):
    """The cases the generator covers, one each, with the refusal each must give."""
    cases = [
        ("flip", {"shard": 1, "at": 6, "bit": 0}, "is not the shard `uptrain tokenize` wrote"),
        ("flip and digest", {"shard": 2, "at": 7, "bit": 7}, "holds token id 3"),  # 0x80.. high byte: id ≥ 32768
        ("dtype", {"shard": 0}, "says its tokens are uint32; `uptrain tokenize` writes uint16"),
        ("digits", {"shard": 0, "key": "blocks_per_shard"}, "a number has more digits than Python reads"),
        ("blocks_per_shard", {"shard": 0, "value": 10}, "shard-00000.bin holds 20 blocks, where blocks_per_shard is"),
        (
            "name",
            {"shard": 1, "key": "name", "value": "../decoy.bin"},
            "shard 1 is named '../decoy.bin', not 'shard-00001.bin'",
        ),
        ("link out", {"shard": 0}, "decoy.bin, outside"),
        ("link out", {"shard": 2}, "shard-00002.bin is a link to itself, outside"),
        ("swap files", {"shard": 0}, "is not the shard `uptrain tokenize` wrote"),
    ]
    for i, (kind, change, message) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        folder, _ = make_folder(tmp_path / str(i), kind, change)
        with pytest.raises(UptrainError) as err:
            open_token_folder(folder, "train_data", tokenizer, SEQ_LEN)
        assert message in str(err.value) and "\n" not in str(err.value), (kind, str(err.value))


def test_a_shard_is_read_once_per_version(tokenizer, shard_records, tmp_path):
    """The second use of a folder trusts the record of the first check (no shard opened); a shard
    written since (same size, one bit flipped) is read again and refused."""
    folder = tmp_path / "tokens"
    shutil.copytree(REFERENCE, folder)
    open_token_folder(folder, "train_data", tokenizer, SEQ_LEN)
    records = list((shard_records / "uptrain" / "verified-shards").iterdir())
    assert len(records) == 3
    with files_opened() as opened:
        open_token_folder(folder, "train_data", tokenizer, SEQ_LEN)
    assert not [f for f in opened if f.path.suffix == ".bin"]
    shard = folder / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    stat = shard.stat()
    with open(shard, "r+b") as f:  # in place: same inode, same size
        f.write(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with its old modification time
    with pytest.raises(UptrainError, match="shard-00001.bin is not the shard `uptrain tokenize` wrote"):
        open_token_folder(folder, "train_data", tokenizer, SEQ_LEN)


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("flip", {"shard": 0, "at": 0, "bit": 1}, "is not the shard `uptrain tokenize` wrote"),
        ("flip and digest", {"shard": 0, "at": 1, "bit": 6}, "beyond the tokenizer's"),
        ("dtype", {"shard": 0}, "says its tokens are uint32"),
    ],
)
def test_train_refuses_a_damaged_folder_before_its_output_dir(
    tokenizer, shard_records, tmp_path, capsys, kind, change, message
):
    folder, _ = make_folder(tmp_path, kind, change)
    out = tmp_path / "run"
    argv = ["train", "--model", str(MODEL), "--train-data", str(folder), "--eval-data", str(_BASE / "train.txt")]
    argv += [
        "--output-dir",
        str(out),
        "--seq-len",
        str(SEQ_LEN),
        "--batch-size",
        "2",
        "--max-steps",
        "1",
        "--lr",
        "1e-3",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()
