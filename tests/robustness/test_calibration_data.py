"""Generated calibration data for the encoder–decoders, with one damaged line: bytes that are not
UTF-8, a number past Python's 4,300 digits, a line that is not JSON or not an object, a gzip file
cut short. The text families (T5: span corruption; BART: infilling) and the pairs families
(Marian, M2M100, Pegasus) read it through `calibration_batches`, before their model loads.

Every case either calibrates or is refused in one line; never another exception. A damaged first
line is always refused (the file's first line is read to tell text from speech pairs), and so is a
damaged line anywhere in a pairs file, or text that is not UTF-8 anywhere. `uptrain convert`
refuses them with nothing written.
"""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from pathlib import Path

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.convert.test_encoder_decoder import BART_GEOMETRY
from uptrain import UptrainError
from uptrain.architecture import architecture
from uptrain.cli import main
from uptrain.convert.calibration_seq2seq import calibration_batches
from uptrain.convert.spec import DEFAULT_CALIBRATION
from uptrain.demo import REFERENCE_T5
from uptrain.model_info import read_config

FAST = settings(
    max_examples=30,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PAIRS = ("marian", "m2m_100", "pegasus")
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "
DAMAGES = ["not utf-8", "digits", "digits in the field", "not json", "not an object", "cut gzip"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny encoder–decoders with the shipped tokenizer (BART's with a mask token), and the reference T5."""
    from uptrain.data.corpus import load_tokenizer

    root = tmp_path_factory.mktemp("calibration-models")
    tokenizer = load_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))
    folders = {"t5": Path(REFERENCE_T5)}
    classes = {
        "marian": (transformers.MarianMTModel, transformers.MarianConfig),
        "m2m_100": (transformers.M2M100ForConditionalGeneration, transformers.M2M100Config),
        "pegasus": (transformers.PegasusForConditionalGeneration, transformers.PegasusConfig),
        "bart": (transformers.BartForConditionalGeneration, transformers.BartConfig),
    }
    for name, (model_class, config_class) in classes.items():
        own = copy.deepcopy(tokenizer)
        if name == "bart":
            own.add_special_tokens({"mask_token": "<mask>"})
        geometry = {**BART_GEOMETRY, **ids, "vocab_size": len(own), "decoder_start_token_id": own.pad_token_id}
        folders[name] = root / name
        model_class(config_class(**{**geometry, "max_position_embeddings": 256})).save_pretrained(folders[name])
        own.save_pretrained(folders[name])
    return folders


def good_line(family: str, i: int) -> dict:
    if family in PAIRS:
        return {"source": f"the cat sat on mat number {i}", "target": f"le chat numéro {i}"}
    return {"text": SENTENCE * 40}


def damaged_line(family: str, damage: str) -> bytes:
    field = "source" if family in PAIRS else "text"
    line = good_line(family, 0)
    if damage == "not utf-8":
        return json.dumps(line).encode().replace(b"the", b"th\xe9", 1).replace(b"The", b"Th\xff", 1)
    if damage == "digits":
        return json.dumps(line).encode()[:-1] + b', "n": ' + b"9" * 5000 + b"}"
    if damage == "digits in the field":
        return json.dumps({**line, field: 0}).encode().replace(b": 0", b": " + b"7" * 5000, 1)
    if damage == "not json":
        return json.dumps(line).encode()[:-3]
    return json.dumps(list(line.values())).encode()  # not an object


def write_data(folder: Path, family: str, damage: str, place: int) -> Path:
    lines = [json.dumps(good_line(family, i)).encode() for i in range(4)]
    if damage != "cut gzip":
        lines.insert(place, damaged_line(family, damage))
    raw = b"\n".join(lines) + b"\n"
    if damage == "cut gzip":
        path = folder / "data.jsonl.gz"
        whole = gzip.compress(raw)
        path.write_bytes(whole[: len(whole) * (place + 1) // 6])
        return path
    path = folder / "data.jsonl"
    path.write_bytes(raw)
    return path


def must_refuse(family: str, damage: str, place: int) -> bool:
    """Where the reader must refuse: a damaged first line, any damage in pairs, non-UTF-8 text, a cut file."""
    return place == 0 or family in PAIRS or damage in ("not utf-8", "cut gzip")


@FAST
@given(st.sampled_from(["t5", "bart", *PAIRS]), st.sampled_from(DAMAGES), st.integers(0, 3))
def test_damaged_calibration_data(models, tmp_path, family, damage, place):
    folder = tmp_path / f"{family}-{DAMAGES.index(damage)}-{place}"
    folder.mkdir()
    data = write_data(folder, family, damage, place)
    arch = architecture(read_config(models[family]).get("model_type"))
    try:
        calibration_batches(models[family], arch, str(data), DEFAULT_CALIBRATION, 4)
    except UptrainError as err:
        assert str(err) and "\n" not in str(err), str(err)
        return
    finally:
        shutil.rmtree(folder)
    assert not must_refuse(family, damage, place), "calibrated on damaged data"


@pytest.mark.parametrize("family", ["t5", "marian"])
@pytest.mark.parametrize("damage", ["not utf-8", "digits"])
def test_convert_refuses_a_damaged_first_line(models, tmp_path, capsys, family, damage):
    """The cases of issue #34: one line, exit 2, no output."""
    data = write_data(tmp_path, family, damage, 0)
    out = tmp_path / "out"
    argv = ["convert", str(models[family]), str(out), "-g", "2", "--pooling", "calibrated"]
    capsys.readouterr()
    assert main([*argv, "--calibration-data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "data.jsonl line 1" in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_a_json_document_calibrates_as_training_reads_it(models, tmp_path, family):
    """A `.json` file is one JSON document (datasets reads an array of records), whose first line
    is `[` alone: it is no damaged line of JSON lines, and calibrates."""
    data = tmp_path / "data.json"
    data.write_text("[\n" + ",\n".join(json.dumps(good_line(family, i)) for i in range(4)) + "\n]\n")
    arch = architecture(read_config(models[family]).get("model_type"))
    batches, info = calibration_batches(models[family], arch, str(data), DEFAULT_CALIBRATION, 4)
    assert batches and info["examples"] > 0


def test_a_json_document_that_is_not_utf8_is_refused_in_one_line(models, tmp_path):
    bad = json.dumps(good_line("t5", 0)).encode().replace(b"The", b"Th\xff", 1)
    first, later = tmp_path / "first.json", tmp_path / "later.json"
    first.write_bytes(b"[" + bad + b"]\n")  # on the first line, read before the model loads
    later.write_bytes(b"[\n" + bad + b"\n]\n")  # further on: datasets' loader, still one line
    for data, message in ((first, "first.json line 1 is not UTF-8"), (later, "cannot load")):
        with pytest.raises(UptrainError, match=message) as err:
            calibration_batches(models["t5"], architecture("t5"), str(data), DEFAULT_CALIBRATION, 4)
        assert "\n" not in str(err.value)
