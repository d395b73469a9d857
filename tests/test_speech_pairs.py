"""uptrain.data.speech (scripts/make_speech_pairs.py): espeak-ng reading windows of the shipped corpus
as `speech_pairs` data. The end-to-end test runs the real espeak-ng on one training and one held-out
window and reads the result with uptrain's own speech-pairs reader."""

from __future__ import annotations

import json
import math
import shutil
import wave

import numpy as np
import pytest

from tests.train.test_seq2seq import build_model, build_tokenizer
from uptrain import UptrainError
from uptrain.data.corpus import read_documents
from uptrain.data.pairs import load_pairs
from uptrain.data.speech import (
    SAMPLING_RATE,
    SpeechSettings,
    document_windows,
    espeak_binary,
    make_speech_pairs,
    read_manifest,
    resample,
)
from uptrain.objectives import OBJECTIVES

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="espeak-ng is not installed (apt-get install -y espeak-ng; CI has it)"
)

PLAY = """OTHELLO, THE MOOR OF VENICE

ACT I.

IAGO.
Call up her father,
Rouse him:--make after him, poison his delight,
Proclaim him in the streets. Incense her kinsmen!

[Exit]

RODERIGO.
What, ho, Brabantio! Signior Brabantio, ho! Awake! I have 3 ducats.

IAGO.
Awake! what, ho, Brabantio! thieves! thieves! thieves! Look to your house, your daughter, and your bags!"""


def test_windows_are_whole_sentences_of_one_speech_without_headings_or_directions():
    # Up to 12 words: IAGO's first sentence (14 words) is skipped and his second (3) is too short;
    # RODERIGO's speech names a number; the last speech is two windows, cut between sentences.
    assert document_windows(PLAY, min_words=4, max_words=12) == [
        "Awake! what, ho, Brabantio! thieves! thieves! thieves!",
        "Look to your house, your daughter, and your bags!",
    ]
    # Up to 20: verse lines joined, the dash read as a comma; no speaker, heading or stage direction.
    assert document_windows(PLAY, min_words=4, max_words=20) == [
        "Call up her father, Rouse him, make after him, poison his delight, Proclaim him in the streets. "
        "Incense her kinsmen!",
        "Awake! what, ho, Brabantio! thieves! thieves! thieves! Look to your house, your daughter, and your bags!",
    ]


def test_resampling_keeps_a_tone():
    t = np.arange(22050) / 22050
    tone = (0.5 * np.sin(2 * math.pi * 440 * t)).astype(np.float32)
    out = resample(tone, 22050, SAMPLING_RATE)
    assert out.shape == (SAMPLING_RATE,)
    want = 0.5 * np.sin(2 * math.pi * 440 * np.arange(SAMPLING_RATE) / SAMPLING_RATE)
    assert np.abs(out - want).max() < 1e-3


def test_a_missing_espeak_is_one_line_with_the_command(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UptrainError, match=r"espeak-ng is not installed.*apt-get install -y espeak-ng"):
        espeak_binary(install=False)


def test_settings_are_checked_before_anything_runs(tmp_path):
    for settings, message in (
        (SpeechSettings(train_clips=0), "at least 1"),
        (SpeechSettings(max_words=80), "inside Whisper's 30 s"),
        (SpeechSettings(voice="en; rm -rf"), "not an espeak-ng voice"),
        (SpeechSettings(max_words=60, speed=100), "may run past 28 s"),
    ):
        with pytest.raises(UptrainError, match=message):
            make_speech_pairs(tmp_path / "out", settings)
    assert not (tmp_path / "out").exists()


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@needs_espeak
def test_two_clips_spoken_split_apart_and_read_by_uptrain(tmp_path):
    settings = SpeechSettings(train_clips=1, heldout_clips=1, seed=7)
    out = make_speech_pairs(tmp_path / "speech", settings, log=lambda m: None)
    train, held = _rows(out / "train.jsonl"), _rows(out / "heldout.jsonl")
    assert len(train) == len(held) == 1
    # Train reads the corpus' train split, the held-out clip its test split: other works, other text.
    train_works = {d["id"] for d in read_documents("train")}
    test_works = {d["id"] for d in read_documents("test")}
    assert train[0]["work"] in train_works and held[0]["work"] in test_works
    assert train[0]["text"] != held[0]["text"]
    for row in train + held:
        with wave.open(str(out / row["audio"]), "rb") as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLING_RATE, 1, 2)
            frames = w.getnframes()
            samples = np.frombuffer(w.readframes(frames), "<i2") / 32768
        seconds = frames / SAMPLING_RATE
        assert seconds == pytest.approx(row["seconds"], abs=1e-3)
        words = len(row["text"].split())
        assert settings.min_words <= words <= settings.max_words
        # Spoken, not silence: at least 0.15 s a word at 160 words a minute, and well inside 30 s.
        assert 0.15 * words < seconds < 28
        assert np.sqrt(np.mean(samples**2)) > 0.01
    made = json.loads((out / "speech.json").read_text())
    assert made["settings"]["seed"] == 7 and made["totals"]["train"]["clips"] == 1
    assert made["espeak"].startswith("eSpeak NG")

    # Read by uptrain's speech-pairs reader, into a (tiny) Whisper's input features and labels.
    texts = " ".join(r["text"] for r in train + held)
    tokenizer = build_tokenizer(texts, sentinels=False)
    model = build_model("whisper", tmp_path / "whisper", tokenizer)
    config = json.loads((model / "config.json").read_text())
    for name in ("train.jsonl", "heldout.jsonl"):
        examples = load_pairs(
            str(out / name), "train_data", OBJECTIVES["speech_pairs"], tokenizer, str(model), config, 64, 64
        )
        batch = examples.take([0])
        assert batch["input_features"].shape[:2] == (1, 16)
        assert examples.seconds[0] == pytest.approx(_rows(out / name)[0]["seconds"], abs=1e-3)

    # A rerun with the same settings reuses the folder; other settings are refused unless overwritten.
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    said = []
    assert make_speech_pairs(tmp_path / "speech", settings, log=said.append) == out
    assert said and said[0].startswith("reusing") and (out / "train.jsonl").stat().st_mtime_ns == stamp
    other = SpeechSettings(train_clips=1, heldout_clips=1, seed=8)
    with pytest.raises(UptrainError, match="exists with other settings"):
        make_speech_pairs(tmp_path / "speech", other, log=lambda m: None)
    remade = []
    make_speech_pairs(tmp_path / "speech", settings, overwrite=True, log=remade.append)
    assert remade and not remade[0].startswith("reusing") and (out / "train.jsonl").stat().st_mtime_ns != stamp
    assert _rows(out / "train.jsonl") == train  # deterministic: the same windows, the same clips


@pytest.mark.parametrize("text", ["[]", "1", '"speech"', "{", ""])
def test_a_damaged_manifest_is_no_manifest(tmp_path, text):
    """speech.json that is not a JSON object says nothing about the folder (it is not reused)."""
    (tmp_path / "speech.json").write_text(text)
    assert read_manifest(tmp_path) is None
