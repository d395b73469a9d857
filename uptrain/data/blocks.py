"""The one protocol through which training, evaluation and calibration index their data.

A source of blocks has a length and gives the rows at any indices on demand, the same batch for
the same indices every time: so the order of training blocks can be a pure function of (seed,
step) whatever holds them. Three kinds satisfy it:
- `text.TokenBlocks`: text tokenized and packed up front (a `datasets.Dataset`, cached);
- `shards.TokenShards`: the memory-mapped folder `uptrain tokenize` writes;
- `pairs.PairExamples`: aligned text or speech examples, padded per batch;
and `TensorBlocks` below, rows already in memory (the head of a streamed dataset).

A streamed dataset (`text.TextStream`) is not one: it is read in order, never indexed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

# Token ids [len(indices), seq_len] (int64), or the model inputs of padded examples by name.
Batch = torch.Tensor | dict[str, torch.Tensor]


@runtime_checkable
class Blocks(Protocol):
    """Rows 0 … len − 1, any of them on demand."""

    def __len__(self) -> int: ...

    def take(self, indices: list[int]) -> Batch:
        """The rows at `indices`, in that order (an index may repeat), as one batch."""
        ...


def check_indices(indices: list[int], length: int) -> None:
    """Refuse an empty selection or an index outside 0 … length − 1: every source refuses them
    in the same words, instead of wrapping a negative index or failing in its backend's."""
    if not indices:
        raise ValueError("no indices")
    for i in indices:
        if not 0 <= i < length:
            raise IndexError(f"block {i} of {length}")


class TensorBlocks:
    """Blocks held in memory as one int64 tensor [n, seq_len]."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, indices: list[int]) -> torch.Tensor:
        check_indices(indices, len(self))
        return self.rows[indices]
