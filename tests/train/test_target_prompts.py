"""Targets that start with the prompt users decode with (issue #25): Whisper's
<|startoftranscript|><|lang|><|task|><|notimestamps|>, mBART's and NLLB's language codes, a
multilingual Marian's `>>code<<` source token — tiny real transformers models and tokenizers built
here, with the special tokens of the real ones.

The exact checks: uptrain's step-0 evaluation equals the model's own negative log-likelihood of
prompt + transcript (+ EOS), computed here by hand from transformers' forward, and the prompt is
the one `generate(language=…, task=…)` forces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train.test_seq2seq import SAMPLING_RATE, build_model, build_tokenizer, refuses, write_jsonl, write_wav
from tests.train.train_helpers import records
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training

WHISPER_SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|fr|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|notimestamps|>",
]
WORDS = "low middle high le bas haut"
TONES = {"low": 220.0, "middle": 880.0, "high": 3000.0}


def whisper_tokenizer():
    """A word-level tokenizer with Whisper's special tokens (<|endoftext|> is its BOS, EOS,
    padding and unknown token, as in Whisper's own)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = Whitespace()
    tok.train_from_iterator([WORDS], WordLevelTrainer(special_tokens=WHISPER_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": WHISPER_SPECIALS[1:]})
    return tokenizer


def build_whisper(folder: Path, multilingual: bool, **generation) -> Path:
    """A 2-layer Whisper with `whisper_tokenizer`, its feature extractor, and a generation config
    as published checkpoints have it: multilingual (lang_to_id, task_to_id, forced_decoder_ids
    with the language left to detection) or English-only (only <|notimestamps|> forced)."""
    import transformers as tf

    tokenizer = whisper_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in WHISPER_SPECIALS}
    torch.manual_seed(0)
    eot = ids["<|endoftext|>"]
    config = tf.WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=16,
        max_source_positions=50,
        max_target_positions=64,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        d_model=32,
        dropout=0.0,
        attention_dropout=0.0,
    )
    tf.WhisperForConditionalGeneration(config).save_pretrained(folder)
    tf.WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLING_RATE, chunk_length=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    path = folder / "generation_config.json"
    gen = json.loads(path.read_text())
    gen["no_timestamps_token_id"] = ids["<|notimestamps|>"]
    gen["is_multilingual"] = multilingual
    if multilingual:
        gen["lang_to_id"] = {"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]}
        gen["task_to_id"] = {"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]}
        gen["forced_decoder_ids"] = [[1, None], [2, ids["<|transcribe|>"]]]
    else:
        gen["forced_decoder_ids"] = [[1, ids["<|notimestamps|>"]]]
    gen["_from_model_config"] = False  # else transformers rebuilds it from config.json, dropping these
    gen.update(generation)
    path.write_text(json.dumps(gen))
    return folder


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompts")
    (root / "audio").mkdir()
    for name, hz in TONES.items():
        write_wav(root / "audio" / f"{name}.wav", hz)
    rows = [{"audio": f"audio/{name}.wav", "text": f"{name} {name}"} for name in TONES for _ in range(3)]
    write_jsonl(root / "train.jsonl", rows)
    write_jsonl(root / "eval.jsonl", [rows[0], rows[4], {"audio": "audio/high.wav", "text": "le haut bas"}])
    return {
        "root": root,
        "multilingual": build_whisper(root / "multilingual", True),
        "english": build_whisper(root / "english", False),
        # A fine-tuned checkpoint that names its language in the generation config.
        "french": build_whisper(root / "french", True, language="fr"),
    }


def speech_config(speech, kind: str, tmp_path, **overrides) -> dict:
    return {
        "model": str(speech[kind]),
        "train_data": str(speech["root"] / "train.jsonl"),
        "eval_data": str(speech["root"] / "eval.jsonl"),
        "output_dir": str(tmp_path / f"run-{kind}"),
        "seq_len": 32,
        "batch_size": 3,
        "lr": 1e-3,
        "max_steps": 1,
        "eval_every": 1,
        "save_every": 10,
        "seed": 0,
        "report_to": ["jsonl"],
        **overrides,
    }


def whisper_nll(model_path: Path, eval_file: Path, prompt: list[str]) -> float:
    """Mean negative log-likelihood per token of `prompt`[1:] + transcript + <|endoftext|> under
    the model, the decoder fed <|startoftranscript|> and what follows, one example at a time."""
    from transformers import AutoFeatureExtractor, AutoTokenizer, WhisperForConditionalGeneration

    from uptrain.train.pairs import read_wav

    model = WhisperForConditionalGeneration.from_pretrained(model_path).eval()
    tokenizer, extractor = AutoTokenizer.from_pretrained(model_path), AutoFeatureExtractor.from_pretrained(model_path)
    total, count = 0.0, 0
    for line in eval_file.read_text().splitlines():
        row = json.loads(line)
        audio = read_wav(eval_file.parent / row["audio"], SAMPLING_RATE, "test")
        features = extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt")["input_features"]
        ids = tokenizer.convert_tokens_to_ids(prompt) + tokenizer.encode(row["text"], add_special_tokens=False)
        ids = torch.tensor([ids + [tokenizer.eos_token_id]])
        with torch.no_grad():
            logits = model(input_features=features, decoder_input_ids=ids[:, :-1]).logits.double()
        nll = -torch.log_softmax(logits, dim=-1)[0].gather(1, ids[0, 1:, None])
        total, count = total + nll.sum().item(), count + nll.numel()
    return total / count


def forced_prompt(model_path: Path, **kwargs) -> list[str]:
    """The tokens `generate(**kwargs)` starts its output with, before any it chose itself."""
    from transformers import AutoTokenizer, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    features = torch.zeros(1, 16, 100)
    out = model.generate(features, max_new_tokens=1, return_dict_in_generate=True, **kwargs).sequences
    return tokenizer.convert_ids_to_tokens(out[0, :-1].tolist())


MULTILINGUAL_FR = ["<|startoftranscript|>", "<|fr|>", "<|transcribe|>", "<|notimestamps|>"]


@pytest.mark.parametrize(
    ("kind", "keys", "prompt"),
    [
        ("multilingual", {"language": "fr"}, MULTILINGUAL_FR),
        (
            "multilingual",
            {"language": "english", "task": "translate"},
            ["<|startoftranscript|>", "<|en|>", "<|translate|>", "<|notimestamps|>"],
        ),
        ("french", {}, MULTILINGUAL_FR),  # the generation config's language; transcribe from forced_decoder_ids
        ("english", {}, ["<|startoftranscript|>", "<|notimestamps|>"]),
    ],
)
def test_whisper_targets_start_with_the_prompt_generate_forces(speech, tmp_path, capsys, kind, keys, prompt):
    config = TrainConfig(**speech_config(speech, kind, tmp_path, **keys))
    run_training(config)
    assert f"prompt {''.join(prompt)}" in capsys.readouterr().out
    generate_keys = keys | ({"language": "fr"} if kind == "french" else {})
    assert forced_prompt(speech[kind], **generate_keys) == prompt
    # α = 0: the evaluation is the model's own likelihood of the transcript after the prompt.
    expected = whisper_nll(speech[kind], speech["root"] / "eval.jsonl", prompt)
    assert records(config.output_dir)[0]["eval/loss"] == pytest.approx(expected, rel=1e-5)
    # …and not that of the transcript without the prompt.
    assert records(config.output_dir)[0]["eval/loss"] != pytest.approx(
        whisper_nll(speech[kind], speech["root"] / "eval.jsonl", prompt[:1]), rel=1e-3
    )


def test_whisper_prompt_refusals(speech, tmp_path, s2s_bart):
    multilingual = speech_config(speech, "multilingual", tmp_path)
    refuses(multilingual, r"is a multilingual Whisper and its generation config names no language: set `language`")
    refuses({**multilingual, "language": "de"}, r"`language` 'de' is not a language of .* lang_to_id: en, fr")
    english = speech_config(speech, "english", tmp_path)
    refuses({**english, "language": "en"}, r"is an English-only Whisper .* it takes no `language`")
    refuses({**english, "task": "translate"}, r"it takes no `task`")
    refuses({**multilingual, "language": "fr", "target_len": 4}, r"target_len 4 leaves no room for text after")
    refuses({**multilingual, "source_lang": "fr"}, r"`source_lang` applies to objective pairs of mBART")
    bart = {**multilingual, "model": str(s2s_bart), "train_data": str(speech["root"] / "train.jsonl")}
    refuses({**bart, "language": "fr", "objective": "text_infilling"}, r"`language` applies to Whisper checkpoints")
    from uptrain import UptrainError

    with pytest.raises(UptrainError, match="`task`: must be one of 'transcribe', 'translate' or null, not 'summarize'"):
        TrainConfig(**{**multilingual, "task": "summarize"})


@pytest.fixture(scope="module")
def s2s_bart(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bart")
    return build_model("bart", root / "bart", build_tokenizer("the cat a dog", sentinels=False))
