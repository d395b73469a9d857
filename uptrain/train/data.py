"""Training and evaluation batches over packed token blocks (`uptrain.textdata`).

The order of training blocks is a pure function of (seed, step), so a resumed run reads exactly
the blocks an uninterrupted run would have read, whatever the number of processes, as long as
the global batch is the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from uptrain import UptrainError
from uptrain.textdata import TokenBlocks

STREAM_SHUFFLE_BUFFER = 10_000


class TrainBlocks:
    """Training micro-batches indexed by (step, micro-batch, process): a pure function of the seed.

    Optimizer step s (counted from 0) reads the global batch `order[s·G : (s+1)·G]` of the current
    epoch's permutation, G = batch_size × grad_accum × processes; process r's micro-batch m is one
    contiguous slice of it. An epoch is as many whole global batches as the data holds.
    """

    def __init__(self, blocks: TokenBlocks, seed: int, batch_size: int, grad_accum: int, num_processes: int):
        self.blocks, self.seed = blocks, seed
        self.batch_size, self.grad_accum, self.num_processes = batch_size, grad_accum, num_processes
        self.global_batch = batch_size * grad_accum * num_processes
        self.steps_per_epoch = len(blocks) // self.global_batch
        self._epoch, self._order = -1, None

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.blocks), generator=g).tolist()
        return self._order

    def micro_batches(self, step: int, rank: int) -> list[torch.Tensor]:
        """The `grad_accum` micro-batches process `rank` trains on at optimizer step `step` (from 0)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._permutation(epoch)
        start = within * self.global_batch
        out = []
        for m in range(self.grad_accum):
            # Micro-batch m of every process before micro-batch m + 1: the same blocks form each
            # global batch whatever the split between processes and accumulation.
            first = start + (m * self.num_processes + rank) * self.batch_size
            out.append(self.blocks.take(order[first : first + self.batch_size]))
        return out


class StreamedTrainBlocks:
    """Training micro-batches from a streamed dataset: every process reads the same shuffled stream
    and keeps its own slice of each global batch, so the order does not depend on the process count.
    Resuming skips the blocks already consumed."""

    def __init__(self, dataset, seed: int, batch_size: int, grad_accum: int, num_processes: int):
        self.dataset = dataset.shuffle(seed=seed, buffer_size=STREAM_SHUFFLE_BUFFER)
        self.batch_size, self.grad_accum, self.num_processes = batch_size, grad_accum, num_processes
        self.global_batch = batch_size * grad_accum * num_processes
        self._iter: Iterator | None = None
        self._next_step = 0
        self._epoch = 0

    def _blocks(self) -> Iterator[list[int]]:
        while True:
            self.dataset.set_epoch(self._epoch)
            empty = True
            for row in self.dataset:
                empty = False
                yield row["input_ids"]
            if empty:
                raise UptrainError("the streamed training data yields no block of `seq_len` tokens")
            self._epoch += 1

    def micro_batches(self, step: int, rank: int) -> list[torch.Tensor]:
        """As `TrainBlocks.micro_batches`; steps must be asked for in order (a resume may start later)."""
        if self._iter is None or step < self._next_step:
            self._iter, self._next_step, self._epoch = self._blocks(), 0, 0
        while self._next_step < step:  # resume: skip whole global batches already trained on
            for _ in range(self.global_batch):
                next(self._iter)
            self._next_step += 1
        batch = [next(self._iter) for _ in range(self.global_batch)]
        self._next_step += 1
        out = []
        for m in range(self.grad_accum):
            first = (m * self.num_processes + rank) * self.batch_size
            out.append(torch.tensor(batch[first : first + self.batch_size]))
        return out


def eval_batches(
    blocks, eval_blocks: int, batch_size: int, rank: int, num_processes: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `eval_blocks` blocks, in file order, dealt round-robin to processes and batched.

    Returns (input_ids [b, seq_len], counted [b] bool) pairs. Every process gets the same number
    of batches, because sharded models (FSDP, ZeRO-3) need every process in every forward; the
    rows that only fill up a short process are not counted.
    """
    if isinstance(blocks, TokenBlocks):
        n = min(eval_blocks, len(blocks))
        if n == 0:
            return []
        rows = blocks.take(list(range(n)))
    else:
        rows = torch.tensor([row["input_ids"] for row in itertools.islice(iter(blocks), eval_blocks)])
        if len(rows) == 0:
            return []
    per_process = -(-len(rows) // num_processes)
    mine = list(range(rank, len(rows), num_processes))
    counted = [True] * len(mine) + [False] * (per_process - len(mine))
    mine += [0] * (per_process - len(mine))
    return [
        (rows[mine[i : i + batch_size]], torch.tensor(counted[i : i + batch_size]))
        for i in range(0, per_process, batch_size)
    ]
