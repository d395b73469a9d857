"""Fixtures for the training tests: a tiny corpus, a tokenizer trained on it offline, a tiny MHA
Llama (8 heads) and its GQA conversion (2 KV heads) made by the real converter."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Before transformers / datasets / wandb are imported: no network, no writes outside tmp.
_HOME = Path(tempfile.mkdtemp(prefix="uptrain-train-tests-"))
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(_HOME / "hf"),
        "WANDB_MODE": "offline",
        "WANDB_CONFIG_DIR": str(_HOME / "wandb-config"),
        "WANDB_CACHE_DIR": str(_HOME / "wandb-cache"),
        "WANDB_DATA_DIR": str(_HOME / "wandb-data"),
        # One thread per process: the 2 cores are shared, and spinning OpenMP threads on a busy
        # machine make a tiny model 100× slower. Subprocess runs inherit it, so their kernels
        # (and results) match the in-process runs bit for bit.
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from tests.train.train_helpers import build_llama, build_tokenizer, make_text, reset_accelerate  # noqa: E402


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    """Corpus files, the MHA teacher, its 2-KV-head conversion and a model with another tokenizer."""
    from uptrain.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("assets")
    train_text, eval_text = make_text(1, 300), make_text(2, 40)
    (root / "train.txt").write_text(train_text)
    (root / "eval.txt").write_text(eval_text)
    tokenizer = build_tokenizer(train_text + eval_text)
    mha = build_llama(root / "mha", tokenizer, num_kv_heads=8)
    gqa = convert_checkpoint(mha, root / "gqa", 2, progress=False)
    other = build_llama(root / "other-tokenizer", build_tokenizer(train_text, eos="<end>"), num_kv_heads=8)
    return {
        "root": root,
        "train": root / "train.txt",
        "eval": root / "eval.txt",
        "mha": mha,
        "gqa": gqa,
        "other": other,
    }


@pytest.fixture
def base_config(assets, tmp_path) -> dict:
    """A run small enough for a few seconds on 2 shared cores."""
    return {
        "model": str(assets["gqa"]),
        "train_data": str(assets["train"]),
        "eval_data": str(assets["eval"]),
        "output_dir": str(tmp_path / "run"),
        "seq_len": 32,
        "batch_size": 4,
        "grad_accum": 1,
        "lr": 3e-3,
        "warmup_steps": 2,
        "max_steps": 6,
        "eval_every": 3,
        "save_every": 2,
        "eval_blocks": 8,
        "seed": 0,
        "report_to": ["jsonl"],
    }


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process run starts from a clean one."""
    yield
    reset_accelerate()
