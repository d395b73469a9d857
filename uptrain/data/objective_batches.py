"""What a training run's model learns — its objective — and the batches that objective makes.

The objectives are records of the registry `uptrain.objectives` (what each reads, its special
tokens, corruption and lengths); this module picks a run's, checks that its model and tokenizer
fit it, and makes its batches. `causal` (decoder-only models) trains on packed text blocks as
they are. Encoder–decoders train on the same blocks corrupted (`span_corruption`, T5;
`text_infilling`, BART) or on aligned examples (`pairs`, `speech_pairs`; see `uptrain.data.pairs`).

The corruption of a training block is a pure function of (seed, step, its row in the step's
global batch), so a resumed run, or one split differently between processes and micro-batches,
sees exactly the batches an uninterrupted one would. An evaluation block's corruption depends on
the seed and the block's tokens alone: the same eval batches at every evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uptrain import UptrainError
from uptrain.architecture import find_architecture
from uptrain.objectives import (
    IGNORE_INDEX,
    Objective,
    SpecialTokens,
    get_objective,
    learnt_by,
    special_tokens_for,
    words,
)
from uptrain.objectives.corruption import evaluation_generator, training_generator
from uptrain.objectives.prompts import TargetFraming


def resolve_objective(objective: str | None, model_config: dict, model_label: str) -> Objective:
    """The objective a run trains `model_config` with: `objective` if given, else its family's
    default (the architecture registry's: `causal` for decoder-only models; a converted `*_gqa`
    checkpoint keeps its source's). Refuses, in one line, an objective the model cannot learn (a
    decoder-only model has no encoder to read corrupted inputs; Whisper's encoder reads audio)."""
    model_type = model_config.get("model_type", "?")
    encoder_decoder = bool(model_config.get("is_encoder_decoder"))
    arch = find_architecture(model_type)
    default = None if arch is None else arch.default_objective
    if objective is None:
        if not encoder_decoder:
            return get_objective(learnt_by(False)[0])
        if default is None:
            raise UptrainError(
                f"{model_label} is an encoder–decoder ({model_type}) with no default objective; "
                f"set `objective` ({', '.join(learnt_by(True))})"
            )
        return get_objective(default)
    chosen = get_objective(objective)
    if encoder_decoder and not chosen.encoder_decoder:
        raise UptrainError(
            f"objective {objective} is for decoder-only models; {model_label} is an encoder–decoder ({model_type}): "
            f"use {default or learnt_by(True)[0]}"
        )
    if not encoder_decoder and chosen.encoder_decoder:
        raise UptrainError(
            f"objective {objective} needs an encoder–decoder model; {model_label} is decoder-only ({model_type}): "
            f"use {words(learnt_by(False), 'or')}"
        )
    # What the family's encoder reads, as its default objective says (text where it names none).
    reads = get_objective(default).encoder_reads if default is not None else "text"
    if encoder_decoder and chosen.encoder_reads != reads:
        raise UptrainError(
            f"objective {objective} does not fit {model_label} ({model_type}), whose encoder reads {reads}: "
            f"use {words(learnt_by(True, reads), 'or')}"
        )
    return chosen


def target_counts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens each row is scored on: every next token of a causal block, every label of a
    seq2seq example that is not padding."""
    if "labels" not in batch:
        rows, length = batch["input_ids"].shape
        return torch.full((rows,), length - 1, dtype=torch.long)
    return (batch["labels"] != IGNORE_INDEX).sum(dim=1)


@dataclass(frozen=True)
class ObjectiveBatches:
    """A run's objective with its seed and the special token ids it needs, turning raw rows into
    model inputs."""

    objective: Objective
    seed: int
    tokens: SpecialTokens
    # What a pairs/speech_pairs example's targets (or sources) begin with: the family's prompt.
    framing: TargetFraming | None = None

    @property
    def name(self) -> str:
        return self.objective.name

    def _stack(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    def train_batch(self, rows, step: int, first_row: int) -> dict[str, torch.Tensor]:
        """The model inputs of training rows [b, n] (or a pairs batch, already a dict) at optimizer
        step `step`; `first_row` is the first one's place in the step's global batch."""
        if isinstance(rows, dict):
            return rows
        if self.objective.corruption is None:
            return {"input_ids": rows}
        return self._stack(
            [
                self.objective.corrupt(row, self.tokens, training_generator(self.seed, step, first_row + i))
                for i, row in enumerate(rows)
            ]
        )

    def eval_batch(self, rows) -> dict[str, torch.Tensor]:
        """The model inputs of evaluation rows: corrupted as a function of the seed and each block."""
        if isinstance(rows, dict):
            return rows
        if self.objective.corruption is None:
            return {"input_ids": rows}
        return self._stack(
            [self.objective.corrupt(row, self.tokens, evaluation_generator(self.seed, row)) for row in rows]
        )


def objective_for(
    objective: Objective, seed: int, tokenizer, model_config: dict, model_label: str, seq_len: int | None = None
) -> ObjectiveBatches:
    """`objective` with the special tokens it takes from `tokenizer`; refuses, in one line, a
    tokenizer or config that lacks what it needs (for `seq_len`: enough sentinels)."""
    if objective.encoder_decoder and model_config.get("decoder_start_token_id") is None:
        raise UptrainError(
            f"{model_label} has no decoder_start_token_id in config.json: the model cannot build its decoder "
            "inputs from the labels"
        )
    batches = ObjectiveBatches(objective, seed, special_tokens_for(objective, tokenizer, model_label))
    if seq_len is not None and objective.corruption is not None:
        # One block now: too few sentinels (or too short a seq_len) is refused before the data is read.
        batches.eval_batch(torch.zeros((1, objective.block_length(seq_len)), dtype=torch.long))
    return batches
