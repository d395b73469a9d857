"""Sources (and pair targets) are cut before they are tokenized whole (`data.pairs.cut_tokenized`):
the ids equal the tokenizer's own truncation of the whole text on real text, for byte-level BPE
and word-level tokenizers at every length around the prefix bound, and a 20 MB source costs the
tokenizer kilobytes of characters, not the whole text (issue #34: one 50 MB example took 8.2 GB
and 76 s in `uptrain evaluate`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.train.train_helpers import build_tokenizer, make_text
from uptrain.data.pairs import PREFIX_CHARS_PER_TOKEN, cut_tokenized, load_pairs
from uptrain.objectives import OBJECTIVES

ASSETS = Path(__file__).resolve().parents[1] / "uptrain" / "assets"


def corpus_text() -> str:
    with gzip.open(ASSETS / "corpus" / "validation.jsonl.gz", "rt") as f:
        return " ".join(json.loads(line)["text"] for line, _ in zip(f, range(40)))


TEXT = corpus_text()
TOKENIZERS = {
    "byte-level BPE": lambda: AutoTokenizer.from_pretrained(ASSETS / "reference"),
    "T5's byte-level BPE": lambda: AutoTokenizer.from_pretrained(ASSETS / "reference_t5"),
    "word-level": lambda: build_tokenizer(make_text(1, 50)),
}


@pytest.mark.parametrize("name", TOKENIZERS)
def test_cut_ids_equal_the_whole_texts(name):
    tokenizer = TOKENIZERS[name]()
    odd = "naïve café 東京 🙂 e\u0301 \t\n  " * 40 + " " * 3000 + "x" * 3000  # unicode, combining marks, long runs
    for seq_len in (1, 5, 64, 256):
        bound = 2 * (PREFIX_CHARS_PER_TOKEN * seq_len + 64)
        texts = [TEXT[:n] for n in (0, 10, bound - 1, bound, bound + 1, 4 * bound)] + [odd, odd[::-1]]
        texts += [TEXT[i : i + 5 * bound] for i in (1, 77, 1001)]  # cut mid-word, mid-sentence

        def encode(part, seq_len=seq_len):
            return tokenizer(part, truncation=True, max_length=seq_len)["input_ids"]

        assert cut_tokenized(encode, texts, seq_len) == encode(texts), (name, seq_len)


class CountingTokenizer:
    """A real tokenizer that records the longest text it was given (the rest is the tokenizer's)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text=None, text_target=None, **kwargs):
        for texts in (text, text_target):
            if texts is not None:
                self.longest = max([self.longest, *(len(t) for t in ([texts] if isinstance(texts, str) else texts))])
        return self.tokenizer(text, text_target=text_target, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_20_mb_source_is_not_tokenized_whole(tmp_path):
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(ASSETS / "reference"))
    huge = (TEXT + " ") * (20_000_000 // len(TEXT) + 1)
    data = tmp_path / "pairs.jsonl"
    lines = [{"source": huge, "target": huge}, {"source": TEXT[:500], "target": "a short target"}]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {"model_type": "llama", "max_position_embeddings": 512}
    examples = load_pairs(str(data), "data", OBJECTIVES["pairs"], tokenizer, "unused", config, 128, 32)
    assert tokenizer.longest < 64 * 128, tokenizer.longest  # kilobytes, not 20 MB
    whole = tokenizer.tokenizer(huge[:200_000], truncation=True, max_length=128)["input_ids"]
    assert examples.sources[0] == whole and len(whole) == 128
    assert examples.sources[1] == tokenizer.tokenizer(TEXT[:500], truncation=True, max_length=128)["input_ids"]
