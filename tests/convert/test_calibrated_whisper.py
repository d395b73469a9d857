"""Whisper's `calibrated` merge calibrated from speech pairs (issue #25): `uptrain convert
--calibration-data PAIRS.jsonl` reads jsonl `audio`/`text` lines with the reader training uses
(`uptrain.data.pairs`), the targets opening with the prompt `generate(language=…, task=…)`
forces, and the whole model runs over them with every attention's input hooked (cross-attention:
keys and values from the encoder's output, queries from the decoder's states). Tiny real Whisper
checkpoints with their feature extractor and tokenizer, and .wav files, built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.convert.test_calibrated_encoder_decoder import relate_heads_exactly
from tests.train.test_seq2seq import SAMPLING_RATE, write_jsonl, write_wav
from tests.train.test_target_prompts import build_whisper
from uptrain.architecture import architecture
from uptrain.cli import main

ALL = "encoder,decoder-self,cross"
TONES = {"low": 220.0, "middle": 880.0, "high": 3000.0, "bas": 440.0, "haut": 1760.0}
TEXTS = ["low middle high", "le bas haut", "high high low", "middle le bas", "haut low middle le"]


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> Path:
    """Speech pairs: five tones, each with several transcripts (paths relative to the jsonl)."""
    root = tmp_path_factory.mktemp("whispercal")
    (root / "audio").mkdir()
    for name, hz in TONES.items():
        write_wav(root / "audio" / f"{name}.wav", hz, seconds=0.3 + 0.1 * len(name))
    rows = [{"audio": f"audio/{name}.wav", "text": text} for name in TONES for text in TEXTS]
    return write_jsonl(root / "pairs.jsonl", rows)


def whisper(folder: Path, related_groups: int | None = None) -> Path:
    """A multilingual 4-head Whisper (`build_whisper`), its K/V heads exactly related within
    `related_groups` groups when given."""
    from transformers import WhisperForConditionalGeneration

    build_whisper(folder, True)
    if related_groups is not None:
        model = WhisperForConditionalGeneration.from_pretrained(folder)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight")):
                    p.mul_(6)  # sharper attention: pooling errors show in the logits
        relate_heads_exactly(model, related_groups)
        model.save_pretrained(folder)
    return folder


def logits(folder: Path, pairs: Path) -> torch.Tensor:
    """The model's logits on the first clips of `pairs`, the decoder fed prompt-framed targets."""
    from transformers import AutoModelForSpeechSeq2Seq

    import uptrain.modeling  # noqa: F401  registers whisper_gqa
    from uptrain.data.pairs import read_wav

    model = AutoModelForSpeechSeq2Seq.from_pretrained(folder).eval()
    from transformers import AutoFeatureExtractor

    extractor = AutoFeatureExtractor.from_pretrained(folder)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()][::7]
    audio = [read_wav(pairs.parent / r["audio"], SAMPLING_RATE, "test") for r in rows]
    features = extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt")["input_features"]
    decoder = torch.randint(0, model.config.vocab_size, (len(rows), 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_features=features, decoder_input_ids=decoder).logits


def convert(src: Path, out: Path, g: int, data: Path, *extra: str) -> int:
    argv = ["convert", str(src), str(out), "-g", str(g), "--pooling", "calibrated", "--attention", ALL]
    return main([*argv, "--calibration-data", str(data), "--language", "en", *extra])


def test_whisper_calibrates_on_speech_pairs_and_g_equals_h_reproduces_it(speech, tmp_path, capsys):
    src = whisper(tmp_path / "src")
    assert convert(src, tmp_path / "out", 4, speech) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "out" / "uptrain.json").read_text())
    calibration = record["calibration"]
    assert calibration["objective"] == "speech_pairs" and calibration["examples"] == len(TONES) * len(TEXTS)
    assert calibration["prompt"] == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    torch.testing.assert_close(logits(tmp_path / "out", speech), logits(src, speech), rtol=1e-4, atol=1e-4)


def test_exactly_related_heads_merge_exactly_from_speech_pairs(speech, tmp_path, capsys):
    src = whisper(tmp_path / "src", related_groups=2)
    assert convert(src, tmp_path / "calibrated", 2, speech) == 0, capsys.readouterr().err
    argv = ["convert", str(src), str(tmp_path / "mean"), "-g", "2", "--attention", ALL]
    assert main(argv) == 0, capsys.readouterr().err
    reference = logits(src, speech)
    merged, mean = logits(tmp_path / "calibrated", speech), logits(tmp_path / "mean", speech)
    torch.testing.assert_close(merged, reference, rtol=1e-4, atol=1e-4)
    assert (mean - reference).abs().max() > 100 * (merged - reference).abs().max()


def test_calibration_reads_the_pairs_training_reads_and_hooks_their_inputs(speech, tmp_path):
    """The calibration batches are the training reader's (prompt-framed labels), and the
    cross-attention keys/values moment is the encoder's output on them, computed by hand."""
    from transformers import AutoTokenizer, WhisperForConditionalGeneration

    from uptrain.convert.calibration_seq2seq import calibration_batches, seq2seq_moments
    from uptrain.convert.spec import CalibrationSettings
    from uptrain.data.pairs import load_pairs
    from uptrain.model_info import read_config
    from uptrain.objectives import get_objective
    from uptrain.objectives.prompts import PromptKeys, target_framing

    src = whisper(tmp_path / "src")
    arch, keys = architecture("whisper"), PromptKeys(language="fr", speech_task="translate")
    batches, info = calibration_batches(
        src, arch, str(speech), CalibrationSettings(calibration_tokens=64, calibration_seq_len=16), 8, keys
    )
    assert info["examples"] == 4 and len(batches) == 1  # ⌈64 / 16⌉ clips
    tokenizer, config, objective = AutoTokenizer.from_pretrained(src), read_config(src), get_objective("speech_pairs")
    framing = target_framing(arch, objective, keys, tokenizer, str(src), config)
    expected = load_pairs(str(speech), "t", objective, tokenizer, str(src), config, 16, 16, framing).take([0, 1, 2, 3])
    assert set(batches[0]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(batches[0][name], tensor), name
    prompt = tokenizer.convert_tokens_to_ids(["<|fr|>", "<|translate|>", "<|notimestamps|>"])
    assert batches[0]["labels"][:, :3].tolist() == [prompt] * 4
    model = WhisperForConditionalGeneration.from_pretrained(src).eval()
    moments = seq2seq_moments(model, arch, batches, progress=False)
    with torch.no_grad():
        encoded = model.model.encoder(batches[0]["input_features"]).last_hidden_state
    rows = encoded.reshape(-1, encoded.shape[-1]).double()
    rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)
    torch.testing.assert_close(moments["cross.keys_values"], rows.mT @ rows / len(rows))


def test_wrong_calibration_data_is_one_line_and_writes_nothing(speech, tmp_path, capsys, tokenizer):
    """Text for Whisper, a multilingual Whisper without a language, speech pairs or --language for
    a text family: one line each, nothing written."""
    import transformers

    from tests.convert.test_encoder_decoder import T5_GEOMETRY

    src = whisper(tmp_path / "whisper")
    text = tmp_path / "text.txt"
    text.write_text("some calibration text\n")
    t5 = tmp_path / "t5"
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0)
    transformers.T5ForConditionalGeneration(
        transformers.T5Config(**{**T5_GEOMETRY, **ids, "vocab_size": len(tokenizer)})
    ).save_pretrained(t5)
    tokenizer.save_pretrained(t5)
    base = ["-g", "2", "--pooling", "calibrated", "--calibration-data"]
    cases = [
        ([str(src), "OUT", *base, str(text), "--language", "en"], "objective speech_pairs reads .jsonl files"),
        ([str(src), "OUT", *base, str(speech)], "names no language: set `language`"),
        ([str(t5), "OUT", *base, str(speech)], "holds speech pairs (`audio`); T5's encoder reads text"),
        ([str(t5), "OUT", *base, str(text), "--language", "en"], "--language applies to Whisper's calibration"),
        ([str(src), "OUT", "-g", "2", "--speech-task", "translate"], "--speech-task choose the prompt"),
    ]
    for i, (argv, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        capsys.readouterr()
        assert main(["convert", *[str(out) if a == "OUT" else a for a in argv]]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
        assert not out.exists()


def test_training_on_the_fly_calibrates_on_the_prompt_it_trains_on(speech, tmp_path):
    """`uptrain train --source … --pooling calibrated`: the conversion calibrates on train_data with
    the run's `language` / `speech_task`."""
    from uptrain.train.config import TrainConfig
    from uptrain.train.loop import run_training

    src = whisper(tmp_path / "src")
    config = TrainConfig(
        source=str(src),
        num_kv_heads=2,
        pooling="calibrated",
        language="fr",
        speech_task="translate",
        train_data=str(speech),
        eval_data=str(speech),
        output_dir=str(tmp_path / "run"),
        seq_len=32,
        batch_size=5,
        lr=1e-3,
        max_steps=1,
        eval_every=1,
        eval_blocks=5,
        report_to=["jsonl"],
    )
    run_training(config)
    record = json.loads((tmp_path / "run" / "converted" / "uptrain.json").read_text())
    assert record["pooling"] == "calibrated" and record["calibration"]["objective"] == "speech_pairs"
    assert record["calibration"]["prompt"] == "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
