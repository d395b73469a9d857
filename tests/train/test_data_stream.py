"""Streamed training data: each process reads and tokenizes only its share, in DataLoader
workers, and a resume restores saved positions instead of replaying the stream."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from uptrain import UptrainError
from uptrain.data.batches import ShareWindows, StreamedTrainBlocks
from uptrain.data.text import MAP_BATCH, Pack, TextStream, load_blocks

SEQ = 16


@pytest.fixture(scope="module")
def tokenizer():
    from uptrain.data.corpus import load_tokenizer

    return load_tokenizer()  # byte-level: any text, so each block can be traced back to its file


def write_files(folder, files: int, docs: int) -> list[str]:
    paths = []
    for f in range(files):
        path = folder / f"part{f}.jsonl"
        lines = (json.dumps({"text": f"file{f} doc{d} the cat sees a dog again"}) for d in range(docs))
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def stream_of(paths, tokenizer) -> TextStream:
    stream, _ = load_blocks(paths, "train_data", tokenizer, SEQ, "text", "train", None, "paragraph", True, None)
    return stream


class CountingPack(Pack):
    """The real packing, counting the documents it is given (runs in this process here)."""

    def __init__(self, pack: Pack):
        super().__init__(pack.tokenizer, pack.text_field, pack.seq_len, pack.what)
        self.documents = 0

    def __call__(self, batch):
        self.documents += len(batch[self.text_field])
        return super().__call__(batch)


def counted(stream: TextStream) -> TextStream:
    return TextStream(stream.texts, CountingPack(stream.pack), stream.columns)


def docs_in(blocks, tokenizer) -> set[tuple[int, int]]:
    """The documents named whole in any block (each decoded alone: blocks cut documents)."""
    texts = tokenizer.batch_decode(torch.as_tensor(blocks).tolist())
    return {(int(f), int(d)) for text in texts for f, d in re.findall(r"file(\d+) doc(\d+) ", text)}


def epoch_blocks(stream, slot, slots, epoch=0) -> torch.Tensor:
    """The blocks of one epoch of a share (an endless stream, epoch after epoch)."""
    windows = itertools.takewhile(
        lambda w: _epoch(w) <= epoch, ShareWindows(stream, 0, slot, slots, None, window_tokens=64 * SEQ)
    )
    return torch.cat([w["blocks"] for w in windows if w["at"]["epoch"] == epoch])


def _epoch(window) -> int:
    if "error" in window:
        raise UptrainError(window["error"])
    return window["at"]["epoch"]


def test_each_share_reads_and_tokenizes_only_its_files(tmp_path, tokenizer):
    paths = write_files(tmp_path, files=4, docs=300)
    files_seen, total = [], 0
    for slot in range(4):  # 2 processes × 2 data workers: one file each
        stream = counted(stream_of(paths, tokenizer))
        blocks = next(iter(ShareWindows(stream, 0, slot, 4, None, window_tokens=10**6)))["blocks"]
        files_seen.append({f for f, _ in docs_in(blocks, tokenizer)})
        assert stream.pack.documents == 300  # its own file's documents, no other
        total += len(blocks)
    assert all(len(s) == 1 for s in files_seen) and set().union(*files_seen) == {0, 1, 2, 3}
    whole = sum(1 for _ in stream_of(paths, tokenizer))
    assert abs(total - whole) <= 4  # packed per file instead of across files: at most a block each


def test_with_fewer_files_than_shares_each_tokenizes_one_document_in_n(tmp_path, tokenizer):
    paths = write_files(tmp_path, files=1, docs=400)
    seen = []
    for slot in range(4):
        stream = counted(stream_of(paths, tokenizer))
        seen.append(docs_in(epoch_blocks(stream, slot, 4), tokenizer))
        assert stream.pack.documents <= 2 * 100  # its 100 documents, read in two epochs at most
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])
    assert len(set().union(*seen)) > 0.4 * 400  # (a name cut by a block boundary is not seen)


def test_shares_read_their_files_in_another_order_each_epoch(tmp_path, tokenizer):
    paths = write_files(tmp_path, files=8, docs=40)
    stream = stream_of(paths, tokenizer)
    orders = []
    for epoch in range(3):
        blocks = epoch_blocks(stream, 0, 2, epoch)
        orders.append(docs_in(blocks[:4], tokenizer))
        assert len({f for f, _ in docs_in(blocks, tokenizer)}) == 4  # half of the files each epoch
    assert len({frozenset(f for f, _ in o) for o in orders}) > 1


def run_steps(blocks: StreamedTrainBlocks, first: int, last: int, rank: int) -> list[list[torch.Tensor]]:
    return [blocks.micro_batches(step, rank) for step in range(first, last)]


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_from_a_saved_position_is_exact(tmp_path, tokenizer, workers):
    """Positions taken mid-window, at window ends and past an epoch end all resume to the blocks
    an uninterrupted run reads next."""
    stream = stream_of(write_files(tmp_path, files=3, docs=60), tokenizer)

    def make(rank=1):
        return StreamedTrainBlocks(stream, 3, 3, 2, 2, rank, workers, window_tokens=10 * SEQ)

    straight = make()
    steps = run_steps(straight, 0, 40, 1)  # several epochs of this process's share
    epochs = straight.positions[0]["epoch"]
    assert epochs >= 2
    for at in (1, 5, 13, 27):
        before = make()
        run_steps(before, 0, at, 1)
        state = json.loads(json.dumps(before.state_dict()))  # as it is saved: JSON
        resumed = make()
        resumed.load_state_dict(state)
        again = run_steps(resumed, at, min(at + 6, 40), 1)
        for a, b in zip(steps[at : at + 6], again, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), at
    other_rank = run_steps(make(rank=0), 0, 3, 0)
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(other_rank, steps[:3], strict=True))


def test_resume_rereads_at_most_one_window_whatever_the_step(tmp_path, tokenizer):
    stream = stream_of(write_files(tmp_path, files=1, docs=8 * MAP_BATCH), tokenizer)
    # About two MAP_BATCH-document batches per window: four windows in the first epoch.
    window_tokens = 2 * MAP_BATCH * 12
    windows = list(itertools.islice(ShareWindows(stream, 0, 0, 1, None, window_tokens), 4))
    assert [w["at"]["epoch"] for w in windows] == [0] * 4
    costs = []
    for i in (1, 3):
        position = {**windows[i]["at"], "offset": 5}
        resumed = counted(stream)
        first = next(iter(ShareWindows(resumed, 0, 0, 1, position, window_tokens)))
        assert torch.equal(first["blocks"], windows[i]["blocks"][5:])
        costs.append(resumed.pack.documents)
    # Resuming in window 3 tokenizes as much as in window 1: the one window, not those before it.
    assert costs[0] == costs[1] == 2 * MAP_BATCH


def test_a_resume_with_another_split_is_refused_in_one_line(tmp_path, tokenizer):
    stream = stream_of(write_files(tmp_path, files=2, docs=50), tokenizer)
    two = StreamedTrainBlocks(stream, 0, 2, 1, 2, 0, 1)
    run_steps(two, 0, 2, 0)
    state = two.state_dict()
    for processes, workers in ((1, 1), (2, 2)):
        other = StreamedTrainBlocks(stream, 0, 4 // processes, 1, processes, 0, workers)
        with pytest.raises(UptrainError, match=r"split over 2 processes × 1 data_workers .* now \d × \d") as err:
            other.load_state_dict(state)
        assert "\n" not in str(err.value)
    with pytest.raises(UptrainError, match="holds no position in the streamed train_data for process 2"):
        StreamedTrainBlocks(stream, 0, 1, 1, 4, 2, 1).load_state_dict(None)
    with pytest.raises(UptrainError, match="is damaged"):
        two.load_state_dict({"processes": 2})


def test_data_errors_in_a_worker_are_one_line(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine text here"}) + "\n" + json.dumps({"text": 12345}) + "\n")
    blocks = StreamedTrainBlocks(stream_of([str(bad)], tokenizer), 0, 1, 1, 1, 0, 1)
    with pytest.raises(UptrainError, match=r"`train_data` .*: a `text` value is int \('12345'\), not text") as err:
        blocks.micro_batches(0, 0)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
    short = write_files(tmp_path, files=1, docs=1)
    blocks = StreamedTrainBlocks(stream_of(short, tokenizer), 0, 1, 1, 2, 1, 2)
    with pytest.raises(UptrainError, match=r"share 2 of 4 \(processes × data_workers\) yields no block of 16"):
        blocks.micro_batches(0, 1)


def test_a_damaged_saved_position_is_refused_in_one_line(tmp_path):
    from uptrain.train.checkpoint import load_data_state

    folder = tmp_path / "step_00000004"
    folder.mkdir()
    assert load_data_state(folder, 0) is None  # data tokenized up front saves none
    (folder / "data_state_0.json").write_text('{"processes": 2, "shares": [')
    with pytest.raises(UptrainError, match=r"cannot resume: .*data_state_0.json is not valid JSON .*; delete .*step_"):
        load_data_state(folder, 0)
    (folder / "data_state_1.json").write_text("[1, 2]")
    with pytest.raises(UptrainError, match="data_state_1.json is not a JSON object"):
        load_data_state(folder, 1)
