"""Bad input: one line on stderr, exit code 2, and no OUT (or temporary sibling) left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.convert.tiny_models import build_model, save
from uptrain.cli import main
from uptrain.convert.layouts import LAYOUTS


@pytest.fixture(scope="module")
def mha(tmp_path_factory) -> Path:
    return save(build_model("llama"), tmp_path_factory.mktemp("mha") / "src")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return save(build_model("llama"), tmp_path_factory.mktemp("sharded") / "src", max_shard_size="20KB")


def copy_of(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def fails(capsys, tmp_path, argv, expected: str, out: Path | None = None):
    out = out or tmp_path / "out"
    capsys.readouterr()  # drop what fixtures printed (transformers' save progress bars)
    code = main(["convert", *map(str, argv[:1]), str(out), *map(str, argv[1:])])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("uptrain convert: error: ") and expected in err, err
    assert not out.exists() or out == getattr(fails, "kept", None)
    assert not list(out.parent.glob(f".{out.name}.uptrain-*")), "a temporary sibling was left behind"
    return err


@pytest.mark.parametrize("g,expected", [
    (3, "does not divide the model's 8 attention heads"),
    (0, "must be at least 1"),
    (-2, "must be at least 1"),
    (16, "exceeds the model's 8 attention heads"),
])
def test_bad_num_kv_heads(capsys, tmp_path, mha, g, expected):
    fails(capsys, tmp_path, [mha, "-g", g], expected)


def test_g_must_divide_current_kv_heads(capsys, tmp_path):
    gqa = save(build_model("llama", num_kv_heads=4), tmp_path / "gqa")
    fails(capsys, tmp_path, [gqa, "-g", 8], "does not divide the checkpoint's current 4 KV heads")


def test_src_missing_or_not_a_checkpoint(capsys, tmp_path):
    fails(capsys, tmp_path, [tmp_path / "nowhere", "-g", 2], "does not exist")
    (tmp_path / "empty").mkdir()
    fails(capsys, tmp_path, [tmp_path / "empty", "-g", 2], "config.json is missing")
    (tmp_path / "file.txt").write_text("x")
    fails(capsys, tmp_path, [tmp_path / "file.txt", "-g", 2], "not a checkpoint folder")


def test_folder_without_weights(capsys, tmp_path, mha):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((mha / "config.json").read_text())
    fails(capsys, tmp_path, [src, "-g", 2], "holds no weights")


def test_config_without_attention_heads(capsys, tmp_path, mha):
    src = copy_of(mha, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    del config["num_attention_heads"]
    (src / "config.json").write_text(json.dumps(config))
    fails(capsys, tmp_path, [src, "-g", 2], "no num_attention_heads")


def test_unsupported_model_type_lists_supported(capsys, tmp_path, mha):
    src = copy_of(mha, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(config))
    err = fails(capsys, tmp_path, [src, "-g", 2], "unsupported model_type 'gpt2'")
    assert all(name in err for name in LAYOUTS)


def test_missing_shard(capsys, tmp_path, sharded):
    src = copy_of(sharded, tmp_path / "src")
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    fails(capsys, tmp_path, [src, "-g", 2], f"shard {victim.name} named in the index is missing")


def test_truncated_safetensors(capsys, tmp_path, sharded):
    src = copy_of(sharded, tmp_path / "src")
    victim = sorted(src.glob("model-*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    fails(capsys, tmp_path, [src, "-g", 2], "truncated")


@pytest.mark.parametrize("garbage", [b"", b"\x01\x02", b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"])
def test_corrupt_safetensors(capsys, tmp_path, mha, garbage):
    src = copy_of(mha, tmp_path / "src")
    (src / "model.safetensors").write_bytes(garbage)
    fails(capsys, tmp_path, [src, "-g", 2], "model.safetensors")


def test_index_names_missing_tensor(capsys, tmp_path, sharded):
    src = copy_of(sharded, tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.self_attn.ghost.weight"] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    fails(capsys, tmp_path, [src, "-g", 2], "the index names 'model.layers.0.self_attn.ghost.weight'")


def test_unknown_tensor_inside_kv_module(capsys, tmp_path, mha):
    src = copy_of(mha, tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight_scale"] = torch.ones(1)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    fails(capsys, tmp_path, [src, "-g", 2], "unknown tensor model.layers.1.self_attn.k_proj.weight_scale")


def test_out_exists_is_kept(capsys, tmp_path, mha):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    fails.kept = out
    try:
        fails(capsys, tmp_path, [mha, "-g", 2], "already exists; pass --overwrite", out=out)
    finally:
        fails.kept = None
    assert (out / "mine.txt").read_text() == "precious"


def test_pickle_needs_allow_pickle(capsys, tmp_path, mha):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((mha / "config.json").read_text())
    torch.save(load_file(mha / "model.safetensors"), src / "pytorch_model.bin")
    fails(capsys, tmp_path, [src, "-g", 2], "pass --allow-pickle")


def test_pickle_with_code_is_refused(capsys, tmp_path, mha):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((mha / "config.json").read_text())
    torch.save({"weights": load_file(mha / "model.safetensors"), "hook": print}, src / "pytorch_model.bin")
    fails(capsys, tmp_path, [src, "-g", 2, "--allow-pickle"], "weights-only pickle")


def test_unwritable_out_parent(capsys, tmp_path, mha):
    (tmp_path / "a-file").write_text("")
    fails(capsys, tmp_path, [mha, "-g", 2], "is not an existing directory", out=tmp_path / "a-file" / "out")
    fails(capsys, tmp_path, [mha, "-g", 2], "is not an existing directory", out=tmp_path / "missing" / "out")
    # /proc refuses new entries even to root, where chmod would not.
    capsys.readouterr()
    code = main(["convert", str(mha), "/proc/uptrain-out", "-g", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot write /proc/uptrain-out" in err


def test_console_script_exit_code_and_help(tmp_path):
    uptrain = Path(sys.executable).parent / "uptrain"
    done = subprocess.run([uptrain, "convert", "/nonexistent/src", tmp_path / "out", "-g", "2"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == "uptrain convert: error: /nonexistent/src does not exist"
    help_text = subprocess.run([uptrain, "convert", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--num-kv-heads", "--pooling", "--seed", "--dtype", "--max-shard-size", "--overwrite", "--allow-pickle"):
        assert flag in help_text


def test_hub_id_offline_says_so(capsys, tmp_path):
    # conftest sets HF_HUB_OFFLINE=1: an uncached Hub id must fail at once, naming the reason.
    err = fails(capsys, tmp_path, ["some-org/some-model", "-g", 2], "could not be fetched from the Hub")
    assert "HF_HUB_OFFLINE is set" in err
