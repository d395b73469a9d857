"""The shipped corpus and tokenizer: split hygiene, offline loading, round trips, baseline."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import zlib

import pytest

from uptrain.data import corpus

SHINGLE_CHARS = 200
SAMPLE_EVERY = 4  # keep windows whose crc32 is 0 mod this, on both sides (content-defined)


@pytest.fixture(scope="module")
def docs() -> dict[str, list[dict]]:
    return {split: list(corpus.read_documents(split)) for split in corpus.SPLITS}


@pytest.fixture(scope="module")
def tokenizer():
    return corpus.load_tokenizer()


def _shingles(text: str) -> set[bytes]:
    """Sampled 200-char windows at word starts, after folding case and non-letters.

    Sampling by the window's own crc32 picks the same windows in both texts, so a shared
    passage of 300+ characters is caught with ~98% probability (measured by planting train
    passages) while train keeps only a quarter of its windows in memory. The key is a 64-bit
    blake2b (crc32 alone would collide by chance among millions of windows).
    """
    t = re.sub(r"[^a-z]+", " ", text.lower()).encode("ascii")
    keys = set()
    starts = [0] + [m.end() for m in re.finditer(rb" ", t)]
    for i in starts:
        w = t[i : i + SHINGLE_CHARS]
        if len(w) == SHINGLE_CHARS and zlib.crc32(w) % SAMPLE_EVERY == 0:
            keys.add(hashlib.blake2b(w, digest_size=8).digest())
    return keys


def test_splits_exist_with_expected_fields(docs):
    for split, part in docs.items():
        assert part, split
        for d in part:
            assert set(d) == {"id", "source", "title", "text"}
            assert d["source"] in {"shakespeare", "austen", "kjv"}
            assert d["id"].startswith(d["source"] + "/")
        # Every split mixes all three sources, so validation loss covers each style.
        assert {d["source"] for d in part} == {"shakespeare", "austen", "kjv"}, split


def test_splits_are_non_trivial(docs):
    chars = {split: sum(len(d["text"]) for d in part) for split, part in docs.items()}
    assert chars["train"] > 10_000_000
    assert chars["validation"] > 500_000
    assert chars["test"] > 500_000
    assert len(docs["train"]) + len(docs["validation"]) + len(docs["test"]) == 42 + 6 + 66


def test_no_work_in_two_splits(docs):
    seen: dict[str, str] = {}
    for split, part in docs.items():
        for d in part:
            for key in (d["id"], f"{d['source']}:{d['title'].lower()}"):
                assert key not in seen, f"{key} in {seen[key]} and {split}"
                seen[key] = split


def test_no_long_passage_shared_with_train(docs):
    train = set()
    for d in docs["train"]:
        train |= _shingles(d["text"])
    assert len(train) > 100_000  # the sampling really samples something
    for split in ("validation", "test"):
        for d in docs[split]:
            shared = _shingles(d["text"]) & train
            assert not shared, f"{d['id']} ({split}) shares {len(shared)} passages with train"


def test_no_gutenberg_boilerplate(docs):
    pattern = re.compile(r"\b(gutenberg|e-?texts?|e-?books?)\b", re.I)
    for part in docs.values():
        for d in part:
            assert not pattern.search(d["text"]), d["id"]
            assert "\r" not in d["text"] and "\t" not in d["text"], d["id"]


def test_readme_lists_shipped_checksums():
    readme = (corpus.CORPUS_DIR / "README.md").read_text()
    for split in corpus.SPLITS:
        digest = hashlib.sha256(corpus.split_path(split).read_bytes()).hexdigest()
        assert digest in readme, f"README sha256 of {split} is stale: run the command there"


def test_loads_offline_through_datasets(tmp_path, docs):
    # A subprocess, because datasets reads the offline switches when it is imported.
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
    )
    code = (
        "import json; from uptrain.data.corpus import load_corpus\n"
        f"ds = load_corpus(cache_dir={str(tmp_path / 'cache')!r})\n"
        "print(json.dumps({s: [ds[s].num_rows, ds[s][0]['id'], len(ds[s][0]['text'])]"
        " for s in ds}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for split, part in docs.items():
        assert got[split] == [len(part), part[0]["id"], len(part[0]["text"])]


def test_tokenizer_has_eos_and_round_trips(tokenizer, docs):
    assert len(tokenizer) == 8192
    assert tokenizer.eos_token == corpus.EOS_TOKEN
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == 0
    assert tokenizer.pad_token == corpus.PAD_TOKEN and tokenizer.pad_token_id != 0
    # The tokenizer adds nothing by itself; the packer appends EOS.
    assert 0 not in tokenizer("Fair is foul")["input_ids"]
    samples = [d["text"][:20_000] for d in docs["validation"]] + [
        "  indented\n\n\nthree newlines, a tab\t, £ and ünïcødé — “quotes” 日本語 🙂"
    ]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Trained on this corpus, BPE should compress it: ~3.6 characters a token on validation
    # (play scripts are lower, their short lines each cost a newline token).
    texts = [d["text"] for d in docs["validation"]]
    n_tokens = sum(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    assert sum(map(len, texts)) / n_tokens > 3.2
    assert tokenizer.decode([tokenizer.eos_token_id]) == corpus.EOS_TOKEN


def test_unigram_baseline_is_plausible(tokenizer):
    base = corpus.unigram_perplexity(tokenizer)
    assert math.isfinite(base.perplexity)
    # Better than uniform over the vocabulary, far worse than any trained LM.
    assert 200 < base.perplexity < base.vocab_size
    assert base.train_tokens > 2_000_000 and base.eval_tokens > 100_000
