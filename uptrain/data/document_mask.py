"""Packed blocks without attention across documents (`document_mask: true`).

`uptrain.data.text` packs documents into `seq_len` blocks, each document followed by EOS. By
default a token attends to everything before it in the block, the previous documents included.
With the document mask, each document of a block is seen as if it were alone: positions restart
at 0 after every EOS, and attention stays inside the document (a block-diagonal causal mask).
A block's first document may be the tail of one that began in the block before: it is a
document of its own here. Every target is still predicted, so the tokens counted in the loss do
not change: the token after an EOS (the next document's first) is predicted from the EOS and
the document it ends, as generation after an EOS would.

How the mask reaches attention depends on the backend (`config._attn_implementation`):
- eager: a 4D additive mask [b, 1, n, n] (0 or the dtype's minimum), which transformers (and
  uptrain's GQA modeling) add to the scores as they are;
- flash attention and flex attention: no mask, only `position_ids`, with the batch laid out as
  one row: transformers finds where each document starts from the positions (varlen kernels with
  cumulative sequence lengths for flash, a packed-sequence block mask for flex);
- SDPA and any other: a 4D boolean mask [b, 1, n, n] (True: may attend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uptrain import UptrainError
from uptrain.architecture import Architecture, find_architecture

# Backends to which transformers gives packed sequences from `position_ids` alone (and which
# take no dense 4D mask).
FROM_POSITIONS = ("flash", "flex")


def document_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, n] index, within its row, of the document each token belongs to; a document ends with
    its EOS (the EOS is its last token)."""
    eos = (input_ids == eos_id).long()
    return eos.cumsum(dim=-1) - eos


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, n] position of each token inside its document: 0 at each document's first token."""
    doc = document_ids(input_ids, eos_id)
    index = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


def document_attention_mask(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[b, 1, n, n] boolean: query i may attend key j when j ≤ i and both are in one document."""
    doc = document_ids(input_ids, eos_id)
    n = input_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def positions_lost(arch: Architecture | None, implementation: str) -> tuple[str, str] | None:
    """Why `implementation`, which finds packed documents from `position_ids` alone, never gets
    them on this architecture, and the backends that do see the documents; None where it gets
    them. From the registry: a forward that builds its mask without them
    (`mask_ignores_positions`, OPT: flash and flex) or layers that pass none to attention
    (`attention_ignores_positions`, GPT-Neo: flash; flex's block mask is built by the forward)."""
    if arch is None:
        return None
    if arch.mask_ignores_positions and any(kind in implementation for kind in FROM_POSITIONS):
        return f"{arch.name} builds its attention mask without position ids", "sdpa or eager"
    if arch.attention_ignores_positions and "flash" in implementation:
        return f"{arch.name}'s layers do not pass position ids to attention", "sdpa, eager or flex"
    return None


@dataclass(frozen=True)
class DocumentPacking:
    """The forward's inputs that keep each packed document to itself, for one model's backend."""

    eos_id: int
    attn_implementation: str
    mask_dtype: torch.dtype  # of the additive mask eager attention adds to its scores

    @classmethod
    def for_model(cls, model: torch.nn.Module, eos_id: int) -> DocumentPacking:
        """For an (unwrapped) transformers model: its attention backend and dtype."""
        implementation = str(model.config._attn_implementation)
        lost = positions_lost(find_architecture(model.config.model_type), implementation)
        if lost is not None:
            why, instead = lost
            raise UptrainError(
                f"document_mask: {why}, so {implementation} would attend across documents; use {instead} attention"
            )
        return cls(eos_id, implementation, next(model.parameters()).dtype)

    def inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward in place of `input_ids=`. The logits come back
        as [1, b·n, vocab] for the flash/flex layout: `.view(b, n, -1)` them."""
        positions = document_positions(input_ids, self.eos_id)
        if any(name in self.attn_implementation for name in FROM_POSITIONS):
            # Rows laid end to end: each row starts at position 0, so a row is never joined to the last
            # document of the row before. (transformers reads positions as packed only for one row.)
            return {"input_ids": input_ids.reshape(1, -1), "position_ids": positions.reshape(1, -1)}
        mask = document_attention_mask(input_ids, self.eos_id)
        if self.attn_implementation == "eager":
            blocked = torch.finfo(self.mask_dtype).min
            mask = torch.zeros(mask.shape, dtype=self.mask_dtype, device=mask.device).masked_fill(~mask, blocked)
        return {"input_ids": input_ids, "position_ids": positions, "attention_mask": mask}


def check_document_mask(model_config: dict, seq_len: int, model: str) -> None:
    """Refuse, in one line, a model whose attention the document mask cannot express."""
    arch = find_architecture(model_config.get("model_type"))
    if arch is not None and arch.has_alibi(model_config):  # ALiBi biases are built from the 2D padding mask
        raise UptrainError(
            f"document_mask: {model} is {arch.name}, whose ALiBi biases are built from a 2D padding "
            "mask that a per-document mask cannot replace; set document_mask: false"
        )
    window = model_config.get("sliding_window")
    if window is not None and model_config.get("use_sliding_window", True) and window < seq_len:
        raise UptrainError(
            f"document_mask: {model} attends through a sliding window of {window} tokens, shorter than seq_len "
            f"{seq_len}; the document mask would replace it: set seq_len ≤ {window} or document_mask: false"
        )
