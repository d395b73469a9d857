"""Training and evaluation batches over any source of blocks (`uptrain.data.blocks.Blocks`), or
over a stream of packed text (`uptrain.data.text.TextStream`).

Data tokenized up front, or examples (`TrainBlocks`): the order of training blocks is a pure function of
(seed, step), so a resumed run reads exactly the blocks an uninterrupted run would have read,
whatever the number of processes, as long as the global batch is the same.

Streamed data (`StreamedTrainBlocks`): each process reads and tokenizes only its own share, in
DataLoader worker processes; the order is a function of the seed and of processes ×
data_workers, and a resume restores each share's saved position instead of replaying the stream.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import torch
import torch.utils.data

from uptrain import UptrainError, exception_line
from uptrain.data.blocks import Batch, Blocks
from uptrain.data.text import MAP_BATCH, TextStream

# Tokens of text a data worker shuffles at a time: the shuffle's reach, the memory of a few
# windows per worker, and the most a resume re-reads per worker (about 6 CPU-s at 160k tokens/s).
WINDOW_TOKENS = 1 << 20


class MicroBatches(Protocol):
    """What the training step reads: each process's micro-batches of an optimizer step, and the
    position to save with a checkpoint (`TrainBlocks`, `StreamedTrainBlocks`)."""

    last_wait_s: float  # how long the last `micro_batches` took to gather its rows

    def micro_batches(self, step: int, rank: int) -> list[Batch]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict | None) -> None: ...

    def describe(self, total_steps: int) -> str:
        """What the run's plan says of its training data."""
        ...


class TrainBlocks:
    """Training micro-batches indexed by (step, micro-batch, process): a pure function of the seed.

    Optimizer step s (counted from 0) reads the global batch `order[s·G : (s+1)·G]` of the current
    epoch's permutation, G = batch_size × grad_accum × processes; process r's micro-batch m is one
    contiguous slice of it. An epoch is as many whole global batches as the data holds.
    """

    def __init__(self, blocks: Blocks, seed: int, batch_size: int, grad_accum: int, num_processes: int):
        self.blocks, self.seed = blocks, seed
        self.batch_size, self.grad_accum, self.num_processes = batch_size, grad_accum, num_processes
        self.global_batch = batch_size * grad_accum * num_processes
        self.steps_per_epoch = len(blocks) // self.global_batch
        self._epoch, self._order = -1, None
        self.last_wait_s = 0.0  # how long the last `micro_batches` took to gather its blocks

    def describe(self, total_steps: int) -> str:
        return f"{len(self.blocks)} blocks, {total_steps / self.steps_per_epoch:.3g} epochs over them"

    def state_dict(self) -> dict:
        """Nothing to save: the order is a function of the seed and the step."""
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.blocks), generator=g).tolist()
        return self._order

    def micro_batches(self, step: int, rank: int) -> list[Batch]:
        """The `grad_accum` micro-batches process `rank` trains on at optimizer step `step` (from 0)."""
        start_time = time.perf_counter()
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._permutation(epoch)
        start = within * self.global_batch
        out = []
        for m in range(self.grad_accum):
            # Micro-batch m of every process before micro-batch m + 1: the same blocks form each
            # global batch whatever the split between processes and accumulation.
            first = start + (m * self.num_processes + rank) * self.batch_size
            out.append(self.blocks.take(order[first : first + self.batch_size]))
        self.last_wait_s = time.perf_counter() - start_time
        return out


def _seed(*values: int) -> int:
    """One 63-bit seed from several integers (numpy's SeedSequence: stable across versions)."""
    return int(np.random.SeedSequence(list(values)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def window_blocks(seq_len: int, window_tokens: int = WINDOW_TOKENS) -> int:
    """Blocks a data worker shuffles at a time: `window_tokens` of text."""
    return max(1, window_tokens // seq_len)


class ShareWindows(torch.utils.data.IterableDataset):
    """One share of a TextStream (process rank × data worker), read epoch after epoch in windows.

    Runs in a DataLoader worker process: reads the share's raw rows, tokenizes and packs them
    (`MAP_BATCH` documents at a time, as the up-front path does), and yields each window of
    about WINDOW_TOKENS, shuffled, as a dict: `blocks` (int32 [n, seq_len]), `at` (where the
    window starts), `offset` (blocks of it already trained on, after a resume) and `next`
    (where the following window starts). A position is small: (epoch, part, window, offset,
    `source` = the datasets `state_dict()` of the part at the window's start), so a resume
    re-reads at most one window, whatever the step. Epoch e reads the shards in an order drawn
    from (seed, e), the same in every process. A data error is yielded as {"error": line}:
    the training process raises it as one line.
    """

    def __init__(
        self,
        stream: TextStream,
        seed: int,
        slot: int,
        slots: int,
        start: dict | None,
        window_tokens: int = WINDOW_TOKENS,
    ):
        self.stream, self.seed, self.slot, self.slots, self.start = stream, seed, slot, slots, start
        self.window = window_blocks(stream.seq_len, window_tokens)

    def __iter__(self):
        try:
            yield from self._windows()
        except UptrainError as err:
            yield {"error": str(err)}
        except Exception as err:  # datasets and the file readers raise many types: one line for the user
            yield {"error": f"cannot read {self.stream.label}: {exception_line(err)}"}

    def _parts(self, epoch: int) -> list:
        n = self.stream.texts.num_shards
        order = torch.randperm(n, generator=torch.Generator().manual_seed(_seed(self.seed, epoch))).tolist()
        return self.stream.share(self.slot, self.slots, order)

    def _windows(self):
        at = dict(self.start) if self.start else {"epoch": 0, "part": 0, "window": 0, "offset": 0, "source": None}
        epoch, first_part = at["epoch"], at["part"]
        resume = self.start is not None
        while True:
            read_any, whole_epoch = False, not resume or (first_part == 0 and at["source"] is None)
            for part_index, part in enumerate(self._parts(epoch)):
                if part_index < first_part:
                    continue
                source, window, offset = (at["source"], at["window"], at["offset"]) if resume else (None, 0, 0)
                resume = False
                if source is not None:
                    part.load_state_dict(source)
                batches = part.iter(batch_size=MAP_BATCH)
                while True:
                    rows = []
                    for batch in batches:
                        rows += self.stream.pack(batch)["input_ids"]
                        if len(rows) >= self.window:
                            break
                    if not rows:
                        break
                    read_any = True
                    after = part.state_dict()
                    g = torch.Generator().manual_seed(_seed(self.seed, epoch, self.slot, part_index, window))
                    order = torch.randperm(len(rows), generator=g)
                    here = {"epoch": epoch, "part": part_index, "window": window, "source": source}
                    yield {
                        "blocks": torch.tensor(rows, dtype=torch.int32)[order][offset:],
                        "at": here,
                        "offset": offset,
                        "next": {**here, "window": window + 1, "offset": 0, "source": after},
                    }
                    source, window, offset = after, window + 1, 0
            if whole_epoch and not read_any:
                raise UptrainError(
                    f"{self.stream.label}: share {self.slot} of {self.slots} (processes × data_workers) yields "
                    f"no block of {self.stream.seq_len} tokens; give more text or more files, or fewer processes "
                    "or data_workers"
                )
            epoch, first_part = epoch + 1, 0


class StreamedTrainBlocks:
    """Training micro-batches from a streamed dataset (a TextStream), read off the training thread.

    Each process reads only its share: with W = `workers` (`data_workers`), process r owns
    shares r·W … r·W + W − 1 of processes × W (whole files where there are enough, see
    `TextStream.share`), each read and tokenized by its own DataLoader worker process, a window
    ahead (prefetch). Micro-batches go round-robin over the process's shares. The position of
    every share is kept (`state_dict`) and saved with each checkpoint, so a resume starts
    where the checkpoint was, re-reading at most one window per share: its cost does not grow
    with the step. The order depends on processes × W: a resume with another number of either
    is refused (`load_state_dict`).
    """

    def __init__(
        self,
        stream: TextStream,
        seed: int,
        batch_size: int,
        grad_accum: int,
        num_processes: int,
        rank: int = 0,
        workers: int = 1,
        window_tokens: int = WINDOW_TOKENS,
    ):
        self.stream, self.seed = stream, seed
        self.batch_size, self.grad_accum, self.num_processes = batch_size, grad_accum, num_processes
        self.rank, self.workers, self.window_tokens = rank, workers, window_tokens
        self.global_batch = batch_size * grad_accum * num_processes
        self.positions: list[dict | None] = [None] * workers  # where each share's next block is
        self.next_share = 0
        self.last_wait_s = 0.0  # how long the last `micro_batches` waited for data
        self._loaders: list | None = None
        self._windows: list[dict | None] = [None] * workers
        self._taken = [0] * workers

    def _start(self) -> None:
        slots = self.num_processes * self.workers
        self._loaders = [
            iter(
                torch.utils.data.DataLoader(
                    ShareWindows(
                        self.stream,
                        self.seed,
                        self.rank * self.workers + w,
                        slots,
                        self.positions[w],
                        self.window_tokens,
                    ),
                    batch_size=None,
                    num_workers=1,
                    prefetch_factor=2,  # the next window is tokenized while this one is trained on
                )
            )
            for w in range(self.workers)
        ]
        self._windows, self._taken = [None] * self.workers, [0] * self.workers

    def _take(self, share: int, count: int) -> torch.Tensor:
        parts = []
        while count:
            window = self._windows[share]
            if window is None or self._taken[share] == len(window["blocks"]):
                window = next(self._loaders[share])
                if "error" in window:
                    raise UptrainError(window["error"])
                self._windows[share], self._taken[share] = window, 0
            first = self._taken[share]
            n = min(count, len(window["blocks"]) - first)
            parts.append(window["blocks"][first : first + n])
            self._taken[share], count = first + n, count - n
            done = self._taken[share] == len(window["blocks"])
            self.positions[share] = (
                window["next"] if done else {**window["at"], "offset": window["offset"] + self._taken[share]}
            )
        return torch.cat(parts).long()

    def micro_batches(self, step: int, rank: int) -> list[torch.Tensor]:
        """The next `grad_accum` micro-batches of this process (`step` and `rank` as for
        `TrainBlocks`; steps come in order, a resume restores its position with `load_state_dict`)."""
        start = time.perf_counter()
        if self._loaders is None:
            self._start()
        out = []
        for _ in range(self.grad_accum):
            out.append(self._take(self.next_share, self.batch_size))
            self.next_share = (self.next_share + 1) % self.workers
        self.last_wait_s = time.perf_counter() - start
        return out

    def describe(self, total_steps: int) -> str:
        return "streamed"

    def state_dict(self) -> dict:
        """This process's position in the stream: JSON, a few hundred bytes per share."""
        return {
            "processes": self.num_processes,
            "data_workers": self.workers,
            "next_share": self.next_share,
            "shares": self.positions,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from `state` (of `state_dict`); refuses, in one line, a state made with
        another number of processes or data workers (each process's share would differ)."""
        if state is None:
            raise UptrainError(
                f"the checkpoint holds no position in the streamed train_data for process {self.rank} "
                "(written by fewer processes, or by an uptrain that replayed the stream instead); resume "
                "with the processes it was written with, or start over with --overwrite"
            )
        keys = ("processes", "data_workers", "next_share", "shares")
        if not all(k in state for k in keys) or not isinstance(state["shares"], list):
            raise UptrainError(
                f"the checkpoint's position in the streamed train_data (process {self.rank}) is damaged; "
                "delete that checkpoint to resume from the one before it"
            )
        if (state["processes"], state["data_workers"]) != (self.num_processes, self.workers):
            raise UptrainError(
                f"the streamed train_data was split over {state['processes']} processes × "
                f"{state['data_workers']} data_workers when the checkpoint was written, now "
                f"{self.num_processes} × {self.workers}: each process reads its own files, so the order "
                "depends on that split; resume with the same numbers or start over with --overwrite"
            )
        self.positions, self.next_share = list(state["shares"]), state["next_share"]
        self._loaders = None


def eval_batches(
    blocks: Blocks, eval_blocks: int, batch_size: int, rank: int, num_processes: int
) -> list[tuple[Batch, torch.Tensor]]:
    """The first `eval_blocks` rows, in data order, dealt round-robin to processes and batched.

    Returns (batch, counted [b] bool) pairs. Every process gets the same number of batches,
    because sharded models (FSDP, ZeRO-3) need every process in every forward; the rows that
    only fill up a short process are not counted.
    """
    n = min(eval_blocks, len(blocks))
    per_process = -(-n // num_processes)
    mine = list(range(rank, n, num_processes))
    counted = [True] * len(mine) + [False] * (per_process - len(mine))
    mine += [0] * (per_process - len(mine))
    return [
        (blocks.take(mine[i : i + batch_size]), torch.tensor(counted[i : i + batch_size]))
        for i in range(0, per_process, batch_size)
    ]
