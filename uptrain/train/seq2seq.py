"""What a training run's model learns — its objective — and the batches that objective makes.

`causal` (decoder-only models) trains on packed text blocks as they are. Encoder–decoders train
on the same blocks corrupted (`span_corruption`, T5; `text_infilling`, BART; see
`uptrain.objectives`) or on aligned examples (`pairs`, `speech_pairs`; see `uptrain.train.pairs`).

The corruption of a training block is a pure function of (seed, step, its row in the step's
global batch), so a resumed run, or one split differently between processes and micro-batches,
sees exactly the batches an uninterrupted one would. An evaluation block's corruption depends on
the seed and the block's tokens alone: the same eval batches at every evaluation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from uptrain import UptrainError
from uptrain.architecture import find_architecture
from uptrain.objectives import IGNORE_INDEX, sentinel_ids_for, span_corruption, span_corruption_lengths, text_infilling
from uptrain.train.metrics import encoder_decoder_cost

OBJECTIVES = ("causal", "span_corruption", "text_infilling", "pairs", "speech_pairs")
PAIR_OBJECTIVES = ("pairs", "speech_pairs")  # read jsonl examples


def resolve_objective(objective: str | None, model_config: dict, model_label: str) -> str:
    """The objective a run trains `model_config` with: `objective` if given, else its family's
    default (the architecture registry's: `causal` for decoder-only models; a converted `*_gqa`
    checkpoint keeps its source's). Refuses, in one line, an objective the model cannot learn (a
    decoder-only model has no encoder to read corrupted inputs)."""
    model_type = model_config.get("model_type", "?")
    encoder_decoder = bool(model_config.get("is_encoder_decoder"))
    arch = find_architecture(model_type)
    default = None if arch is None else arch.default_objective
    if objective is None:
        if not encoder_decoder:
            return "causal"
        if default is None:
            raise UptrainError(
                f"{model_label} is an encoder–decoder ({model_type}) with no default objective; "
                f"set `objective` ({', '.join(OBJECTIVES[1:])})"
            )
        return default
    if encoder_decoder and objective == "causal":
        raise UptrainError(
            f"objective causal is for decoder-only models; {model_label} is an encoder–decoder ({model_type}): "
            f"use {default or 'span_corruption'}"
        )
    if not encoder_decoder and objective != "causal":
        raise UptrainError(
            f"objective {objective} needs an encoder–decoder model; {model_label} is decoder-only ({model_type}): "
            "use causal"
        )
    speech = default == "speech_pairs"
    if speech != (objective == "speech_pairs"):
        reads = "audio" if speech else "text"
        raise UptrainError(
            f"objective {objective} does not fit {model_label} ({model_type}), whose encoder reads {reads}: "
            f"use {'speech_pairs' if speech else 'span_corruption, text_infilling or pairs'}"
        )
    return objective


def train_flops_per_token(model, model_config: dict, objective: str, seq_len: int, target_len: int) -> float:
    """Forward + backward FLOPs of an encoder–decoder per counted token (seq_len per example):
    `metrics.EncoderDecoderCost` for the objective's S source positions (seq_len; Whisper: its
    encoder positions) and T target positions."""
    s = model_config.get("max_source_positions") if objective == "speech_pairs" else seq_len
    t = {"span_corruption": span_corruption_lengths(seq_len)[1], "text_infilling": seq_len}.get(objective, target_len)
    return encoder_decoder_cost(model, model_config).train_flops(s, t) / seq_len


def block_length(objective: str, seq_len: int) -> int:
    """Raw tokens per packed block that give the model `seq_len` input tokens."""
    if objective in ("span_corruption", "text_infilling") and seq_len < 4:
        raise UptrainError(f"objective {objective} needs seq_len of at least 4 tokens, got {seq_len}")
    if objective == "span_corruption":
        return span_corruption_lengths(seq_len)[0]
    if objective == "text_infilling":
        return seq_len - 2  # BOS and EOS wrap each block
    return seq_len


def target_counts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens each row is scored on: every next token of a causal block, every label of a
    seq2seq example that is not padding."""
    if "labels" not in batch:
        rows, length = batch["input_ids"].shape
        return torch.full((rows,), length - 1, dtype=torch.long)
    return (batch["labels"] != IGNORE_INDEX).sum(dim=1)


def _generator(*keys) -> torch.Generator:
    """A generator seeded by a digest of `keys` (ints and bytes): unrelated streams for nearby keys."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


@dataclass(frozen=True)
class Objective:
    """An objective with the special token ids it needs, turning raw rows into model inputs."""

    name: str
    seed: int
    eos_id: int
    pad_id: int | None = None
    bos_id: int | None = None
    mask_id: int | None = None
    sentinel_ids: tuple[int, ...] = ()

    @property
    def corrupts(self) -> bool:
        return self.name in ("span_corruption", "text_infilling")

    def _corrupt(self, row: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        if self.name == "span_corruption":
            return span_corruption(
                row[None],
                sentinel_ids=list(self.sentinel_ids),
                eos_id=self.eos_id,
                pad_id=self.pad_id,
                generator=generator,
            )
        return text_infilling(
            row[None],
            mask_id=self.mask_id,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            generator=generator,
        )

    def _stack(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    def train_batch(self, rows, step: int, first_row: int) -> dict[str, torch.Tensor]:
        """The model inputs of training rows [b, n] (or a pairs batch, already a dict) at optimizer
        step `step`; `first_row` is the first one's place in the step's global batch."""
        if isinstance(rows, dict):
            return rows
        if not self.corrupts:
            return {"input_ids": rows}
        return self._stack(
            [self._corrupt(row, _generator("train", self.seed, step, first_row + i)) for i, row in enumerate(rows)]
        )

    def eval_batch(self, rows) -> dict[str, torch.Tensor]:
        """The model inputs of evaluation rows: corrupted as a function of the seed and each block."""
        if isinstance(rows, dict):
            return rows
        if not self.corrupts:
            return {"input_ids": rows}
        return self._stack([self._corrupt(row, _generator("eval", self.seed, row.numpy().tobytes())) for row in rows])


def _need(value: int | None, what: str, objective: str, model_label: str) -> int:
    if value is None:
        raise UptrainError(f"objective {objective} needs a {what} token and the tokenizer of {model_label} has none")
    return value


def objective_for(
    name: str, seed: int, tokenizer, model_config: dict, model_label: str, seq_len: int | None = None
) -> Objective:
    """The objective `name` with the special tokens it takes from `tokenizer`; refuses, in one
    line, a tokenizer or config that lacks what it needs (for `seq_len`: enough sentinels)."""
    if name != "causal" and model_config.get("decoder_start_token_id") is None:
        raise UptrainError(
            f"{model_label} has no decoder_start_token_id in config.json: the model cannot build its decoder "
            "inputs from the labels"
        )
    if name == "span_corruption":
        objective = Objective(
            name,
            seed,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            sentinel_ids=tuple(sentinel_ids_for(tokenizer)),
        )
        if seq_len is not None:  # one block now: too few sentinels is refused before the data is read
            objective.eval_batch(torch.zeros((1, block_length(name, seq_len)), dtype=torch.long))
        return objective
    if name == "text_infilling":
        return Objective(
            name,
            seed,
            eos_id=tokenizer.eos_token_id,
            pad_id=_need(tokenizer.pad_token_id, "padding", name, model_label),
            bos_id=_need(tokenizer.bos_token_id, "BOS", name, model_label),
            mask_id=_need(tokenizer.mask_token_id, "mask", name, model_label),
        )
    if name in PAIR_OBJECTIVES:
        return Objective(name, seed, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    return Objective(name, seed, eos_id=tokenizer.eos_token_id)
