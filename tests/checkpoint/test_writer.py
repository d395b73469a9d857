"""The one shard planner and writer (used by `uptrain convert` and by `final/`): shards no
larger than the limit, named and indexed as transformers names them, read back by safetensors
and transformers; writes out of plan refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from uptrain.checkpoint.writer import OutputEntry, ShardedWriter, plan_shards, write_tensors


def entries(*sizes: int) -> list[OutputEntry]:
    return [OutputEntry(f"t{i}", torch.uint8, (n,)) for i, n in enumerate(sizes)]


def test_shards_are_cut_in_order_at_the_limit_and_a_larger_tensor_stands_alone():
    shards = plan_shards(entries(4, 4, 4, 10, 2, 6), 8)
    assert [[e.nbytes for e in s.entries] for s in shards] == [[4, 4], [4], [10], [2, 6]]
    assert [s.file for s in shards] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [s.file for s in plan_shards(entries(4, 4), 8)] == ["model.safetensors"]
    assert [s.file for s in plan_shards([], 8)] == ["model.safetensors"]


def test_tensors_written_in_shards_read_back_with_an_index(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    write_tensors(tensors, tmp_path, max_shard_bytes=64, metadata={"origin": "test"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == list(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, tensor in tensors.items():
        file = tmp_path / index["weight_map"][name]
        assert torch.equal(load_file(file)[name], tensor), name
        with safe_open(file, "pt") as f:
            assert f.metadata() == {"origin": "test", "format": "pt"}
    # 60 bytes; then 56 + 8 + 0, exactly the limit
    assert (
        list(index["weight_map"].values())
        == ["model-00001-of-00002.safetensors"] + ["model-00002-of-00002.safetensors"] * 3
    )


def test_one_shard_has_no_index(tmp_path):
    write_tensors({"a": torch.ones(2)}, tmp_path, max_shard_bytes=10**9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_writes_out_of_plan_are_refused(tmp_path):
    (tmp_path / "order").mkdir()
    with pytest.raises(RuntimeError, match="out of plan order"):
        with ShardedWriter(tmp_path / "order", entries(2, 2), 8) as writer:
            writer.begin("t1")
    for case, sizes in (("more", (2,)), ("short", (4, 2))):
        folder = tmp_path / case
        folder.mkdir()
        with pytest.raises(RuntimeError):
            with ShardedWriter(folder, entries(*sizes), 2) as writer:
                writer.begin("t0")
                writer.write(memoryview(b"xyz"))
                if case == "short":
                    writer.begin("t1")
    with pytest.raises(RuntimeError, match="closed before every planned"):
        with ShardedWriter(tmp_path, entries(2, 2), 2) as writer:
            writer.begin("t0")
            writer.write(memoryview(b"xy"))
    assert not (tmp_path / "model.safetensors.index.json").exists()  # no index for an incomplete checkpoint
