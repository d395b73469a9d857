"""Shared by the training tests: the tiny corpus, tokenizer and model builders, and readers of a
run's outputs (metrics.jsonl, the wandb run)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "the old king", "my sister", "the sailor", "a small bird", "the queen", "our teacher"]
VERBS = ["sees", "likes", "follows", "finds", "remembers", "carries", "paints", "answers"]
OBJECTS = [
    "the red ball",
    "a letter",
    "the green hill",
    "the river",
    "a silver cup",
    "the garden",
    "an apple",
    "the long road",
]
ENDINGS = ["in the morning", "at night", "with care", "without a word", "again", "by the sea"]


def make_text(seed: int, paragraphs: int) -> str:
    """Deterministic pseudo-English: a small grammar a tiny model learns within a few steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(2, 5)):
            s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            if rng.random() < 0.5:
                s += " " + rng.choice(ENDINGS)
            sentences.append(s.capitalize() + ".")
        out.append(" ".join(sentences))
    return "\n\n".join(out) + "\n"


def build_tokenizer(text: str, eos: str = "</s>"):
    """A word-level tokenizer trained on `text`, wrapped for transformers."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.train_from_iterator([text], WordLevelTrainer(special_tokens=["<unk>", "<s>", eos]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token=eos)


def build_llama(folder: Path, tokenizer, num_kv_heads: int, seed: int = 0, max_positions: int = 128) -> Path:
    """Save a 2-layer Llama (hidden 64, 8 heads) with `tokenizer` to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons (the accelerator's and the gradient state); an
    in-process run after another one must start from fresh ones, as a new process would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


METRICS = [
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/tokens_seen",
    "eval/loss",
    "eval/perplexity",
    "perf/tokens_per_second",
    "perf/step_time_s",
    "perf/mfu",
    "perf/peak_memory_bytes",
    "model/num_kv_heads",
    "model/kv_cache_bytes_per_token",
]
CURVE = ["train/loss", "train/lr", "train/grad_norm", "train/tokens_seen", "eval/loss"]


def records(run_dir) -> list[dict]:
    from uptrain.train.metrics import read_metrics

    return read_metrics(Path(run_dir) / "metrics.jsonl")


def curve(run_dir) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in CURVE if k in r} for r in records(run_dir)}


def wandb_records(run_dir) -> tuple[list[dict], dict]:
    runs = list((Path(run_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    cmd = [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(runs[0])]
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    history = [json.loads(line)["history"] for line in lines if '"type":"history"' in line]
    summary = json.loads(subprocess.run(cmd + ["--summary"], check=True, capture_output=True, text=True).stdout)
    return history, summary


def python_env() -> dict[str, str]:
    """Environment for subprocess runs: the offline settings of conftest.py, this interpreter's venv."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


# Runs a config and SIGKILLs itself right after optimizer step argv[2]: a deterministic kill -9.
KILLER = textwrap.dedent("""
    import os, signal, sys
    from uptrain.train.config import load_config
    from uptrain.train.loop import run_training

    def kill(step, record):
        if step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, as when a node dies

    run_training(load_config(sys.argv[1], {}), on_step=kill)
""")
