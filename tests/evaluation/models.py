"""Tiny real checkpoints and local task data for the evaluation tests: a word-level tokenizer, a
BART and a Whisper (the training tests' builders), a GPT-2 and a Llama, and their conversions at
G = h (`uptrain convert`, so GPT-2's is `gpt2_gqa`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tests.train.test_seq2seq import TONES, WORDS, build_model, build_tokenizer, write_jsonl, write_wav
from tests.train.train_helpers import make_text
from uptrain.cli import main


def build_decoder_only(kind: str, folder: Path, tokenizer, seed: int = 0) -> Path:
    """A 2-layer, 4-head GPT-2 or Llama with `tokenizer`, saved to `folder`."""
    import transformers as tf

    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=96, **ids)
        model = tf.GPT2LMHeadModel(config)
    else:
        config = tf.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=96,
            **ids,
        )
        model = tf.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def convert(src: Path, out: Path, num_kv_heads: int, *extra: str) -> Path:
    args = ["convert", str(src), str(out), "--num-kv-heads", str(num_kv_heads), "--source-hash", "none", *extra]
    assert main(args) == 0
    return out


def write_task_data(root: Path) -> dict[str, Path]:
    """Local jsonl files: text pairs (the target the source's words reversed), QA pairs with
    further accepted answers, speech pairs of tones."""
    rng = random.Random(0)
    sources = [" ".join(rng.sample(WORDS, 2)) for _ in range(6)]
    pairs = write_jsonl(root / "pairs.jsonl", [{"source": s, "target": " ".join(reversed(s.split()))} for s in sources])
    qa = write_jsonl(
        root / "qa.jsonl",
        [{"source": f"who : {s}", "target": s.split()[1], "answers": [s.split()[-1]]} for s in sources],
    )
    audio = root / "audio"
    audio.mkdir(exist_ok=True)
    for name, hz in TONES.items():
        write_wav(audio / f"{name}.wav", hz)
    speech = write_jsonl(root / "speech.jsonl", [{"audio": f"audio/{name}.wav", "text": name} for name in TONES])
    return {"pairs": pairs, "qa": qa, "speech": speech}


def build_all(root: Path) -> dict[str, Path]:
    """Every model of the tests (and its G = h conversion, `<kind>-gqa`) and the task data."""
    words = make_text(1, 40) + " low middle high who : " + " ".join(WORDS)
    tokenizer = build_tokenizer(words, sentinels=False)
    paths: dict[str, Path] = write_task_data(root)
    for kind in ("bart", "whisper"):
        paths[kind] = build_model(kind, root / kind, tokenizer)
    for kind in ("gpt2", "llama"):
        paths[kind] = build_decoder_only(kind, root / kind, tokenizer)
    for kind in ("bart", "whisper", "gpt2", "llama"):
        paths[f"{kind}-gqa"] = convert(paths[kind], root / f"{kind}-gqa", 4)
    return paths


def evaluate_json(*args: str, capsys) -> dict:
    """`uptrain evaluate … --json`, parsed."""
    capsys.readouterr()
    assert main(["evaluate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)
