"""Uptraining encoder–decoders (issue #19): T5 (and UMT5) on span corruption, BART on text infilling, Marian,
M2M100 and Pegasus on text pairs, Whisper on speech pairs — tiny real transformers models built
from configs.

The loop's losses are checked against the models' own `forward(labels=…)` loss on batches built
here from the data, resume continues bit for bit, distillation runs, and bad input is one line
with nothing written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.train.train_helpers import KILLER, curve, make_text, python_env, records
from uptrain import UptrainError
from uptrain.data.batches import TrainBlocks, eval_batches
from uptrain.data.objective_batches import objective_for
from uptrain.data.pairs import load_pairs
from uptrain.data.text import load_blocks
from uptrain.objectives import OBJECTIVES
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training

SENTINELS = 20
SAMPLING_RATE = 16000


def build_tokenizer(text: str, sentinels: bool):
    """A word-level tokenizer trained on `text`: T5's specials and sentinels, or BART's with <mask>."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>", "<s>"] + ([] if sentinels else ["<mask>"])
    tok = Tokenizer(WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.train_from_iterator([text], WordLevelTrainer(special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        **({} if sentinels else {"mask_token": "<mask>"}),
    )
    if sentinels:
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(SENTINELS)]})
    return tokenizer


def build_model(kind: str, folder: Path, tokenizer, seed: int = 0, dropout: float = 0.0) -> Path:
    """Save a 2-layer, d_model 32, 4-head encoder–decoder of `kind` with `tokenizer` to `folder`.
    No dropout unless asked for: the loop's training-mode losses then equal the model's own
    evaluation-mode loss."""
    import transformers as tf

    torch.manual_seed(seed)
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    layers = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4)
    ffn = dict(encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32, dropout=dropout, attention_dropout=dropout)
    vocab = len(tokenizer)
    if kind in ("t5", "umt5"):
        config = (tf.UMT5Config if kind == "umt5" else tf.T5Config)(
            vocab_size=vocab,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            dropout_rate=dropout,
            **ids,
        )
        model = (tf.UMT5ForConditionalGeneration if kind == "umt5" else tf.T5ForConditionalGeneration)(config)
    elif kind == "bart":
        config = tf.BartConfig(
            vocab_size=vocab,
            max_position_embeddings=64,
            bos_token_id=tokenizer.bos_token_id,
            decoder_start_token_id=tokenizer.eos_token_id,
            forced_bos_token_id=None,
            **layers,
            **ffn,
            **ids,
        )
        model = tf.BartForConditionalGeneration(config)
    elif kind == "marian":
        config = tf.MarianConfig(
            vocab_size=vocab,
            max_position_embeddings=64,
            decoder_start_token_id=tokenizer.pad_token_id,
            **layers,
            **ffn,
            **ids,
        )
        model = tf.MarianMTModel(config)
    elif kind == "m2m_100":
        # Its decoder starts from EOS, as M2M100's and NLLB's do; no layer drop (its default skips
        # layers at random in training, which the loss checks below would see).
        config = tf.M2M100Config(
            vocab_size=vocab,
            max_position_embeddings=64,
            bos_token_id=tokenizer.bos_token_id,
            decoder_start_token_id=tokenizer.eos_token_id,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
            **layers,
            **ffn,
            **ids,
        )
        model = tf.M2M100ForConditionalGeneration(config)
    elif kind == "pegasus":
        config = tf.PegasusConfig(  # its decoder starts from padding, as Pegasus's does
            vocab_size=vocab,
            max_position_embeddings=64,
            decoder_start_token_id=tokenizer.pad_token_id,
            **layers,
            **ffn,
            **ids,
        )
        model = tf.PegasusForConditionalGeneration(config)
    else:
        config = tf.WhisperConfig(
            vocab_size=vocab,
            num_mel_bins=16,
            max_source_positions=50,  # 1 s of audio: 100 frames, halved by the encoder's strided conv
            max_target_positions=64,
            decoder_start_token_id=tokenizer.bos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            **layers,
            **ffn,
            **ids,
        )
        model = tf.WhisperForConditionalGeneration(config)
        tf.WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLING_RATE, chunk_length=1).save_pretrained(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_wav(path: Path, frequency: float, seconds: float = 0.5, rate: int = SAMPLING_RATE) -> None:
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.5 * np.sin(2 * math.pi * frequency * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())


WORDS = ["the cat", "a dog", "the old king", "my sister", "the sailor", "a small bird", "the queen", "our teacher"]
TONES = {"low": 220.0, "middle": 880.0, "high": 3000.0}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def s2s(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    train_text, eval_text = make_text(1, 300), make_text(2, 40)
    (root / "train.txt").write_text(train_text)
    (root / "eval.txt").write_text(eval_text)
    words = train_text + eval_text + " low middle high"
    t5_tok, bart_tok = build_tokenizer(words, sentinels=True), build_tokenizer(words, sentinels=False)
    # Pairs: the target is the source's words in reverse order (a task a tiny model can start on).
    import random

    rng = random.Random(0)
    pairs = [" ".join(rng.sample(WORDS, 3)) for _ in range(80)]
    for name, part in (("pairs-train.jsonl", pairs[:64]), ("pairs-eval.jsonl", pairs[64:])):
        write_jsonl(root / name, [{"source": p, "target": " ".join(reversed(p.split()))} for p in part])
    audio = root / "audio"
    audio.mkdir()
    for name, hz in TONES.items():
        write_wav(audio / f"{name}.wav", hz)
    speech = [{"audio": f"audio/{name}.wav", "text": f"{name} {name}"} for name in TONES for _ in range(4)]
    write_jsonl(root / "speech-train.jsonl", speech)
    # Audio given as samples in the file, too.
    t = np.arange(SAMPLING_RATE // 4) / SAMPLING_RATE
    inline = {"audio": (0.3 * np.sin(2 * math.pi * 440 * t)).round(4).tolist(), "text": "middle"}
    write_jsonl(root / "speech-eval.jsonl", [speech[0], speech[5], inline])
    return {
        "root": root,
        "train": root / "train.txt",
        "eval": root / "eval.txt",
        "t5": build_model("t5", root / "t5", t5_tok),
        "umt5": build_model("umt5", root / "umt5", t5_tok),
        "t5-teacher": build_model("t5", root / "t5-teacher", t5_tok, seed=1),
        # T5's own default: resume must restore the dropout RNG and the training mode too.
        "t5-dropout": build_model("t5", root / "t5-dropout", t5_tok, dropout=0.1),
        "bart": build_model("bart", root / "bart", bart_tok),
        "marian": build_model("marian", root / "marian", bart_tok),
        "marian-teacher": build_model("marian", root / "marian-teacher", bart_tok, seed=1),
        "whisper": build_model("whisper", root / "whisper", bart_tok),
        "m2m_100": build_model("m2m_100", root / "m2m_100", bart_tok),
        "pegasus": build_model("pegasus", root / "pegasus", bart_tok),
    }


def run_config(s2s, kind: str, tmp_path, **overrides) -> dict:
    data = {
        "t5": ("train", "eval"),
        "t5-dropout": ("train", "eval"),
        "umt5": ("train", "eval"),
        "bart": ("train", "eval"),
        "marian": ("pairs-train.jsonl", "pairs-eval.jsonl"),
        "whisper": ("speech-train.jsonl", "speech-eval.jsonl"),
        "m2m_100": ("pairs-train.jsonl", "pairs-eval.jsonl"),
        "pegasus": ("pairs-train.jsonl", "pairs-eval.jsonl"),
    }[kind]
    train, evaluation = (s2s[d] if d in s2s else s2s["root"] / d for d in data)
    return {
        "model": str(s2s[kind]),
        "train_data": str(train),
        "eval_data": str(evaluation),
        "output_dir": str(tmp_path / f"run-{kind}"),
        "seq_len": 32,
        "batch_size": 4,
        "lr": 3e-3,
        "warmup_steps": 1,
        "max_steps": 4,
        "eval_every": 4,
        "save_every": 2,
        "eval_blocks": 8,
        "seed": 0,
        "report_to": ["jsonl"],
        **overrides,
    }


def eval_set_here(config: TrainConfig, objective_name: str) -> list:
    """The evaluation batches, built from the data with uptrain's data functions, not the loop."""
    from transformers import AutoTokenizer

    from uptrain.model_info import read_config

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    model_config = read_config(config.model)
    objective = objective_for(OBJECTIVES[objective_name], config.seed, tokenizer, model_config, config.model)
    if objective_name in ("pairs", "speech_pairs"):
        examples = load_pairs(
            config.eval_data,
            "eval_data",
            OBJECTIVES[objective_name],
            tokenizer,
            config.model,
            model_config,
            config.seq_len,
            config.target_len or config.seq_len,
        )
        return eval_batches(examples, config.eval_blocks, config.batch_size, 0, 1)
    blocks, _ = load_blocks(
        config.eval_data,
        "eval_data",
        tokenizer,
        OBJECTIVES[objective_name].block_length(config.seq_len),
        "text",
        "train",
        None,
        "paragraph",
        False,
        None,
    )
    return [(objective.eval_batch(rows), c) for rows, c in eval_batches(blocks, config.eval_blocks, 4, 0, 1)]


def models_own_loss(model_path: str, batches: list) -> float:
    """Mean loss per label token, from each batch's `forward(labels=…).loss` (a mean over its labels)."""
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    auto = AutoModelForSpeechSeq2Seq if "whisper" in model_path else AutoModelForSeq2SeqLM
    model = auto.from_pretrained(model_path).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch, counted in batches:
            assert counted.all()
            n = int((batch["labels"] != -100).sum())
            total += model(**batch).loss.double().item() * n
            count += n
    return total / count


CASES = [
    ("t5", "span_corruption"),
    ("umt5", "span_corruption"),
    ("bart", "text_infilling"),
    ("marian", "pairs"),
    ("whisper", "speech_pairs"),
    ("m2m_100", "pairs"),
    ("pegasus", "pairs"),
]


@pytest.mark.parametrize(("kind", "objective"), CASES)
def test_trains_with_the_family_objective(s2s, tmp_path, capsys, kind, objective):
    config = TrainConfig(**run_config(s2s, kind, tmp_path, max_steps=6, eval_every=3, lr=1e-2))
    final = run_training(config)
    assert f"objective        {objective}" in capsys.readouterr().out  # the family's default, no key given
    recs = records(config.output_dir)
    assert [r["step"] for r in recs] == list(range(7))
    assert all(math.isfinite(r["train/loss"]) for r in recs[1:])
    evals = [r["eval/loss"] for r in recs if "eval/loss" in r]
    assert evals[-1] < evals[0]  # it learns
    # The loop's step-0 evaluation is the model's own loss on the same batches.
    assert recs[0]["eval/loss"] == pytest.approx(models_own_loss(config.model, eval_set_here(config, objective)), 1e-5)
    # …and the saved weights give the last evaluation.
    assert recs[-1]["eval/loss"] == pytest.approx(models_own_loss(str(final), eval_set_here(config, objective)), 1e-5)
    assert recs[0]["model/num_kv_heads"] == 4
    assert json.loads((final / "uptrain.json").read_text())["uptraining"]["config"]["objective"] == objective
    assert recs[0]["model/kv_cache_bytes_per_token"] == 2 * 2 * 4 * 8 * 4  # K,V × decoder layers × heads × d × fp32


def test_first_step_loss_is_the_models_own(s2s, tmp_path):
    """train/loss of step 1 is the model's own loss on the first batch (before the update)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from uptrain.model_info import read_config

    config = TrainConfig(**run_config(s2s, "t5", tmp_path, max_steps=1))
    run_training(config)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    block = OBJECTIVES["span_corruption"].block_length(32)
    blocks, _ = load_blocks(
        config.train_data, "train_data", tokenizer, block, "text", "train", None, "paragraph", False, None
    )  # fmt: skip
    objective = objective_for(OBJECTIVES["span_corruption"], 0, tokenizer, read_config(config.model), config.model)
    batch = objective.train_batch(TrainBlocks(blocks, 0, 4, 1, 1).micro_batches(0, 0)[0], 0, 0)
    assert batch["input_ids"].shape == (4, 32)  # span corruption gives exactly seq_len encoder tokens
    model = AutoModelForSeq2SeqLM.from_pretrained(config.model)
    assert records(config.output_dir)[1]["train/loss"] == pytest.approx(model(**batch).loss.item(), rel=1e-5)


def test_corruption_does_not_depend_on_the_split_of_a_step(s2s, tmp_path):
    big = TrainConfig(**run_config(s2s, "t5", tmp_path, max_steps=3, save_every=10))
    small = TrainConfig(
        **run_config(
            s2s, "t5", tmp_path, max_steps=3, save_every=10, batch_size=1, grad_accum=4, output_dir=str(tmp_path / "a")
        )
    )
    run_training(big)
    run_training(small)
    a, b = curve(big.output_dir), curve(small.output_dir)
    assert a.keys() == b.keys()
    for step in a:
        for k in a[step]:
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-5, abs=1e-6), (step, k)


@pytest.mark.parametrize("kind", ["t5-dropout", "whisper"])
def test_resume_after_kill_gives_the_same_curve(s2s, tmp_path, kind):
    values = run_config(s2s, kind, tmp_path, max_steps=6, save_every=2, eval_every=3)
    baseline = TrainConfig(**values)
    run_training(baseline)

    values["output_dir"] = str(tmp_path / "killed")
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(values))
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(path), "3"], env=python_env(), capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = subprocess.run(
        [str(Path(sys.executable).parent / "uptrain"), "train", "--config", str(path), "--resume"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step_00000002" in resumed.stdout
    # Exactly equal: the corruption of step 3 onwards is drawn again from (seed, step, row).
    assert curve(values["output_dir"]) == curve(baseline.output_dir)
    a = load_file(Path(baseline.output_dir) / "final" / "model.safetensors")
    b = load_file(Path(values["output_dir"]) / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_distillation_of_an_encoder_decoder(s2s, tmp_path):
    itself = TrainConfig(**run_config(s2s, "t5", tmp_path, teacher=str(s2s["t5"]), max_steps=1, save_every=10))
    run_training(itself)
    assert records(itself.output_dir)[1]["train/distill_kl"] == pytest.approx(0.0, abs=1e-5)
    other = TrainConfig(
        **run_config(
            s2s,
            "t5",
            tmp_path,
            teacher=str(s2s["t5-teacher"]),
            distill_weight=0.25,
            max_steps=2,
            save_every=10,
            output_dir=str(tmp_path / "other"),
        )
    )
    run_training(other)
    step1 = records(other.output_dir)[1]
    assert step1["train/distill_kl"] > 0
    assert step1["train/loss"] == pytest.approx(0.75 * step1["train/ce_loss"] + 0.25 * step1["train/distill_kl"])


def test_distillation_scores_labels_not_padding(s2s, tmp_path):
    """Marian pairs are padded: the KL of step 1 is the mean over the label tokens, recomputed here."""
    import torch.nn.functional as F
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from uptrain.model_info import read_config

    config = TrainConfig(**run_config(s2s, "marian", tmp_path, teacher=str(s2s["marian-teacher"]), max_steps=1))
    run_training(config)
    step1 = records(config.output_dir)[1]
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    examples = load_pairs(
        config.train_data, "train_data", OBJECTIVES["pairs"], tokenizer, config.model, read_config(config.model), 32, 32
    )
    batch = TrainBlocks(examples, 0, 4, 1, 1).micro_batches(0, 0)[0]
    scored = batch["labels"] != -100
    assert not scored.all()  # the batch is padded
    student, teacher = (AutoModelForSeq2SeqLM.from_pretrained(p) for p in (config.model, config.teacher))
    with torch.no_grad():
        s, t = (F.log_softmax(m(**batch).logits, dim=-1) for m in (student, teacher))
        kl = (t.exp() * (t - s)).sum(dim=-1)[scored].mean().item()
        ce = student(**batch).loss.item()
    assert step1["train/distill_kl"] == pytest.approx(kl, rel=1e-4)
    assert step1["train/ce_loss"] == pytest.approx(ce, rel=1e-5)


def refuses(config: dict, message: str) -> None:
    with pytest.raises(UptrainError, match=message) as err:
        run_training(TrainConfig(**config))
    assert "\n" not in str(err.value)
    assert not Path(config["output_dir"]).exists()  # nothing written


def test_refuses_objectives_the_model_cannot_learn(s2s, tmp_path):
    t5 = run_config(s2s, "t5", tmp_path)
    refuses({**t5, "objective": "causal"}, "objective causal is for decoder-only models; .* use span_corruption")
    refuses({**t5, "objective": "text_infilling"}, "objective text_infilling needs a mask token")
    refuses({**t5, "objective": "speech_pairs"}, "does not fit .* use span_corruption, text_infilling or pairs")
    bart = run_config(s2s, "bart", tmp_path)
    refuses({**bart, "objective": "span_corruption"}, "needs sentinel tokens <extra_id_0>")
    whisper = run_config(s2s, "whisper", tmp_path)
    refuses({**whisper, "objective": "pairs"}, "whose encoder reads audio: use speech_pairs")
    refuses({**t5, "teacher": str(s2s["bart"])}, "teacher .* uses another tokenizer")
    # 400 input tokens: 444-token blocks, 67 noise tokens in 22 spans, for 20 sentinels
    refuses({**t5, "seq_len": 400}, "444-token blocks drops 22 spans and the tokenizer has 20 sentinel tokens")
    refuses({**t5, "seq_len": 3}, "objective span_corruption needs seq_len of at least 4 tokens, got 3")
    refuses({**t5, "document_mask": True}, "document_mask applies to objective causal .*, not span_corruption")
    with pytest.raises(UptrainError, match="`target_len` applies to objective pairs"):
        from uptrain.train.config import validated_config

        validated_config({**t5, "objective": "span_corruption", "target_len": 8})


def test_refuses_a_decoder_only_model_with_a_seq2seq_objective(assets, base_config):
    refuses({**base_config, "objective": "span_corruption"}, "objective span_corruption needs an encoder–decoder model")


def test_refuses_bad_pairs(s2s, tmp_path):
    marian = run_config(s2s, "marian", tmp_path)
    bad = tmp_path / "bad.jsonl"
    cases = [
        ('{"source": "the cat"}\n', r"bad.jsonl line 1: no `target` field"),
        ('{"source": "the cat", "target": "  "}\n', r"bad.jsonl line 1: `target` is empty"),
        ('{"source": "the cat", "target": "a dog"}\n\n{"source": 3, "target": "a"}\n', r"line 3: `source` is int"),
        ('{"source": "the cat", "target": "a dog"}\n{"source"\n', r"line 2 is not valid JSON"),
        ("[1, 2]\n", r"line 1: a line must be a JSON object"),
    ]
    for text, message in cases:
        bad.write_text(text)
        refuses({**marian, "train_data": str(bad)}, message)
    refuses({**marian, "train_data": str(s2s["train"])}, r"is text files; objective pairs reads \.jsonl files")
    refuses({**marian, "target_len": 65}, "target_len 65 is beyond the decoder's 64 positions")


def test_refuses_bad_audio(s2s, tmp_path):
    whisper = run_config(s2s, "whisper", tmp_path)
    (tmp_path / "noise.wav").write_bytes(b"RIFF\x00\x00not a wav at all")
    write_wav(tmp_path / "slow.wav", 440, rate=8000)
    (tmp_path / "clip.flac").write_bytes(b"fLaC")
    write_wav(tmp_path / "cut.wav", 440)
    (tmp_path / "cut.wav").write_bytes((tmp_path / "cut.wav").read_bytes()[:-1])  # mid-sample: a copy cut short
    cases = [
        ("cut.wav", "cut.wav ends inside a frame"),
        ("noise.wav", "cannot decode .*noise.wav as PCM wav"),
        ("slow.wav", "slow.wav is sampled at 8000 Hz and the feature extractor reads 16000 Hz; resample it"),
        ("missing.wav", "cannot decode .*missing.wav"),
        ("clip.flac", "clip.flac is not a .wav file"),
    ]
    for name, message in cases:
        data = write_jsonl(tmp_path / "speech.jsonl", [{"audio": name, "text": "low"}])
        refuses({**whisper, "eval_data": str(data)}, message)
    data = write_jsonl(tmp_path / "speech.jsonl", [{"audio": [0.1, "x"], "text": "low"}])
    refuses({**whisper, "eval_data": str(data)}, "`audio` must be a wav path or a non-empty array of numbers")
    data = write_jsonl(tmp_path / "speech.jsonl", [{"audio": "audio/low.wav"}])
    refuses({**whisper, "eval_data": str(data)}, "no `text` field")


@pytest.mark.parametrize("kind", ["t5", "umt5"])
def test_flops_per_token_match_a_count_of_the_model(s2s, kind):
    """perf/mfu's FLOPs for T5 and UMT5 (whose parameters are all matmul weights but its norms) against
    torch's count of one forward + backward. The count's eager attention computes the decoder's
    causal scores in full, which the formula (as causal kernels) halves: added back here."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForSeq2SeqLM

    from uptrain.architecture import config_geometry
    from uptrain.model_info import read_config
    from uptrain.objectives import span_corruption_lengths
    from uptrain.train.metrics import encoder_decoder_flops_per_token

    model = AutoModelForSeq2SeqLM.from_pretrained(s2s[kind], attn_implementation="eager")
    config = read_config(s2s[kind])
    seq_len = 32
    target_len = span_corruption_lengths(seq_len)[1]
    inputs, labels = torch.randint(5, 50, (2, seq_len)), torch.randint(5, 50, (2, target_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=inputs, labels=labels).loss.backward()
    counted = counter.get_total_flops() / (2 * seq_len)
    dec = config_geometry(config)  # the decoder self-attention's
    full_causal = 6 * dec.num_layers * dec.num_heads * dec.head_dim * target_len**2 / seq_len
    formula = encoder_decoder_flops_per_token(model, config, OBJECTIVES["span_corruption"], seq_len, seq_len)
    assert formula + full_causal == pytest.approx(counted, rel=0.02)


def test_span_corruption_on_streamed_data_matches_tokenized(s2s, tmp_path):
    # Streamed blocks come in another order, so only step 0's evaluation (the first eval blocks in
    # file order, corrupted by the seed and their tokens) is the same.
    tokenized = TrainConfig(**run_config(s2s, "t5", tmp_path, max_steps=2, save_every=10))
    streamed = TrainConfig(
        **run_config(s2s, "t5", tmp_path, max_steps=2, save_every=10, streaming=True, output_dir=str(tmp_path / "s"))
    )
    run_training(tokenized)
    run_training(streamed)
    a, b = records(tokenized.output_dir), records(streamed.output_dir)
    assert b[0]["eval/loss"] == pytest.approx(a[0]["eval/loss"], rel=1e-6)
    assert all(math.isfinite(r["train/loss"]) for r in b[1:])


@pytest.mark.parametrize(
    ("kind", "objective"),
    [("t5", "span_corruption"), ("umt5", "span_corruption"), ("m2m_100", "pairs"), ("pegasus", "pairs")],
)
def test_convert_on_the_fly_and_uptrain_it(s2s, tmp_path, capsys, kind, objective):
    """`source` + `num_kv_heads`: the model is converted to its `*_gqa` type (decoder self- and
    cross-attention at 2 KV heads), loaded through uptrain's registration, and trained on its
    family's objective."""
    values = run_config(s2s, kind, tmp_path, max_steps=2, save_every=10)
    del values["model"]
    config = TrainConfig(**values, source=str(s2s[kind]), num_kv_heads=2)
    final = run_training(config)
    assert f"objective        {objective}" in capsys.readouterr().out
    recs = records(config.output_dir)
    assert recs[0]["model/num_kv_heads"] == 2
    assert recs[0]["model/kv_cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # K,V × decoder layers × 2 × d × fp32
    assert all(math.isfinite(r["train/loss"]) for r in recs[1:])
    assert json.loads((final / "config.json").read_text())["model_type"] == f"{kind}_gqa"
