"""The corruptions of the encoder–decoder objectives, as pure functions of token blocks and a
generator: T5's span corruption and BART's text infilling.

Every random choice is drawn from the `torch.Generator` passed in, so the same generator state
gives the same batch, bit for bit (what resume relies on); `training_generator` and
`evaluation_generator` give a block its own generator from the run's seed and the block's place.
No tokenizer, model or file is read here but the vocabulary that `sentinel_ids_for` searches;
the registry (`uptrain.objectives`) says which objective uses which.
"""

from __future__ import annotations

import hashlib

import torch

from uptrain import UptrainError


def training_generator(seed: int, step: int, row: int) -> torch.Generator:
    """The generator that corrupts the training block at `row` of optimizer step `step`'s global
    batch: the same for a resumed run and for any split of the step between processes and
    micro-batches."""
    return _generator("train", seed, step, row)


def evaluation_generator(seed: int, block: torch.Tensor) -> torch.Generator:
    """The generator that corrupts an evaluation block: a function of the seed and the block's
    tokens alone, so every evaluation scores the same batches."""
    return _generator("eval", seed, block.numpy().tobytes())


def _generator(*keys) -> torch.Generator:
    """A generator seeded by a digest of `keys` (ints and bytes): unrelated streams for nearby keys."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sentinel_ids_for(tokenizer) -> list[int]:
    """The ids of `<extra_id_0>`, `<extra_id_1>`, … in that order (T5 tokenizers give them
    descending ids: `<extra_id_0>` is the last of the vocabulary). Refuses, in one line, a
    tokenizer that has none."""
    vocab = tokenizer.get_vocab()
    ids = []
    while (token := f"<extra_id_{len(ids)}>") in vocab:
        ids.append(vocab[token])
    if not ids:
        raise UptrainError(
            "span_corruption needs sentinel tokens <extra_id_0>, <extra_id_1>, … and the tokenizer has none; "
            "add them (tokenizer.add_special_tokens) or pick another `objective`"
        )
    return ids


def _noise_counts(length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """T5's noise token and noise span counts for a block of `length` tokens: round(length ·
    density) tokens (at least one, at least one kept) in round(tokens / mean_span) spans (at least
    one; never more than there are noise or kept tokens, since every span of either is non-empty)."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(min(round(num_noise / mean_span), num_noise, length - num_noise), 1)
    return num_noise, num_spans


def _check_rates(noise_density: float, mean_span: float) -> None:
    if not 0 < noise_density < 1:
        raise ValueError(f"noise_density must lie in (0, 1), got {noise_density}")
    if mean_span < 1:
        raise ValueError(f"mean_span must be >= 1, got {mean_span}")


def span_corruption_lengths(input_len: int, noise_density: float = 0.15, mean_span: float = 3.0) -> tuple[int, int]:
    """(raw tokens per example, target length) for span corruption whose inputs come out exactly
    `input_len` tokens long — T5's `compute_input_and_target_lengths`: the longest raw block whose
    kept tokens, one sentinel per noise span and EOS fit in `input_len`. The targets are the noise
    tokens, one sentinel per span and EOS."""
    _check_rates(noise_density, mean_span)

    def lengths(raw: int) -> tuple[int, int]:
        num_noise, num_spans = _noise_counts(raw, noise_density, mean_span)
        return raw - num_noise + num_spans + 1, num_noise + num_spans + 1

    if input_len < lengths(2)[0]:
        raise ValueError(f"span corruption needs inputs of at least {lengths(2)[0]} tokens, got {input_len}")
    # The input length grows by 0 or 1 per raw token, so the longest raw block that fits hits
    # `input_len` exactly.
    raw = 2
    while lengths(raw + 1)[0] <= input_len:
        raw += 1
    got, target_len = lengths(raw)
    if got != input_len:  # only at extreme rates, where the counts' rounding jumps
        raise ValueError(f"no raw block length gives inputs of exactly {input_len} tokens at these rates")
    return raw, target_len


def _segment_lengths(total: int, parts: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random split of `total` items into `parts` non-empty runs (their lengths)."""
    cuts = torch.randperm(total - 1, generator=generator)[: parts - 1] + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), cuts.sort().values, torch.tensor([total])])
    return bounds.diff()


def span_corruption(
    tokens: torch.Tensor,
    *,
    sentinel_ids: list[int],
    eos_id: int,
    pad_id: int,
    generator: torch.Generator,
    noise_density: float = 0.15,
    mean_span: float = 3.0,
) -> dict[str, torch.Tensor]:
    """T5's span corruption of each row of `tokens` [b, n] (Raffel et al. 2020, §3.1.4).

    round(n · noise_density) tokens are dropped in spans of mean length `mean_span`; kept and
    dropped runs alternate, starting with a kept one, and both are split uniformly at random.
    Inputs: the kept runs, each followed by the sentinel of the span dropped after it
    (`sentinel_ids[i]` for the i-th span), then EOS. Labels: each sentinel followed by its dropped
    span, then EOS. Every row has the same counts, so inputs are [b, n - noise + spans + 1] and
    labels [b, noise + spans + 1] with no padding (`span_corruption_lengths` picks n for a wanted
    input length); `pad_id` is accepted for the objectives' common signature and unused.
    """
    del pad_id  # fixed lengths: nothing to pad
    _check_rates(noise_density, mean_span)
    batch, length = tokens.shape
    if length < 2:
        raise ValueError(f"span corruption needs blocks of at least 2 tokens, got {length}")
    num_noise, num_spans = _noise_counts(length, noise_density, mean_span)
    if num_spans > len(sentinel_ids):
        raise UptrainError(
            f"span corruption of {length}-token blocks drops {num_spans} spans and the tokenizer has "
            f"{len(sentinel_ids)} sentinel tokens; use a shorter `seq_len`"
        )
    sentinels = torch.tensor(sentinel_ids[:num_spans], dtype=tokens.dtype)
    eos = torch.tensor([eos_id], dtype=tokens.dtype)
    inputs, labels = [], []
    for row in tokens:
        kept_lengths = _segment_lengths(length - num_noise, num_spans, generator)
        noise_lengths = _segment_lengths(num_noise, num_spans, generator)
        # Interleave: kept run 0, noise span 0, kept run 1, noise span 1, …
        runs = torch.stack([kept_lengths, noise_lengths], dim=1).flatten()
        pieces = row.split(runs.tolist())
        kept, noise = pieces[0::2], pieces[1::2]
        inputs.append(torch.cat([t for i, run in enumerate(kept) for t in (run, sentinels[i : i + 1])] + [eos]))
        labels.append(torch.cat([t for i, span in enumerate(noise) for t in (sentinels[i : i + 1], span)] + [eos]))
    return {"input_ids": torch.stack(inputs), "labels": torch.stack(labels)}


def _infilling_spans(length: int, mask_ratio: float, poisson_lambda: float, generator: torch.Generator) -> list[int]:
    """BART's span lengths for one block: Poisson(λ) draws until they cover round(length ·
    mask_ratio) tokens, the last one cut to fit exactly. Zero-length spans stay (each inserts a
    mask), but no more of them than keep the corrupted block within the original's length."""
    num_mask = min(max(round(length * mask_ratio), 1), length)
    spans: list[int] = []
    covered = 0
    while covered < num_mask:
        draws = torch.poisson(torch.full((num_mask,), float(poisson_lambda)), generator=generator).long().tolist()
        for span in draws:
            span = min(span, num_mask - covered)
            spans.append(span)
            covered += span
            if covered == num_mask:
                break
    # The corrupted block has length - num_mask + len(spans) tokens: drop the zero-length spans
    # (from the end) that would make it longer than the original.
    excess = len(spans) - num_mask
    for i in range(len(spans) - 1, -1, -1):
        if excess <= 0:
            break
        if spans[i] == 0:
            del spans[i]
            excess -= 1
    return spans


def text_infilling(
    tokens: torch.Tensor,
    *,
    mask_id: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator,
    mask_ratio: float = 0.3,
    poisson_lambda: float = 3.0,
) -> dict[str, torch.Tensor]:
    """BART's text infilling of each row of `tokens` [b, n] (Lewis et al. 2020, §2.2).

    round(n · mask_ratio) tokens are masked in spans of Poisson(λ) lengths, each span replaced by
    one `mask_id` (a zero-length span inserts one); the spans go to uniformly random places
    between the kept tokens, so exactly that many tokens are masked. Labels: the original block
    as `<s> … </s>` [b, n + 2]; inputs: the corrupted block as `<s> … </s>`, right-padded with
    `pad_id` to n + 2, with its attention_mask.
    """
    if not 0 < mask_ratio <= 1:
        raise ValueError(f"mask_ratio must lie in (0, 1], got {mask_ratio}")
    if poisson_lambda <= 0:
        raise ValueError(f"poisson_lambda must be > 0, got {poisson_lambda}")
    batch, length = tokens.shape
    if length < 1:
        raise ValueError("text infilling needs blocks of at least 1 token")
    bos = torch.tensor([bos_id], dtype=tokens.dtype)
    eos = torch.tensor([eos_id], dtype=tokens.dtype)
    mask = torch.tensor([mask_id], dtype=tokens.dtype)
    width = length + 2
    input_ids = torch.full((batch, width), pad_id, dtype=tokens.dtype)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for b, row in enumerate(tokens):
        spans = _infilling_spans(length, mask_ratio, poisson_lambda, generator)
        num_kept = length - sum(spans)
        # Each span goes into one of the num_kept + 1 gaps around the kept tokens (several may
        # share a gap), in a random order.
        order = torch.randperm(len(spans), generator=generator).tolist()
        gaps = torch.randint(0, num_kept + 1, (len(spans),), generator=generator).sort().values.tolist()
        pieces, pos, kept_done = [bos], 0, 0
        for gap, i in zip(gaps, order, strict=True):
            pieces.append(row[pos : pos + gap - kept_done])  # the kept tokens before this gap
            pos += gap - kept_done
            kept_done = gap
            pieces.append(mask)
            pos += spans[i]  # the span's tokens are dropped
        pieces += [row[pos:], eos]
        corrupted = torch.cat(pieces)
        input_ids[b, : len(corrupted)] = corrupted
        attention_mask[b, : len(corrupted)] = 1
    labels = torch.cat([bos.expand(batch, 1), tokens, eos.expand(batch, 1)], dim=1)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
