"""Streaming behaviour: bounded memory, byte-exact copies, sharding, casting, pickle input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from scripts.synthetic_checkpoint import write_synthetic_llama
from tests.convert.tiny_models import build_model, save
from uptrain.checkpoint.reader import read_safetensors_header
from uptrain.convert import convert_checkpoint

# A child's peak RSS starts from its parent's resident size at fork (Linux keeps the old mm's
# high-water mark across exec), so a converter started straight from pytest would report
# pytest's size. A small launcher process spawns it instead and reports that grandchild alone.
LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)
"""


def peak_rss_of_convert(src, out, *args) -> int:
    """Peak resident bytes of a real `uptrain convert` process."""
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, sys.executable, "-m", "uptrain", "convert", str(src), str(out), *args],
        capture_output=True,
        text=True,
    )
    code, peak = map(int, done.stdout.split())
    assert code == 0, done.stderr
    return peak


def test_peak_memory_grows_with_neither_layers_nor_shard_size(tmp_path):
    # Largest tensor: a 1024×1024 float32 projection, 4 MiB. The checkpoints are 70-140 MB.
    small = dict(hidden=1024, intermediate=256, vocab=1024, dtype=torch.float32, max_shard_bytes=20_000_000)
    tiny = write_synthetic_llama(tmp_path / "tiny", hidden=64, layers=2, intermediate=64, vocab=64)
    four = write_synthetic_llama(tmp_path / "l4", layers=4, **small)
    eight = write_synthetic_llama(tmp_path / "l8", layers=8, **small)
    largest = 1024 * 1024 * 4

    # Converting a tiny checkpoint measures everything that does not scale: interpreter,
    # torch, code paths. What the big conversions add on top must be a few tensors' worth.
    floor = peak_rss_of_convert(tiny, tmp_path / "o-tiny", "-g", "2")
    runs = {
        "4 layers, 20MB shards": peak_rss_of_convert(four, tmp_path / "o4", "-g", "2", "--max-shard-size", "20MB"),
        "8 layers, 20MB shards": peak_rss_of_convert(eight, tmp_path / "o8", "-g", "2", "--max-shard-size", "20MB"),
        "8 layers, 1 shard": peak_rss_of_convert(eight, tmp_path / "o8b", "-g", "1", "--max-shard-size", "1GB"),
    }
    for label, peak in runs.items():
        assert peak - floor <= 3 * largest, f"{label}: {(peak - floor) / 2**20:.1f} MiB above the floor"
    # Measured, not inherited: the launcher's own size is far below a converter's.
    assert floor > 100 * 2**20 and runs["8 layers, 1 shard"] > floor
    assert len(list((tmp_path / "o8").glob("*.safetensors"))) > 5
    assert len(list((tmp_path / "o8b").glob("*.safetensors"))) == 1


def _raw(path, info) -> bytes:
    with open(path, "rb") as f:
        f.seek(info.start)
        return f.read(info.end - info.start)


def test_untouched_tensors_keep_their_bytes_and_shards_are_bounded(tmp_path):
    src = write_synthetic_llama(
        tmp_path / "src", hidden=256, layers=3, intermediate=128, vocab=512, max_shard_bytes=300_000
    )
    out = convert_checkpoint(src, tmp_path / "out", 2, max_shard_size="250KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source_index = json.loads((src / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == source_index["weight_map"].keys()
    source_infos = {}
    for shard in set(source_index["weight_map"].values()):
        source_infos.update({t.name: t for t in read_safetensors_header(src / shard)[1]})
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        metadata, infos = read_safetensors_header(out / shard)
        assert metadata["format"] == "pt"
        shard_bytes = sum(t.nbytes for t in infos)
        assert shard_bytes <= 250_000 or len(infos) == 1
        for info in infos:
            total += info.nbytes
            assert index["weight_map"][info.name] == shard
            if ".k_proj." in info.name or ".v_proj." in info.name:
                assert info.shape == (2 * 32, 256)
            else:
                assert _raw(out / shard, info) == _raw(source_infos[info.name].file, source_infos[info.name])
    assert index["metadata"]["total_size"] == total


def test_dtype_cast_and_config(tmp_path):
    model = build_model("qwen2")
    src = save(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", 4, dtype="bfloat16", progress=False)
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    assert config.pop("num_key_value_heads") == 4 and source_config.pop("num_key_value_heads") == 8
    assert config.pop("dtype") == "bfloat16"
    source_config.pop("dtype", None)
    assert config == source_config  # nothing else changed


def test_pickle_only_with_allow_pickle_and_same_result(tmp_path):
    model = build_model("llama")
    safe = save(model, tmp_path / "safe")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((safe / "config.json").read_text())
    torch.save(load_file(safe / "model.safetensors"), pickled / "pytorch_model.bin")
    a = convert_checkpoint(safe, tmp_path / "a", 2, progress=False)
    b = convert_checkpoint(pickled, tmp_path / "b", 2, allow_pickle=True, progress=False)
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    provenance = json.loads((b / "uptrain.json").read_text())
    assert list(provenance["source_files"]) == ["pytorch_model.bin"]


def test_provenance_and_side_files(tmp_path):
    src = write_synthetic_llama(
        tmp_path / "src", hidden=128, layers=2, intermediate=64, vocab=64, max_shard_bytes=100_000
    )
    (src / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (src / "tokenizer_config.json").write_text("{}")
    (src / "training_args.bin").write_bytes(b"not copied")
    out = convert_checkpoint(src, tmp_path / "out", 1, pooling="first", seed=7, progress=False)
    provenance = json.loads((out / "uptrain.json").read_text())
    assert sorted(provenance["source_files"]) == sorted(f.name for f in src.glob("*.safetensors"))
    assert provenance["pooling"] == "first" and provenance["seed"] == 7
    assert provenance["num_key_value_heads"] == 1 and provenance["source_num_key_value_heads"] == 8
    assert (out / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    assert (out / "tokenizer_config.json").exists() and (out / "generation_config.json").exists()
    assert not (out / "training_args.bin").exists()
    assert "first" in (out / "README.md").read_text()


@pytest.mark.parametrize("overwrite", [False, True])
def test_kill_9_never_leaves_a_half_written_output(tmp_path, overwrite):
    src = write_synthetic_llama(
        tmp_path / "src",
        hidden=1024,
        layers=8,
        intermediate=256,
        vocab=1024,
        dtype=torch.float32,
        max_shard_bytes=20_000_000,
    )
    out = tmp_path / "out"
    if overwrite:
        out.mkdir()
        (out / "previous.txt").write_text("kept until a conversion completes")
    args = [sys.executable, "-m", "uptrain", "convert", str(src), str(out), "-g", "2", "--max-shard-size", "10MB"]
    proc = subprocess.Popen(args + (["--overwrite"] if overwrite else []), stderr=subprocess.DEVNULL)
    pattern = f".{out.name}.uptrain-tmp-{proc.pid}"
    while proc.poll() is None and not list((tmp_path / pattern).glob("model-00002-*")):
        time.sleep(0.002)  # wait until a shard is being written, then kill without warning
    proc.kill()
    proc.wait()
    assert proc.returncode == -9, "conversion finished before it could be killed"
    if overwrite:
        assert sorted(p.name for p in out.iterdir()) == ["previous.txt"]
    else:
        assert not out.exists()
    assert (tmp_path / pattern).exists()
    # The next run clears the dead run's temporary folder and completes.
    convert_checkpoint(src, out, 2, overwrite=True, progress=False)
    assert (out / "model.safetensors").exists() and not (out / "previous.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_error_while_pooling_ahead_stops_the_conversion(tmp_path, monkeypatch):
    """Pooled tensors are computed on a second thread: its errors surface, and nothing is left."""
    import threading

    from uptrain.convert import pooling

    def failing_mean(heads, ctx):
        if ".layers.2." in ctx.tensor_name:
            raise RuntimeError("pooling failed")
        return heads.mean(dim=1)

    monkeypatch.setitem(pooling.STRATEGIES, "failing", pooling.RowPooling("failing", "test", failing_mean))
    src = write_synthetic_llama(
        tmp_path / "src", hidden=128, layers=4, intermediate=64, vocab=64, max_shard_bytes=100_000
    )
    with pytest.raises(RuntimeError, match="pooling failed"):
        convert_checkpoint(src, tmp_path / "out", 2, pooling="failing", max_shard_size=50_000, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["src"]
    assert not any(t.name.startswith(("uptrain-pool", "uptrain-source-hash")) for t in threading.enumerate())
