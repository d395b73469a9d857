"""Objectives: what an uptraining run's model learns, one registered record each.

An `Objective` declares
- what it reads (`reads`): packed token blocks of text, or JSON-lines examples of aligned text
  pairs or speech pairs (`fields`: the two fields of a line);
- which models learn it (`encoder_decoder`; an encoder–decoder's encoder reads text or audio);
- the special tokens it needs from the tokenizer (`special_tokens`, beyond the decoder start token
  every encoder–decoder objective needs in the model's config);
- its corruption of a block (`corruption`, a pure function of the block, the token ids and a
  generator that `corruption.training_generator` draws from (seed, step, row)), or none;
- its lengths: the raw block that gives `seq_len` input tokens (`block_length`) and the target
  positions of an example (`target_length`).

What an example's targets begin with, the family's prompt (Whisper's language and task tokens,
mBART's and NLLB's language codes), is `uptrain.objectives.prompts`.

Adding an objective is one record in `OBJECTIVES`; the `objective` key's choices, the refusals of
what a model cannot learn and the batches (`uptrain.data.objective_batches`) all read the records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from uptrain import UptrainError
from uptrain.objectives.corruption import sentinel_ids_for, span_corruption, span_corruption_lengths, text_infilling

__all__ = [
    "IGNORE_INDEX",
    "OBJECTIVES",
    "Objective",
    "SpecialTokens",
    "get_objective",
    "key_problem",
    "learnt_by",
    "objective_choices",
    "sentinel_ids_for",
    "span_corruption",
    "span_corruption_lengths",
    "special_tokens_for",
    "text_infilling",
    "words",
]

IGNORE_INDEX = -100  # what transformers' seq2seq losses skip

Reads = Literal["blocks", "text_pairs", "speech_pairs"]
# The tokenizer's special tokens an objective may need; "sentinels" are T5's <extra_id_N>.
Token = Literal["eos", "pad", "bos", "mask", "sentinels"]
TOKEN_WORDS = {"eos": "an EOS", "pad": "a padding", "bos": "a BOS", "mask": "a mask"}  # for messages


@dataclass(frozen=True)
class SpecialTokens:
    """The ids of an objective's special tokens in a run's tokenizer (None: not needed)."""

    eos: int | None
    pad: int | None = None
    bos: int | None = None
    mask: int | None = None
    sentinels: tuple[int, ...] = ()


Corruption = Callable[[torch.Tensor, SpecialTokens, torch.Generator], dict[str, torch.Tensor]]


def _same_length(seq_len: int) -> int:
    return seq_len


@dataclass(frozen=True)
class Objective:
    """One objective and what it declares (see the module's docstring)."""

    name: str
    reference: str  # what the model learns, and from whom: the `objective` key's help
    reads: Reads
    encoder_decoder: bool  # learnt by encoder–decoders; else by decoder-only models
    special_tokens: tuple[Token, ...] = ()
    corruption: Corruption | None = None
    # Raw tokens per packed block that give the model `seq_len` input tokens, and the least
    # `seq_len` it takes.
    raw_block_length: Callable[[int], int] = _same_length
    min_seq_len: int = 2
    # Decoder positions of one example for (seq_len, target_len); None: a decoder-only objective.
    target_length: Callable[[int, int], int] | None = None
    fields: tuple[str, str] | None = None  # an example's (source, target) fields in a jsonl line

    @property
    def reads_examples(self) -> bool:
        """Whether it reads JSON-lines examples (takes `target_len`) rather than packed blocks."""
        return self.reads != "blocks"

    @property
    def encoder_reads(self) -> str:
        """What an encoder–decoder's encoder reads under it: audio or text."""
        return "audio" if self.reads == "speech_pairs" else "text"

    def block_length(self, seq_len: int) -> int:
        """Raw tokens per packed block that give the model `seq_len` input tokens; refuses, in
        one line, a `seq_len` too short for the corruption."""
        if seq_len < self.min_seq_len:
            raise UptrainError(
                f"objective {self.name} needs seq_len of at least {self.min_seq_len} tokens, got {seq_len}"
            )
        return self.raw_block_length(seq_len)

    def corrupt(self, block: torch.Tensor, tokens: SpecialTokens, generator: torch.Generator) -> dict:
        """The model inputs of one block [n] (each [1, …]): its corruption drawn from `generator`."""
        if self.corruption is None:
            raise ValueError(f"objective {self.name} does not corrupt its blocks")
        return self.corruption(block[None], tokens, generator)


def _span_corruption(rows: torch.Tensor, tokens: SpecialTokens, generator: torch.Generator) -> dict:
    return span_corruption(
        rows, sentinel_ids=list(tokens.sentinels), eos_id=tokens.eos, pad_id=tokens.pad, generator=generator
    )


def _text_infilling(rows: torch.Tensor, tokens: SpecialTokens, generator: torch.Generator) -> dict:
    return text_infilling(
        rows, mask_id=tokens.mask, bos_id=tokens.bos, eos_id=tokens.eos, pad_id=tokens.pad, generator=generator
    )


def _span_corruption_block(seq_len: int) -> int:
    return span_corruption_lengths(seq_len)[0]


def _span_corruption_targets(seq_len: int, target_len: int) -> int:
    return span_corruption_lengths(seq_len)[1]


def _infilling_block(seq_len: int) -> int:
    return seq_len - 2  # BOS and EOS wrap each block


def _infilling_targets(seq_len: int, target_len: int) -> int:
    return seq_len  # the original block between BOS and EOS


def _example_targets(seq_len: int, target_len: int) -> int:
    return target_len  # targets are cut there


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("causal", "the next token of packed text (decoder-only models)", "blocks", encoder_decoder=False),
        Objective(
            "span_corruption",
            "T5's span corruption of packed text: the dropped spans, each left as a sentinel, are the targets "
            "(Raffel et al. 2020, §3.1.4)",
            "blocks",
            encoder_decoder=True,
            special_tokens=("eos", "sentinels"),
            corruption=_span_corruption,
            raw_block_length=_span_corruption_block,
            min_seq_len=4,
            target_length=_span_corruption_targets,
        ),
        Objective(
            "text_infilling",
            "BART's text infilling of packed text: spans masked, the whole block the target (Lewis et al. 2020, §2.2)",
            "blocks",
            encoder_decoder=True,
            special_tokens=("eos", "pad", "bos", "mask"),
            corruption=_text_infilling,
            raw_block_length=_infilling_block,
            min_seq_len=4,
            target_length=_infilling_targets,
        ),
        Objective(
            "pairs",
            "jsonl `source`/`target` text pairs (translation, summarisation)",
            "text_pairs",
            encoder_decoder=True,
            special_tokens=("pad",),
            target_length=_example_targets,
            fields=("source", "target"),
        ),
        Objective(
            "speech_pairs",
            "jsonl `audio`/`text` pairs (speech recognition)",
            "speech_pairs",
            encoder_decoder=True,
            target_length=_example_targets,
            fields=("audio", "text"),
        ),
    )
}


def get_objective(name: str) -> Objective:
    """The registered objective `name`; refuses, in one line, an unknown one."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise UptrainError(f"unknown objective {name!r}; available: {', '.join(OBJECTIVES)}") from None


def objective_choices() -> dict[str, str]:
    """The `objective` key's choices: each registered objective and what it learns."""
    return {o.name: o.reference for o in OBJECTIVES.values()}


def words(names: list[str], last: str) -> str:
    """`a, b and c` (`last`: "and" or "or") for messages."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def special_tokens_for(objective: Objective, tokenizer, model_label: str) -> SpecialTokens:
    """The ids of the special tokens `objective` needs, from `tokenizer`; refuses, in one line,
    a tokenizer that lacks one."""

    def need(token: Token, value: int | None) -> int | None:
        if token in objective.special_tokens and value is None:
            raise UptrainError(
                f"objective {objective.name} needs {TOKEN_WORDS[token]} token and the tokenizer of "
                f"{model_label} has none"
            )
        return value

    return SpecialTokens(
        eos=need("eos", tokenizer.eos_token_id),
        pad=need("pad", tokenizer.pad_token_id),
        bos=need("bos", tokenizer.bos_token_id) if "bos" in objective.special_tokens else None,
        mask=need("mask", tokenizer.mask_token_id) if "mask" in objective.special_tokens else None,
        sentinels=tuple(sentinel_ids_for(tokenizer)) if "sentinels" in objective.special_tokens else (),
    )


def learnt_by(encoder_decoder: bool, encoder_reads: str | None = None) -> list[str]:
    """The registered objectives a decoder-only model or an encoder–decoder (whose encoder reads
    `encoder_reads`) learns, in the registry's order."""
    return [
        o.name
        for o in OBJECTIVES.values()
        if o.encoder_decoder == encoder_decoder and encoder_reads in (None, o.encoder_reads)
    ]


def key_problem(objective: Objective, target_len: int | None, document_mask: bool = False) -> str | None:
    """Why a run's `target_len` or `document_mask` does not apply to `objective`, or None."""
    if target_len is not None and not objective.reads_examples:
        takers = [o.name for o in OBJECTIVES.values() if o.reads_examples]
        return f"`target_len` applies to objective {words(takers, 'and')}, not {objective.name}"
    if document_mask and objective.encoder_decoder:
        causal = words(learnt_by(False), "and")
        return f"document_mask applies to objective {causal} (packed documents), not {objective.name}"
    return None
