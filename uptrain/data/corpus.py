"""The shipped public-domain corpus and tokenizer for the project's reference model.

The data ship inside the package (``uptrain/assets/``), so they are found the same way in an
editable and a regular install: relative to this file, never to a checkout or the working
directory. How they were made: ``uptrain/assets/corpus/README.md``.

* ``uptrain/assets/corpus/{train,validation,test}.jsonl.gz``: one JSON object per work,
  ``{"id", "source", "title", "text"}``; split by whole works
  (``scripts/extract_corpus.py``).
* ``uptrain/assets/tokenizer/``: byte-level BPE trained on the train split, HF format
  (``scripts/train_tokenizer.py``). It adds no special tokens by itself: when packing,
  append ``eos_token_id`` after each document.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy: `uptrain convert` should not pay for them
    from datasets import Dataset, DatasetDict
    from transformers import PreTrainedTokenizerFast

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
CORPUS_DIR = ASSETS_DIR / "corpus"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
SPLITS = ("train", "validation", "test")
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def split_path(split: str) -> Path:
    """Path of one split's ``.jsonl.gz`` file; raises if the split or the file is missing."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    path = CORPUS_DIR / f"{split}.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the package was installed without its data files "
            "(package-data in pyproject.toml) or scripts/extract_corpus.py was not run"
        )
    return path


def data_files() -> dict[str, str]:
    """``data_files`` for ``datasets.load_dataset("json", data_files=...)``."""
    return {split: str(split_path(split)) for split in SPLITS}


def read_documents(split: str) -> Iterator[dict]:
    """Yield the documents (whole works) of a split, in file order, without ``datasets``."""
    with gzip.open(split_path(split), "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def load_corpus(split: str | None = None, **kwargs) -> Dataset | DatasetDict:
    """Load the corpus with ``datasets`` (offline: the json builder ships with it).

    Each row is a whole work, so documents never straddle rows. ``kwargs`` go to
    ``load_dataset`` (e.g. ``cache_dir``, ``streaming=True``).
    """
    from datasets import load_dataset

    files = data_files() if split is None else {split: str(split_path(split))}
    ds = load_dataset("json", data_files=files, **kwargs)
    return ds if split is None else ds[split]


def load_tokenizer() -> PreTrainedTokenizerFast:
    """The shipped BPE tokenizer (``eos_token`` = ``bos_token`` = ``<|endoftext|>``)."""
    from transformers import PreTrainedTokenizerFast

    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{TOKENIZER_DIR} has no tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))


def _token_ids(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str]) -> Iterator[int]:
    # Every document is followed by EOS, as the training loop packs it, so the baseline
    # predicts the same token stream the model is scored on.
    # Whole splits are encoded as one batch: the fast tokenizer spreads a batch over cores.
    eos = tokenizer.eos_token_id
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        yield from ids
        yield eos


@dataclass(frozen=True)
class UnigramBaseline:
    """Perplexity of a context-free unigram model: the floor any LM should beat."""

    perplexity: float
    eval_tokens: int
    train_tokens: int
    vocab_size: int


def unigram_perplexity(
    tokenizer: PreTrainedTokenizerFast | None = None,
    train_split: str = "train",
    eval_split: str = "validation",
) -> UnigramBaseline:
    """Per-token perplexity of ``eval_split`` under add-one smoothed unigram counts of
    ``train_split``, both tokenized with ``tokenizer`` (default: the shipped one), EOS after
    each document. Comparable with a causal LM's ``exp(mean token loss)`` on the same split.
    """
    import numpy as np

    tokenizer = tokenizer or load_tokenizer()
    vocab_size = len(tokenizer)
    train_ids = np.fromiter(_token_ids(tokenizer, (d["text"] for d in read_documents(train_split))), dtype=np.int64)
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64)
    # Add-one (Laplace) smoothing: tokens never seen in train still get probability > 0.
    log_probs = np.log(counts + 1.0) - math.log(counts.sum() + vocab_size)
    eval_ids = np.fromiter(_token_ids(tokenizer, (d["text"] for d in read_documents(eval_split))), dtype=np.int64)
    nll = -log_probs[eval_ids].mean()
    return UnigramBaseline(
        perplexity=float(math.exp(nll)),
        eval_tokens=int(eval_ids.size),
        train_tokens=int(train_ids.size),
        vocab_size=vocab_size,
    )
