"""Provenance digests of the source files: computed beside the conversion, checked against
independent hashes of the same bytes, and the Hub cache's own sha256 names."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading

import blake3
import pytest

from scripts.synthetic_checkpoint import write_synthetic_llama
from uptrain import UptrainError
from uptrain.checkpoint.hashing import BackgroundHasher
from uptrain.convert import convert_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_synthetic_llama(
        tmp_path_factory.mktemp("hash") / "src",
        hidden=128,
        layers=2,
        intermediate=64,
        vocab=64,
        max_shard_bytes=100_000,
    )


def weight_files(folder):
    return sorted(folder.glob("*.safetensors"))


def provenance(out) -> dict:
    return json.loads((out / "uptrain.json").read_text())


@pytest.mark.parametrize("algorithm, reference", [("blake3", blake3.blake3), ("sha256", hashlib.sha256)])
def test_digests_match_an_independent_hash_of_each_file(src, tmp_path, algorithm, reference):
    out = convert_checkpoint(src, tmp_path / "out", 2, source_hash=algorithm, progress=False)
    files = weight_files(src)
    assert len(files) > 1
    assert provenance(out)["source_files"] == {
        f.name: {"bytes": f.stat().st_size, algorithm: reference(f.read_bytes()).hexdigest()} for f in files
    }


def test_no_hash_records_sizes_only(src, tmp_path):
    out = convert_checkpoint(src, tmp_path / "out", 2, source_hash="none", progress=False)
    assert provenance(out)["source_files"] == {f.name: {"bytes": f.stat().st_size} for f in weight_files(src)}


def hub_cache_copy(src, cache, sha256_of=lambda data: hashlib.sha256(data).hexdigest()):
    """Lay `src` out as huggingface_hub caches a model: snapshot symlinks into blobs named by hash."""
    blobs, snapshot = cache / "blobs", cache / "snapshots" / ("0" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        data = f.read_bytes()
        # LFS files (the weights) are named by their sha256, the rest by their git blob sha1.
        name = sha256_of(data) if f.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
        (blobs / name).write_bytes(data)
        os.symlink(os.path.relpath(blobs / name, snapshot), snapshot / f.name)
    return snapshot


def test_hub_cache_sha256_recorded_and_checked(src, tmp_path):
    snapshot = hub_cache_copy(src, tmp_path / "cache")
    expected = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in weight_files(src)}
    for algorithm in ("blake3", "sha256", "none"):
        out = convert_checkpoint(snapshot, tmp_path / algorithm, 2, source_hash=algorithm, progress=False)
        recorded = provenance(out)["source_files"]
        assert {name: r["hub_sha256"] for name, r in recorded.items()} == expected
        if algorithm == "sha256":
            assert all(r["sha256"] == r["hub_sha256"] for r in recorded.values())


def test_a_blob_that_does_not_match_its_hub_name_fails_under_sha256(src, tmp_path):
    snapshot = hub_cache_copy(src, tmp_path / "cache", sha256_of=lambda data: hashlib.sha256(data + b"!").hexdigest())
    out = convert_checkpoint(snapshot, tmp_path / "unchecked", 2, progress=False)  # blake3 cannot check the name
    assert out.is_dir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "uptrain",
            "convert",
            str(snapshot),
            str(tmp_path / "checked"),
            "-g",
            "2",
            "--source-hash",
            "sha256",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "does not match the sha256 the Hub cache names it by" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "unchecked"]  # nothing half-written


def test_unknown_hash_is_refused_before_anything_is_written(src, tmp_path):
    with pytest.raises(UptrainError, match="source_hash.*blake3.*sha256.*none"):
        convert_checkpoint(src, tmp_path / "out", 2, source_hash="md5", progress=False)
    assert not (tmp_path / "out").exists()


def test_leaving_early_stops_the_hashing_thread(tmp_path):
    (tmp_path / "big0").write_bytes(os.urandom(64 * 1024 * 1024))
    for i in range(1, 16):
        os.link(tmp_path / "big0", tmp_path / f"big{i}")
    hasher = BackgroundHasher([tmp_path / f"big{i}" for i in range(16)], "sha256")  # 1 GiB: half a second
    with pytest.raises(RuntimeError), hasher:
        raise RuntimeError("conversion failed")
    assert not any(t.name == "uptrain-source-hash" for t in threading.enumerate())
    assert len(hasher._digests) < 16  # stopped, not run to the end


def test_unreadable_file_is_one_clear_error(tmp_path):
    with BackgroundHasher([tmp_path / "gone.safetensors"], "blake3") as hasher:
        with pytest.raises(UptrainError, match="cannot read .*gone.safetensors to hash it"):
            hasher.result()
