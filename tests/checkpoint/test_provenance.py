"""`uptrain.json` as a chain, read strictly: a record that is there but malformed is one line
naming the file and the key, where a command reads it and before it writes anything; and how
records name sources so that they can be shared (no absolute path of this machine)."""

from __future__ import annotations

import json

import pytest

from scripts.synthetic_checkpoint import write_synthetic_llama
from uptrain import UptrainError
from uptrain.checkpoint.provenance import CONVERSION_KEYS, conversion_record, read_provenance
from uptrain.checkpoint.source import portable, resolve_source, snapshot_of

CONVERSION = {
    "source": "org/model",
    "model_type": "llama",
    "pooling": "mean",
    "source_num_key_value_heads": 8,
    "num_key_value_heads": 2,
}


def uptrained(provenance) -> dict:
    """The record of a `final/` that started from a checkpoint with `provenance`."""
    return {"uptraining": {}, "started_from": {"name": "start", "provenance": provenance}}


def test_the_conversion_is_found_back_through_uptrainings():
    assert conversion_record(CONVERSION) is CONVERSION
    assert conversion_record(uptrained(uptrained(CONVERSION))) is CONVERSION
    assert conversion_record(uptrained(None)) is None  # started from a model uptrain did not convert
    assert conversion_record({"uptraining": {}}) is None and conversion_record(None) is None


# Generated: each place in a chain two uptrainings deep where a mapping belongs, given each
# other JSON kind; and a conversion lacking each field the cards and trackers read.
KINDS = [["a list"], "a string", 3, 1.5, True]
MALFORMED = (
    [(value, "the record") for value in KINDS]
    + [({"started_from": value}, "`started_from`") for value in KINDS]
    + [(uptrained(value), "`started_from.provenance`") for value in KINDS]
    + [(uptrained({"started_from": value}), "`started_from.provenance.started_from`") for value in KINDS]
    + [
        (uptrained({k: v for k, v in CONVERSION.items() if k != missing}), "`started_from.provenance`")
        for missing in CONVERSION_KEYS
        if missing != "pooling"
    ]  # `pooling` is what marks a conversion
)


@pytest.mark.parametrize("record,key", MALFORMED)
def test_a_malformed_chain_is_one_line_naming_the_key(record, key, tmp_path):
    (tmp_path / "uptrain.json").write_text(json.dumps(record))
    with pytest.raises(UptrainError) as err:
        read_provenance(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'uptrain.json'}: {key} ") and "\n" not in message, message
    assert "restore or remove the file" in message


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[" * 100_000, b'{"pooling": 1' + b"0" * 5000 + b"}"])
def test_an_uptrain_json_that_is_not_json_is_one_line(raw, tmp_path):
    (tmp_path / "uptrain.json").write_bytes(raw)
    with pytest.raises(UptrainError) as err:
        read_provenance(tmp_path)
    assert str(err.value).startswith(str(tmp_path / "uptrain.json")) and "\n" not in str(err.value)


def test_no_uptrain_json_is_no_provenance(tmp_path):
    assert read_provenance(tmp_path) is None
    (tmp_path / "uptrain.json").symlink_to(tmp_path / "nowhere")  # a dangling link is there, and unreadable
    with pytest.raises(UptrainError, match="cannot read"):
        read_provenance(tmp_path)


def test_convert_refuses_a_source_with_a_malformed_chain_before_writing(tmp_path, capsys):
    """`uptrain convert` reads the source's provenance (the Hub model it derives from) when it
    resolves the source: one line, and no output folder."""
    from uptrain.cli import main

    src = write_synthetic_llama(tmp_path / "src", hidden=64, layers=1, intermediate=32, vocab=32)
    (src / "uptrain.json").write_text(json.dumps({"started_from": "elsewhere"}))
    assert main(["convert", str(src), str(tmp_path / "out"), "-g", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src / 'uptrain.json'}: `started_from` must be a mapping" in err, err
    assert not (tmp_path / "out").exists()


def test_sources_are_named_portably(tmp_path):
    commit = "a" * 40
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    assert snapshot_of(snapshot) == ("org/name", commit)
    assert snapshot_of(tmp_path / "hub" / "models--gpt2" / "snapshots" / "main") == ("gpt2", None)
    assert snapshot_of(tmp_path) is None
    resolved = resolve_source(snapshot)
    assert (resolved.name, resolved.revision, resolved.hub_id, resolved.base_model) == (
        "org/name",
        commit,
        "org/name",
        "org/name",
    )
    assert resolved.label == str(snapshot)  # messages on this machine still say the path given
    folder = tmp_path / "models" / "llama-7b"
    folder.mkdir(parents=True)
    resolved = resolve_source(folder / ".." / "llama-7b")
    assert (resolved.name, resolved.revision, resolved.hub_id, resolved.base_model) == ("llama-7b", None, None, None)

    assert portable(str(folder)) == "llama-7b" and portable(str(snapshot)) == "org/name"
    assert portable("~/data/train.jsonl") == "train.jsonl" and portable("/data/*.jsonl") == "*.jsonl"
    for kept in ("org/dataset", "data/train.jsonl", "mean", ""):
        assert portable(kept) == kept
