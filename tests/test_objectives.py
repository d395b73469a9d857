"""T5 span corruption and BART text infilling (uptrain/objectives.py) on generated token blocks:
the corruption loses nothing (inputs and targets rebuild the block), keeps the counts it promises
and is a pure function of the generator."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from uptrain import UptrainError
from uptrain.objectives import (
    IGNORE_INDEX,
    sentinel_ids_for,
    span_corruption,
    span_corruption_lengths,
    text_infilling,
)

# Ordinary tokens are 10..999; specials below, sentinels descending from the top as in T5.
PAD, EOS, BOS, MASK = 0, 1, 2, 3
SENTINELS = [1999 - i for i in range(200)]


def blocks(min_len=2, max_len=300):
    return st.tuples(
        st.integers(1, 3), st.integers(min_len, max_len), st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)
    ).map(lambda t: (torch.randint(10, 1000, (t[0], t[1]), generator=torch.Generator().manual_seed(t[2])), t[3]))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def t5(tokens, seed, **kw):
    return span_corruption(tokens, sentinel_ids=SENTINELS, eos_id=EOS, pad_id=PAD, generator=gen(seed), **kw)


def bart(tokens, seed, **kw):
    return text_infilling(tokens, mask_id=MASK, bos_id=BOS, eos_id=EOS, pad_id=PAD, generator=gen(seed), **kw)


def rebuild_t5(inputs: list[int], labels: list[int]) -> list[int]:
    """The original block: each sentinel in the inputs replaced by what follows it in the labels."""
    assert inputs[-1] == EOS and labels[-1] == EOS
    spans: dict[int, list[int]] = {}
    current = None
    for t in labels[:-1]:
        if t in SENTINELS:
            current = t
            spans[t] = []
        else:
            spans[current].append(t)
    return [x for t in inputs[:-1] for x in (spans[t] if t in SENTINELS else [t])]


@settings(max_examples=150, deadline=None)
@given(blocks(), st.sampled_from([0.15, 0.3, 0.5]), st.sampled_from([1.0, 3.0, 5.0]))
def test_span_corruption_loses_nothing_and_keeps_counts(block, density, mean_span):
    tokens, seed = block
    out = t5(tokens, seed, noise_density=density, mean_span=mean_span)
    n = tokens.shape[1]
    noise = min(max(round(n * density), 1), n - 1)
    for row, inputs, labels in zip(tokens.tolist(), out["input_ids"].tolist(), out["labels"].tolist(), strict=True):
        assert rebuild_t5(inputs, labels) == row
        kept = [t for t in inputs if t not in SENTINELS][:-1]
        assert len(kept) == n - noise  # exactly the promised noise count
        # the kept tokens are a subsequence of the block, in order
        it = iter(row)
        assert all(any(t == r for r in it) for t in kept)
        spans = [t for t in inputs if t in SENTINELS]
        assert spans == SENTINELS[: len(spans)]  # sentinel ids in order, one per span, all spans non-empty
        assert [t for t in labels if t in SENTINELS] == spans
        assert inputs[0] not in SENTINELS  # a kept run comes first
        assert IGNORE_INDEX not in labels
    assert abs(noise / n - density) <= 1 / n + 1e-9  # noise fraction is the density up to rounding


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 2048))
def test_span_corruption_lengths_give_exact_input_length(input_len):
    raw, target_len = span_corruption_lengths(input_len)
    out = t5(torch.randint(10, 1000, (2, raw), generator=gen(input_len)), 0)
    assert out["input_ids"].shape == (2, input_len)
    assert out["labels"].shape == (2, target_len)


def test_span_corruption_lengths_match_t5():
    # T5's compute_input_and_target_lengths(512, 0.15, 3.0) gives 568 raw tokens and 114 targets.
    assert span_corruption_lengths(512, 0.15, 3.0) == (568, 114)


@settings(max_examples=40, deadline=None)
@given(blocks())
def test_span_corruption_is_a_function_of_the_generator(block):
    tokens, seed = block
    a, b = t5(tokens, seed), t5(tokens, seed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if tokens.shape[1] >= 40:  # long enough that two seeds virtually never agree
        c = t5(tokens, seed + 1)
        assert not torch.equal(a["input_ids"], c["input_ids"])


def test_span_corruption_refuses_too_few_sentinels():
    with pytest.raises(UptrainError, match="sentinel"):
        span_corruption(
            torch.randint(10, 1000, (1, 300)), sentinel_ids=SENTINELS[:3], eos_id=EOS, pad_id=PAD, generator=gen(0)
        )


def aligns(inputs: list[int], original: list[int]) -> bool:
    """Whether `inputs` is `original` with some runs (possibly empty) each replaced by one MASK."""
    reach = {0}  # positions of `original` consumed so far
    for t in inputs:
        if t == MASK:
            reach = {j for i in reach for j in range(i, len(original) + 1)}
        else:
            reach = {i + 1 for i in reach if i < len(original) and original[i] == t}
        if not reach:
            return False
    return len(original) in reach


@settings(max_examples=150, deadline=None)
@given(blocks(min_len=1, max_len=200), st.sampled_from([0.1, 0.3, 0.6, 1.0]), st.sampled_from([0.5, 3.0, 6.0]))
def test_text_infilling_masks_spans_and_keeps_labels(block, ratio, lam):
    tokens, seed = block
    out = bart(tokens, seed, mask_ratio=ratio, poisson_lambda=lam)
    batch, n = tokens.shape
    assert out["input_ids"].shape == out["attention_mask"].shape == out["labels"].shape == (batch, n + 2)
    num_mask = min(max(round(n * ratio), 1), n)
    for row, inputs, att, labels in zip(
        tokens.tolist(), out["input_ids"].tolist(), out["attention_mask"].tolist(), out["labels"].tolist(), strict=True
    ):
        assert labels == [BOS, *row, EOS]
        real = inputs[: sum(att)]
        assert att == [1] * len(real) + [0] * (n + 2 - len(real))
        assert inputs[len(real) :] == [PAD] * (n + 2 - len(real))
        assert real[0] == BOS and real[-1] == EOS
        body = real[1:-1]
        assert MASK in body
        assert sum(t != MASK for t in body) == n - num_mask  # exactly the promised count masked
        assert aligns(body, row)


def test_text_infilling_mask_fraction_and_span_lengths():
    tokens = torch.randint(10, 1000, (64, 512), generator=gen(1))
    out = bart(tokens, 7)
    masks = (out["input_ids"] == MASK).sum().item()
    masked = 64 * round(512 * 0.3)
    # Poisson(3) spans, the zero-length ones inserting: about masked / 3 mask tokens
    assert 0.8 * masked / 3 < masks < 1.2 * masked / 3


@settings(max_examples=40, deadline=None)
@given(blocks(min_len=1))
def test_text_infilling_is_a_function_of_the_generator(block):
    tokens, seed = block
    a, b = bart(tokens, seed), bart(tokens, seed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sentinel_ids_in_extra_id_order():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    with pytest.raises(UptrainError, match="sentinel tokens"):
        sentinel_ids_for(tok)
    tok.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(5)]})
    ids = sentinel_ids_for(tok)
    assert [tok.convert_ids_to_tokens(i) for i in ids] == [f"<extra_id_{i}>" for i in range(5)]
