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


# The tiny encoder–decoder every test here builds (Whisper, mBART, NLLB), without dropout.
TINY_GEOMETRY = dict(
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
        **TINY_GEOMETRY,
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
    from transformers import AutoFeatureExtractor, AutoModelForSpeechSeq2Seq, AutoTokenizer

    import uptrain.modeling  # noqa: F401  registers whisper_gqa
    from uptrain.data.pairs import read_wav

    model = AutoModelForSpeechSeq2Seq.from_pretrained(model_path).eval()
    tokenizer, extractor = AutoTokenizer.from_pretrained(model_path), AutoFeatureExtractor.from_pretrained(model_path)
    total, count = 0.0, 0
    for line in eval_file.read_text().splitlines():
        row = json.loads(line)
        audio = read_wav(eval_file.parent / row["audio"], SAMPLING_RATE, "test")
        features = extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt")["input_features"]
        ids = tokenizer.convert_tokens_to_ids(prompt) + tokenizer.encode(" " + row["text"], add_special_tokens=False)
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
            {"language": "english", "speech_task": "translate"},
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
    generate_keys = {"task" if k == "speech_task" else k: v for k, v in keys.items()}  # generate's names
    generate_keys |= {"language": "fr"} if kind == "french" else {}
    assert forced_prompt(speech[kind], **generate_keys) == prompt
    # α = 0: the evaluation is the model's own likelihood of the transcript after the prompt.
    expected = whisper_nll(speech[kind], speech["root"] / "eval.jsonl", prompt)
    assert records(config.output_dir)[0]["eval/loss"] == pytest.approx(expected, rel=1e-5)
    # …and not that of the transcript without the prompt.
    assert records(config.output_dir)[0]["eval/loss"] != pytest.approx(
        whisper_nll(speech[kind], speech["root"] / "eval.jsonl", prompt[:1]), rel=1e-3
    )


def test_a_whisper_converted_on_the_fly_trains_on_its_prompt(speech, tmp_path):
    """`source` + `num_kv_heads`: the prompt is read from the source (its generation config travels
    with the converted weights), and step 0 scores the converted model on it."""
    values = speech_config(speech, "multilingual", tmp_path, language="fr")
    del values["model"]
    config = TrainConfig(**values, source=str(speech["multilingual"]), num_kv_heads=2)
    run_training(config)
    converted = Path(config.output_dir) / "converted"
    assert json.loads((converted / "config.json").read_text())["model_type"] == "whisper_gqa"
    expected = whisper_nll(converted, speech["root"] / "eval.jsonl", MULTILINGUAL_FR)
    assert records(config.output_dir)[0]["eval/loss"] == pytest.approx(expected, rel=1e-5)


def test_whisper_language_from_the_tokenizer(speech):
    """A checkpoint whose tokenizer names its language (WhisperTokenizer(language=…), as
    transformers' fine-tuning recipe saves it) needs no `language` key."""
    from uptrain.architecture import architecture
    from uptrain.model_info import read_config
    from uptrain.objectives import OBJECTIVES
    from uptrain.objectives.prompts import PromptKeys, target_framing

    path = speech["multilingual"]
    tokenizer = whisper_tokenizer()
    tokenizer.language, tokenizer.task = "french", "translate"
    framing = target_framing(
        architecture("whisper"), OBJECTIVES["speech_pairs"], PromptKeys(), tokenizer, str(path), read_config(path)
    )
    assert framing.shown == "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    prompt = ["<|fr|>", "<|translate|>", "<|notimestamps|>"]
    assert framing.label_prefix == tuple(tokenizer.convert_tokens_to_ids(prompt))


def byte_level_whisper_tokenizer():
    """A byte-level BPE with Whisper's special tokens at the same ids as `whisper_tokenizer`'s (as
    Whisper's own tokenizer, a word's leading space is part of its token: "Ġlow", not "low")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(special_tokens=WHISPER_SPECIALS, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([WORDS, " " + WORDS], trainer)
    eot = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=eot, pad_token=eot, eos_token=eot, bos_token=eot
    )
    tokenizer.add_special_tokens({"additional_special_tokens": WHISPER_SPECIALS[1:]})
    return tokenizer


def test_whisper_targets_are_tokenized_as_whisper_writes_them(speech):
    """Whisper generates a transcript as " text" after its prompt ("ĠThe …"): the labels of training,
    calibration and evaluation (`framed_target_ids`, the one framing all three read targets
    through) are the tokens of " " + the text, one space however the text starts."""
    from uptrain.architecture import architecture
    from uptrain.model_info import read_config
    from uptrain.objectives import OBJECTIVES
    from uptrain.objectives.prompts import PromptKeys, framed_target_ids, target_framing

    path = speech["multilingual"]
    tokenizer = byte_level_whisper_tokenizer()
    assert tokenizer.convert_tokens_to_ids(WHISPER_SPECIALS) == whisper_tokenizer().convert_tokens_to_ids(
        WHISPER_SPECIALS
    )
    framing = target_framing(
        architecture("whisper"),
        OBJECTIVES["speech_pairs"],
        PromptKeys(language="en"),
        tokenizer,
        str(path),
        read_config(path),
    )
    labels = framed_target_ids(tokenizer, ["low high", " middle le", "haut"], 16, framing)
    prefix = list(framing.label_prefix)
    eos = tokenizer.eos_token_id
    for ids, text in zip(labels, [" low high", " middle le", " haut"]):
        assert ids == prefix + tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    assert tokenizer.convert_ids_to_tokens(labels[0][len(prefix) :]) == ["Ġlow", "Ġhigh", "<|endoftext|>"]
    assert tokenizer.convert_ids_to_tokens(labels[1][len(prefix) :]) == ["Ġmiddle", "Ġle", "<|endoftext|>"]
    # Cut to target_len as before: the prompt, the first word, EOS.
    assert framed_target_ids(tokenizer, ["low high"], len(prefix) + 2, framing) == [
        labels[0][: len(prefix) + 1] + [eos]
    ]


def test_a_speech_run_is_counted_in_clips(speech, tmp_path, capsys):
    """Plan, speed and card say clips, seconds of audio and decoder tokens, not seq_len tokens."""
    config = TrainConfig(**speech_config(speech, "english", tmp_path, max_steps=2, eval_every=2))
    final = run_training(config)
    plan = capsys.readouterr().out
    # 9 clips of 0.5 s; labels <|notimestamps|> + two words + EOS = 4 each.
    assert "  clips            6 (6 to go), about 3 s of audio" in plan
    assert (
        "  clips per step   3 = batch_size 3 × grad_accum 1 × processes 1; each read as a 1 s window, 50 encoder "
        "positions\n" in plan
    )
    assert (
        "  train data       9 clips (4.5 s of audio, 36 decoder tokens), 0.667 epochs over them; eval: the same 3 "
        "clips each time\n" in plan
    )
    assert "tokens per step" not in plan and "blocks" not in plan
    step = records(config.output_dir)[1]
    assert step["perf/clips_per_second"] == pytest.approx(3 / step["perf/step_time_s"])
    record = json.loads((final / "uptrain.json").read_text())["uptraining"]
    assert record["speech"] == {
        "clips": 6,
        "clips_per_step": 3,
        "audio_seconds": 3.0,
        "window_seconds": 1.0,
        "encoder_positions": 50,
    }
    assert (
        "- Budget: 6 clips (about 3 s of audio) in 2 optimizer steps (global batch 3 clips, each read as a 1 s window "
        "of 50 encoder positions; 1 process)\n" in (final / "README.md").read_text()
    )


def test_a_speech_run_counts_the_target_tokens_it_read(speech, tmp_path):
    """`train/tokens_seen` of a speech run: the labels the loss read, not seq_len per clip nor the
    padding of a batch to its longest transcript."""
    root = tmp_path / "lengths"
    (root / "audio").mkdir(parents=True)
    texts = ["low", "middle high", "high low middle"]  # labels <|notimestamps|> + words + EOS: 3, 4, 5
    for name, hz in TONES.items():
        write_wav(root / "audio" / f"{name}.wav", hz)
    write_jsonl(root / "train.jsonl", [{"audio": f"audio/{n}.wav", "text": t} for n, t in zip(TONES, texts)])
    values = speech_config(speech, "english", tmp_path, max_steps=2, eval_every=2)
    config = TrainConfig(**{**values, "train_data": str(root / "train.jsonl")})
    run_training(config)
    seen = [r["train/tokens_seen"] for r in records(config.output_dir) if "train/tokens_seen" in r]
    # batch_size 3 reads all three clips each step: 12 real tokens (15 padded, 96 as seq_len × 3).
    assert seen == [0, 12, 24]


def test_whisper_prompt_refusals(speech, tmp_path, s2s_bart):
    multilingual = speech_config(speech, "multilingual", tmp_path)
    refuses(multilingual, r"is a multilingual Whisper and its generation config names no language: set `language`")
    refuses({**multilingual, "language": "de"}, r"`language` 'de' is not a language of .* lang_to_id: en, fr")
    english = speech_config(speech, "english", tmp_path)
    refuses({**english, "language": "en"}, r"is an English-only Whisper .* it takes no `language`")
    refuses({**english, "speech_task": "translate"}, r"it takes no `speech_task`")
    refuses({**multilingual, "language": "fr", "target_len": 4}, r"target_len 4 leaves no room for text after")
    refuses({**multilingual, "source_lang": "fr"}, r"`source_lang` applies to objective pairs of mBART")
    bart = {**multilingual, "model": str(s2s_bart), "train_data": str(speech["root"] / "train.jsonl")}
    refuses({**bart, "language": "fr", "objective": "text_infilling"}, r"`language` applies to Whisper checkpoints")
    from uptrain import UptrainError

    with pytest.raises(UptrainError, match="`speech_task`: must be one of 'transcribe', 'translate' or null, not 'sum"):
        TrainConfig(**{**multilingual, "speech_task": "summarize"})


@pytest.fixture(scope="module")
def s2s_bart(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bart")
    return build_model("bart", root / "bart", build_tokenizer("the cat a dog", sentinels=False))


# Translation: the tokenizer's language codes (mBART, mBART-50, NLLB on M2M100) and Marian's source token.

TEXT_WORDS = ["the", "cat", "a", "dog", "old", "king", "my", "sister"]


def unigram_vocab() -> list[tuple[str, float]]:
    """mBART's sentencepiece-style vocabulary: its four specials, the word boundary, whole words."""
    return [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)] + [
        (f"▁{w}", -1.0) for w in TEXT_WORDS
    ]


def translation_tokenizer(kind: str):
    from transformers import MBart50Tokenizer, MBartTokenizer, NllbTokenizer

    if kind == "mbart":  # mBART-cc25 / en-ro: codes close the text ([…, </s>, code])
        return MBartTokenizer(vocab=unigram_vocab(), src_lang="en_XX", tgt_lang="ro_RO")
    if kind == "mbart50":  # mBART-50: codes open it ([code, …, </s>])
        return MBart50Tokenizer(vocab=unigram_vocab(), src_lang="en_XX", tgt_lang="ro_RO")
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "▁": 4}  # NLLB: BPE, here on characters
    for c in "".join(TEXT_WORDS):
        vocab.setdefault(c, len(vocab))
    return NllbTokenizer(vocab=vocab, merges=[], src_lang="eng_Latn", tgt_lang="fra_Latn")


def build_translation_model(kind: str, folder: Path) -> Path:
    """A 2-layer mBART or M2M100 (NLLB's architecture) with `translation_tokenizer(kind)`. The
    decoder starts as the published checkpoints' do: mBART-cc25 from the target code (its labels
    end with it, and its shift wraps it round to the front), mBART-50 and NLLB from EOS, the code
    then forced as the first token (`forced_bos_token_id`)."""
    import transformers as tf

    tokenizer = translation_tokenizer(kind)
    torch.manual_seed(0)
    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **TINY_GEOMETRY,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
    )
    if kind == "nllb":
        model = tf.M2M100ForConditionalGeneration(
            tf.M2M100Config(decoder_start_token_id=tokenizer.eos_token_id, **common)
        )
    else:
        start = tokenizer.convert_tokens_to_ids("ro_RO") if kind == "mbart" else tokenizer.eos_token_id
        model = tf.MBartForConditionalGeneration(
            tf.MBartConfig(decoder_start_token_id=start, forced_bos_token_id=None, **common)
        )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


PAIRS = [("the old king", "a dog"), ("my sister", "the cat the dog"), ("a cat", "my old sister")]


@pytest.fixture(scope="module")
def translation(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("translation")
    rows = [{"source": s, "target": t} for s, t in PAIRS]
    write_jsonl(root / "train.jsonl", rows * 2)
    write_jsonl(root / "eval.jsonl", rows)
    return {"root": root, **{k: build_translation_model(k, root / k) for k in ("mbart", "mbart50", "nllb")}}


def translation_config(translation, kind: str, tmp_path, **overrides) -> dict:
    return {
        "model": str(translation[kind]),
        "objective": "pairs",
        "train_data": str(translation["root"] / "train.jsonl"),
        "eval_data": str(translation["root"] / "eval.jsonl"),
        "output_dir": str(tmp_path / f"run-{kind}"),
        "seq_len": 32,  # no pair is cut
        "batch_size": 3,
        "lr": 1e-3,
        "max_steps": 1,
        "eval_every": 1,
        "save_every": 10,
        "seed": 0,
        "report_to": ["jsonl"],
        **overrides,
    }


def translation_nll(kind: str, model_path: Path, source_code: str, target_code: str) -> float:
    """Mean NLL per target token of every eval pair, its sequences written here by hand: the source
    with its code where the family writes it, the decoder fed what `generate` starts with (NLLB and
    mBART-50: EOS, then the code `forced_bos_token_id` forces; mBART-cc25: the code, its decoder start)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(model_path).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    src, tgt, eos = tok.convert_tokens_to_ids(source_code), tok.convert_tokens_to_ids(target_code), tok.eos_token_id
    total, count = 0.0, 0
    for source, target in PAIRS:
        s, t = (tok.encode(x, add_special_tokens=False) for x in (source, target))
        if kind == "mbart":  # [text, </s>, code]; the decoder starts from the code
            source_ids, decoder_ids, labels = s + [eos, src], [tgt] + t + [eos], t + [eos, tgt]
        else:  # [code, text, </s>]; the decoder starts from </s>
            source_ids, decoder_ids, labels = [src] + s + [eos], [eos, tgt] + t, [tgt] + t + [eos]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([source_ids]), decoder_input_ids=torch.tensor([decoder_ids])).logits
        nll = -torch.log_softmax(logits.double(), dim=-1)[0].gather(1, torch.tensor(labels)[:, None])
        total, count = total + nll.sum().item(), count + nll.numel()
    return total / count


@pytest.mark.parametrize(
    ("kind", "keys", "codes"),
    [
        ("mbart", {}, ("en_XX", "ro_RO")),  # the tokenizer's saved codes
        ("mbart", {"source_lang": "de_DE", "target_lang": "fr_XX"}, ("de_DE", "fr_XX")),
        ("mbart50", {"target_lang": "fr_XX"}, ("en_XX", "fr_XX")),
        ("nllb", {}, ("eng_Latn", "fra_Latn")),
        ("nllb", {"source_lang": "deu_Latn", "target_lang": "spa_Latn"}, ("deu_Latn", "spa_Latn")),
    ],
)
def test_translation_targets_carry_the_target_language_code(translation, tmp_path, capsys, kind, keys, codes):
    config = TrainConfig(**translation_config(translation, kind, tmp_path, **keys))
    run_training(config)
    assert f"prompt {codes[0]} → {codes[1]}" in capsys.readouterr().out
    expected = translation_nll(kind, translation[kind], *codes)
    assert records(config.output_dir)[0]["eval/loss"] == pytest.approx(expected, rel=1e-5)
    if kind != "mbart":  # generate() with forced_bos_token_id starts from what the labels are scored after
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        model, tok = AutoModelForSeq2SeqLM.from_pretrained(config.model), AutoTokenizer.from_pretrained(config.model)
        code = tok.convert_tokens_to_ids(codes[1])
        out = model.generate(torch.tensor([[5, 6, 2]]), forced_bos_token_id=code, max_new_tokens=2)
        assert out[0, :2].tolist() == [tok.eos_token_id, code]


def test_translation_prompt_refusals(translation, tmp_path, speech):
    nllb = translation_config(translation, "nllb", tmp_path)
    refuses({**nllb, "target_lang": "xx_Yyyy"}, r"`target_lang` 'xx_Yyyy' is not a language code of the tokenizer")
    refuses({**nllb, "language": "fr"}, r"`language` applies to Whisper checkpoints .* is M2M100, trained on objective")
    whisper = speech_config(speech, "english", tmp_path)
    refuses({**whisper, "target_lang": "fr"}, r"`target_lang` applies to objective pairs of mBART")
    # mBART trained on its default objective (text infilling of blocks) has no pairs to frame.
    text = translation["root"] / "text.txt"
    text.write_text(" ".join(TEXT_WORDS * 40))
    mbart = translation_config(translation, "mbart", tmp_path, objective=None)
    mbart.update(train_data=str(text), eval_data=str(text), target_lang="fr_XX")
    refuses(mbart, r"`target_lang` applies to .* is mBART, trained on objective text_infilling")


def test_marian_multi_writes_the_target_code_ahead_of_each_source(tmp_path):
    """A multilingual Marian reads its target language from a `>>code<<` token opening the source."""
    from tests.train.test_seq2seq import build_tokenizer as word_tokenizer
    from uptrain.architecture import architecture
    from uptrain.data.pairs import load_pairs
    from uptrain.model_info import read_config
    from uptrain.objectives import OBJECTIVES
    from uptrain.objectives.prompts import PromptKeys, target_framing

    tokenizer = word_tokenizer(" ".join(TEXT_WORDS), sentinels=False)
    tokenizer.add_special_tokens({"additional_special_tokens": [">>fra<<", ">>spa<<"]})
    folder = build_model("marian", tmp_path / "marian", tokenizer)
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"source": s, "target": t} for s, t in PAIRS])
    config = read_config(folder)

    def examples(keys: PromptKeys):
        framing = target_framing(architecture("marian"), OBJECTIVES["pairs"], keys, tokenizer, str(folder), config)
        return load_pairs(str(data), "eval_data", OBJECTIVES["pairs"], tokenizer, str(folder), config, 16, 16, framing)

    plain, french = examples(PromptKeys()), examples(PromptKeys(target_lang="fra"))
    code = tokenizer.convert_tokens_to_ids(">>fra<<")
    assert [s[0] for s in french.sources] == [code] * len(PAIRS)
    assert [s[1:] for s in french.sources] == plain.sources
    assert french.targets == plain.targets  # the targets carry no code
    from uptrain import UptrainError

    with pytest.raises(UptrainError, match=r"`target_lang` 'deu': the tokenizer of .* has no >>deu<< token"):
        examples(PromptKeys(target_lang="deu"))
    with pytest.raises(UptrainError, match=r"`source_lang` applies to objective pairs of mBART and M2M100/NLLB"):
        examples(PromptKeys(source_lang="eng"))


@pytest.mark.parametrize("kind", ["mbart", "mbart50", "nllb"])
def test_a_cut_target_keeps_the_tokenizers_closing_tokens(translation, kind):
    """target_len cuts the text, never mBART's closing </s> + code (nor EOS)."""
    from transformers import AutoTokenizer

    from uptrain.data.pairs import load_pairs
    from uptrain.model_info import read_config
    from uptrain.objectives import OBJECTIVES

    path = translation[kind]
    tok = AutoTokenizer.from_pretrained(path)
    eos, code = tok.eos_token_id, tok.convert_tokens_to_ids(tok.tgt_lang)
    examples = load_pairs(
        str(translation["root"] / "eval.jsonl"), "eval_data", OBJECTIVES["pairs"], tok, str(path),
        read_config(path), 32, 4,
    )  # fmt: skip
    for target, (_, text) in zip(examples.targets, PAIRS, strict=True):
        words = tok.encode(text, add_special_tokens=False)
        assert target == (words[:2] + [eos, code] if kind == "mbart" else [code] + words[:2] + [eos])


@pytest.mark.parametrize(
    ("kind", "keys", "codes"),
    [
        ("nllb", {}, ("eng_Latn", "fra_Latn")),  # the tokenizer's saved codes
        ("nllb", {"source_lang": "deu_Latn", "target_lang": "spa_Latn"}, ("deu_Latn", "spa_Latn")),
        ("mbart50", {"target_lang": "fr_XX"}, ("en_XX", "fr_XX")),  # mBART trained on pairs calibrates on pairs
    ],
)
def test_calibration_pairs_carry_the_language_codes_training_frames_them_with(translation, tmp_path, kind, keys, codes):
    """A calibrated conversion of `source` in `uptrain train` calibrates on its training pairs as
    training reads them: the same objective (an mBART trained on pairs, not its default infilling),
    the source and target language codes of the run's keys, the same examples."""
    from transformers import AutoTokenizer

    from uptrain.architecture import architecture
    from uptrain.convert.calibration_seq2seq import calibration_batches
    from uptrain.convert.pipeline import _prompt_keys
    from uptrain.convert.spec import CalibrationSettings
    from uptrain.data.pairs import load_pairs
    from uptrain.model_info import read_config
    from uptrain.objectives import OBJECTIVES
    from uptrain.objectives.prompts import PromptKeys, target_framing

    values = translation_config(translation, kind, tmp_path, **keys)
    folder = Path(values.pop("model"))
    config = TrainConfig(**values, source=str(folder), num_kv_heads=2, pooling="calibrated")
    spec = config.conversion_spec()
    arch = architecture(read_config(folder)["model_type"])
    batches, info = calibration_batches(
        folder, arch, spec.calibration_data, CalibrationSettings.of(spec), 3, _prompt_keys(spec)
    )
    assert info["objective"] == "pairs" and info["examples"] == 2 * len(PAIRS)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    source_code, target_code = (tokenizer.convert_tokens_to_ids(code) for code in codes)
    for batch in batches:
        assert all(source_code in row for row in batch["input_ids"].tolist())
        assert all(target_code in row for row in batch["labels"].tolist())
    # The very examples training reads (`load_pairs` with the run's framing), in order.
    framing = target_framing(arch, OBJECTIVES["pairs"], PromptKeys(**keys), tokenizer, str(folder), read_config(folder))
    trained = load_pairs(
        values["train_data"],
        "train_data",
        OBJECTIVES["pairs"],
        tokenizer,
        str(folder),
        read_config(folder),
        32,
        32,
        framing,
    )
    expected = [trained.take(list(range(start, start + 3))) for start in (0, 3)]
    assert len(batches) == len(expected)
    for batch, example in zip(batches, expected, strict=True):
        assert batch.keys() == example.keys() and all(torch.equal(batch[k], example[k]) for k in batch)


def test_marian_calibration_pairs_carry_the_target_code_ahead_of_each_source(tmp_path):
    """`uptrain convert --target-lang fra` on a multilingual Marian: each calibration source opens
    with `>>fra<<`, as training writes it; a family without language codes refuses the key in one line."""
    from tests.train.test_seq2seq import build_tokenizer as word_tokenizer
    from uptrain.cli import main

    tokenizer = word_tokenizer(" ".join(TEXT_WORDS), sentinels=False)
    tokenizer.add_special_tokens({"additional_special_tokens": [">>fra<<", ">>spa<<"]})
    folder = build_model("marian", tmp_path / "marian", tokenizer)
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"source": s, "target": t} for s, t in PAIRS])
    from uptrain.architecture import architecture
    from uptrain.convert.calibration_seq2seq import calibration_batches
    from uptrain.convert.spec import DEFAULT_CALIBRATION
    from uptrain.objectives.prompts import PromptKeys

    code = tokenizer.convert_tokens_to_ids(">>fra<<")
    arch = architecture("marian")
    [french], _ = calibration_batches(folder, arch, str(data), DEFAULT_CALIBRATION, 4, PromptKeys(target_lang="fra"))
    [plain], _ = calibration_batches(folder, arch, str(data), DEFAULT_CALIBRATION, 4, PromptKeys())
    assert french["input_ids"][:, 0].tolist() == [code] * len(PAIRS) and code not in plain["input_ids"]
    argv = ["convert", str(folder), str(tmp_path / "out"), "-g", "2", "--pooling", "calibrated"]
    assert main([*argv, "--calibration-data", str(data), "--target-lang", "fra"]) == 0
    assert json.loads((tmp_path / "out" / "uptrain.json").read_text())["calibration"]["prompt"] == (
        ">>fra<< ahead of each source"
    )
    assert (
        main([*argv[:2], str(tmp_path / "out2"), *argv[3:], "--calibration-data", str(data), "--source-lang", "eng"])
        == 2
    )
    assert not (tmp_path / "out2").exists()
