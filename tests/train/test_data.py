"""Tokenize + pack, and the deterministic order of training blocks."""

from __future__ import annotations

import json

import pytest
import torch

from uptrain import UptrainError
from uptrain.data.batches import StreamedTrainBlocks, TrainBlocks, eval_batches
from uptrain.data.blocks import Blocks, TensorBlocks
from uptrain.data.pairs import PairExamples
from uptrain.data.shards import TokenShards
from uptrain.data.spec import TokenizeOptions
from uptrain.data.text import TextStream, TokenBlocks, head_blocks, load_blocks, resolve_data
from uptrain.data.tokenize import tokenize


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets["gqa"])


def load(spec, tokenizer, seq_len=16, streaming=None, text_field="text", sample_by="paragraph"):
    blocks, _ = load_blocks(
        spec, "train_data", tokenizer, seq_len, text_field, "train", None, sample_by, streaming, None
    )
    return blocks


def test_documents_are_joined_with_eos_and_packed(tmp_path, tokenizer):
    docs = ["the cat sees a dog", "my sister likes the river again", "a small bird"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    blocks = load(str(path), tokenizer, seq_len=4)
    eos = tokenizer.eos_token_id
    stream = [t for d in docs for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]]
    assert len(stream) == 17 and len(blocks) == 4  # the partial last block (1 token) is dropped
    assert blocks.take([0, 1, 2, 3]).flatten().tolist() == stream[:16]


def test_one_text_is_tokenized_once_for_every_copy_of_one_tokenizer(assets, tmp_path):
    """The same tokenizer files in two folders (a source and its conversion, as every run of a
    compare has them) pack a text into the same cached blocks, for train and calibration keys
    alike: the second `load_blocks` reads the first's cache. Another block length, another
    tokenizer, or the text changed: packed anew."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"the cat sees a dog {i} times"}) + "\n" for i in range(50)))
    copy = shutil.copytree(assets["gqa"], tmp_path / "converted")
    source, converted = (AutoTokenizer.from_pretrained(p) for p in (assets["gqa"], copy))
    other = AutoTokenizer.from_pretrained(assets["other"])

    def cache(tok, key="train_data", seq_len=8) -> list[str]:
        blocks, _ = load_blocks(str(path), key, tok, seq_len, "text", "train", None, "paragraph", None, None)
        return [f["filename"] for f in blocks.dataset.cache_files]

    first = cache(source)
    assert first and cache(converted) == first and cache(converted, "calibration_data") == first
    assert cache(source, seq_len=4) != first and cache(other) != first
    path.write_text(path.read_text() + json.dumps({"text": "a small bird"}) + "\n")
    assert cache(converted) != first


def test_compressed_jsonl_reads_like_plain(tmp_path, tokenizer):
    import gzip

    lines = "".join(json.dumps({"text": d}) + "\n" for d in ["the cat sees a dog", "a small bird sings"])
    (tmp_path / "plain.jsonl").write_text(lines)
    with gzip.open(tmp_path / "packed.jsonl.gz", "wt") as f:
        f.write(lines)
    plain = load(str(tmp_path / "plain.jsonl"), tokenizer, 4)
    packed = load(str(tmp_path / "packed.jsonl.gz"), tokenizer, 4)
    assert len(plain) == len(packed) > 0
    assert torch.equal(plain.take(list(range(len(plain)))), packed.take(list(range(len(packed)))))


def test_text_file_paragraphs_are_documents(tmp_path, tokenizer):
    path = tmp_path / "a.txt"
    path.write_text("The cat sees a dog.\nThe dog likes the river.\n\nA small bird.\n")
    blocks = load(str(path), tokenizer, seq_len=2)
    ids = blocks.take(list(range(len(blocks)))).flatten().tolist()
    assert ids.count(tokenizer.eos_token_id) == 2  # two paragraphs


def test_parquet_and_missing_column(tmp_path, tokenizer):
    from datasets import Dataset

    path = tmp_path / "d.parquet"
    Dataset.from_dict({"body": ["the cat sees a dog again"] * 8}).to_parquet(str(path))
    assert len(load(str(path), tokenizer, seq_len=8, text_field="body")) == 7
    with pytest.raises(UptrainError, match="has no column `text`.*body"):
        load(str(path), tokenizer)


def test_paths_that_do_not_exist_are_not_hub_names(tmp_path):
    with pytest.raises(UptrainError, match="does not exist"):
        resolve_data(str(tmp_path / "missing.txt"), "train_data")
    with pytest.raises(UptrainError, match="cannot read"):
        (tmp_path / "x.csv").write_text("a")
        resolve_data(str(tmp_path / "x.csv"), "train_data")
    assert not resolve_data("HuggingFaceFW/fineweb-edu", "train_data").is_local


def test_hub_name_offline_fails_with_one_line(tokenizer):
    with pytest.raises(UptrainError, match="cannot load no-such-user/no-such-dataset .*HF_DATASETS_OFFLINE"):
        load("no-such-user/no-such-dataset", tokenizer)


class FakeBlocks:
    """Block i is the row [i, i, …]: lets the tests see which block went where. A `Blocks` by its
    two methods alone, as the training order and evaluation read one."""

    def __init__(self, n: int, seq_len: int = 3):
        self.n, self.seq_len = n, seq_len

    def __len__(self):
        return self.n

    def take(self, indices):
        return torch.tensor(indices).unsqueeze(1).repeat(1, self.seq_len)


def ids(batches) -> list[int]:
    return [int(row[0]) for b in batches for row in b]


def test_global_batch_is_the_same_whatever_the_split():
    blocks = FakeBlocks(40)
    one = TrainBlocks(blocks, seed=3, batch_size=4, grad_accum=2, num_processes=1)
    two = TrainBlocks(blocks, seed=3, batch_size=2, grad_accum=2, num_processes=2)
    accum = TrainBlocks(blocks, seed=3, batch_size=1, grad_accum=8, num_processes=1)
    for step in range(8):  # 5 steps per epoch: crosses into the second epoch
        single = ids(one.micro_batches(step, 0))
        split = ids(two.micro_batches(step, 0)) + ids(two.micro_batches(step, 1))
        assert sorted(single) == sorted(split) == sorted(ids(accum.micro_batches(step, 0)))
        assert len(set(single)) == 8
    epoch0 = [i for s in range(5) for i in ids(one.micro_batches(s, 0))]
    assert sorted(epoch0) == list(range(40))  # an epoch reads every block once
    epoch1 = [i for s in range(5, 10) for i in ids(one.micro_batches(s, 0))]
    assert sorted(epoch1) == list(range(40)) and epoch1 != epoch0


def test_order_is_a_function_of_seed_and_step():
    a = TrainBlocks(FakeBlocks(40), seed=1, batch_size=4, grad_accum=1, num_processes=1)
    b = TrainBlocks(FakeBlocks(40), seed=1, batch_size=4, grad_accum=1, num_processes=1)
    c = TrainBlocks(FakeBlocks(40), seed=2, batch_size=4, grad_accum=1, num_processes=1)
    # Asked out of order (as after a resume), the answer does not change.
    assert ids(a.micro_batches(7, 0)) == ids(b.micro_batches(7, 0))
    assert ids(a.micro_batches(3, 0)) == ids(b.micro_batches(3, 0)) != ids(c.micro_batches(3, 0))


def test_eval_batches_give_every_process_the_same_number_of_batches():
    blocks = FakeBlocks(50)
    per_rank = [eval_batches(blocks, 7, 2, rank, 3) for rank in range(3)]
    assert {len(b) for b in per_rank} == {2}
    counted = [int(row[0]) for batches in per_rank for x, m in batches for row, keep in zip(x, m) if keep]
    assert sorted(counted) == list(range(7))  # each of the first 7 blocks counted exactly once
    alone = eval_batches(blocks, 7, 2, 0, 1)
    assert [len(x) for x, _ in alone] == [2, 2, 2, 1] and all(bool(m.all()) for _, m in alone)


def test_streamed_blocks_resume_where_a_fresh_stream_would_be(assets, tokenizer):
    stream = load(str(assets["train"]), tokenizer, streaming=True)
    fresh = StreamedTrainBlocks(stream, seed=0, batch_size=2, grad_accum=1, num_processes=2, rank=0)
    steps = [ids_(fresh.micro_batches(s, 0)) for s in range(3)]
    resumed = StreamedTrainBlocks(stream, seed=0, batch_size=2, grad_accum=1, num_processes=2, rank=0)
    half = StreamedTrainBlocks(stream, seed=0, batch_size=2, grad_accum=1, num_processes=2, rank=0)
    half.micro_batches(0, 0), half.micro_batches(1, 0)
    resumed.load_state_dict(half.state_dict())
    assert ids_(resumed.micro_batches(2, 0)) == steps[2]
    other_rank = StreamedTrainBlocks(stream, seed=0, batch_size=2, grad_accum=1, num_processes=2, rank=1)
    theirs = [ids_(other_rank.micro_batches(s, 1)) for s in range(3)]
    # One file, two processes: each keeps every other document of it, so they share no block.
    assert not {tuple(r) for s in theirs for r in s} & {tuple(r) for s in steps for r in s}
    # Streaming packs as the up-front path does; only the order and each process's part differ.
    local = load(str(assets["train"]), tokenizer)
    stream_rows = {tuple(r["input_ids"]) for r in stream}
    assert stream_rows == {tuple(r) for r in local.take(list(range(len(local)))).tolist()}


def ids_(batches) -> list[list[int]]:
    return [row for b in batches for row in b.tolist()]


def test_every_source_of_blocks_gives_the_same_batch_for_the_same_indices(assets, tokenizer, tmp_path, shard_records):
    """Text tokenized up front, the folder `uptrain tokenize` writes of it, and the head of its
    stream: each a `Blocks`, equal row for row, and refusing bad indices in the same words."""
    text = str(assets["train"])
    folder = tokenize(
        TokenizeOptions(data=text, out=str(tmp_path / "tokens"), tokenizer=str(assets["gqa"]), seq_len=16,
                        shard_tokens=16 * 7),
        progress=False,
    )  # fmt: skip
    up_front, shards, stream = (
        load(text, tokenizer, streaming=False),
        load(str(folder), tokenizer),
        load(text, tokenizer, streaming=True),
    )
    assert isinstance(up_front, TokenBlocks) and isinstance(shards, TokenShards) and isinstance(stream, TextStream)
    head = head_blocks(stream, 40)
    assert isinstance(head, TensorBlocks) and len(head) == 40 and head_blocks(up_front, 40) is up_front
    order = [39, 0, 7, 7, 21, 8]  # across shards of 7 blocks, one repeated
    for source in (up_front, shards, head):
        assert isinstance(source, Blocks)
        assert source.take(order).dtype == torch.int64
        assert torch.equal(source.take(order), source.take(order))
        assert torch.equal(source.take(order), up_front.take(order))
        assert torch.equal(eval_batches(source, 9, 4, 1, 2)[1][0], eval_batches(up_front, 9, 4, 1, 2)[1][0])
        with pytest.raises(ValueError, match="no indices"):
            source.take([])
        with pytest.raises(IndexError, match=f"block {len(source)} of {len(source)}"):
            source.take([0, len(source)])
    assert len(shards) == len(up_front) > 40


def test_examples_are_blocks_padded_per_batch():
    examples = PairExamples([[5, 6, 7], [8], [9, 10]], [[1, 2], [3], [4, 4, 4]], pad_id=0)
    assert isinstance(examples, Blocks) and len(examples) == 3
    batch = examples.take([1, 0])
    assert batch["input_ids"].tolist() == [[8, 0, 0], [5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [[3, -100], [1, 2]]
    assert all(torch.equal(batch[k], examples.take([1, 0])[k]) for k in batch)
    (first, counted), (second, _) = eval_batches(examples, 3, 2, 0, 1)
    assert torch.equal(first["labels"], examples.take([0, 1])["labels"]) and counted.tolist() == [True, True]
    assert second["input_ids"].tolist() == [[9, 10]]
    with pytest.raises(IndexError, match="block 3 of 3"):
        examples.take([3])
