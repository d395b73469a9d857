"""Bad input: one line on stderr, exit code 2, and no OUT (or temporary sibling) left behind."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.convert.tiny_models import build_model, save
from tests.robustness.opened_files import files_opened
from uptrain.architecture import supported_model_types
from uptrain.cli import main


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


@pytest.mark.parametrize(
    "g,expected",
    [
        (3, "does not divide the model's 8 attention heads"),
        (0, "must be at least 1"),
        (-2, "must be at least 1"),
        (16, "exceeds the model's 8 attention heads"),
    ],
)
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
    config["model_type"] = "bert"
    (src / "config.json").write_text(json.dumps(config))
    err = fails(capsys, tmp_path, [src, "-g", 2], "unsupported model_type 'bert'")
    assert all(name in err for name in supported_model_types())


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


@pytest.mark.parametrize(
    "garbage", [b"", b"\x01\x02", b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"]
)
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
    done = subprocess.run(
        [uptrain, "convert", "/nonexistent/src", tmp_path / "out", "-g", "2"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip() == "uptrain convert: error: /nonexistent/src does not exist"
    help_text = subprocess.run([uptrain, "convert", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in (
        "--num-kv-heads",
        "--pooling",
        "--seed",
        "--dtype",
        "--max-shard-size",
        "--overwrite",
        "--allow-pickle",
    ):
        assert flag in help_text


def test_hub_id_offline_says_so(capsys, tmp_path):
    # conftest sets HF_HUB_OFFLINE=1: an uncached Hub id must fail at once, naming the reason.
    err = fails(capsys, tmp_path, ["some-org/some-model", "-g", 2], "could not be fetched from the Hub")
    assert "HF_HUB_OFFLINE is set" in err


# Hostile input (issue #12): every case one line, exit 2, nothing written; the source untouched.


def one_line_error(capsys, argv: list, expected: str) -> str:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    return err


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: equal trees mean nothing was touched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def raw_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: dict | bytes, data: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_out_overlapping_src_is_refused_whatever_the_flags(capsys, tmp_path, mha):
    src = copy_of(mha, tmp_path / "src")
    before = tree(tmp_path)
    for out in (src, src / "inside", tmp_path):  # equal, inside, holding it
        one_line_error(capsys, ["convert", src, out, "-g", 2, "--overwrite"], "overlaps the source checkpoint")
        one_line_error(
            capsys,
            ["convert", src, out, "-g", 2],
            "already exists" if out.exists() else "overlaps the source checkpoint",
        )
    assert tree(tmp_path) == before
    assert not (src / "inside").exists()


def test_out_that_is_a_file_is_kept(capsys, tmp_path, mha):
    out = tmp_path / "out"
    out.write_text("precious")
    for flags in ([], ["--overwrite"]):
        one_line_error(capsys, ["convert", mha, out, "-g", 2, *flags], str(out))
    assert out.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    link = tmp_path / "link"
    link.symlink_to(mha)
    one_line_error(capsys, ["convert", mha, link, "-g", 2, "--overwrite"], "is a symbolic link")
    assert link.resolve() == mha.resolve() and (mha / "config.json").is_file()


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--max-shard-size", "0"], "less than one byte"),
        (["--max-shard-size", "0GB"], "less than one byte"),
        (["--calibration-tokens", "0"], "calibration_tokens"),
        (["--calibration-tokens", "-5"], "calibration_tokens"),
    ],
)
def test_sizes_below_one_are_refused(capsys, tmp_path, mha, flags, expected):
    fails(
        capsys,
        tmp_path,
        [mha, "-g", 2, "--pooling", "calibrated", "--calibration-data", mha / "config.json", *flags],
        expected,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda c: [c], "holds a JSON list, not an object"),
        (lambda c: {**c, "model_type": ["llama"]}, "model_type is ['llama'], not a name"),
        (lambda c: {**c, "num_key_value_heads": "8"}, "num_key_value_heads is '8'; it must be a whole number"),
        (lambda c: {**c, "num_key_value_heads": -8}, "num_key_value_heads is -8"),
        (lambda c: {**c, "head_dim": "x"}, "head_dim is 'x'"),
        (lambda c: {**c, "num_hidden_layers": 0}, "num_hidden_layers is 0"),
        (lambda c: {**c, "hidden_size": 0}, "hidden_size is 0"),
        (lambda c: {**c, "num_attention_heads": True}, "num_attention_heads is True"),
        (lambda c: {**c, "rope_parameters": [10000.0]}, "rope_parameters is [10000.0], not a mapping"),
        (
            lambda c: {**c, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": "half"}},
            "partial_rotary_factor is 'half'",
        ),
        (lambda c: {**c, "initializer_range": "small"}, "initializer_range is 'small'"),
    ],
)
def test_hostile_config(capsys, tmp_path, mha, edit, expected):
    src = copy_of(mha, tmp_path / "src")
    (src / "config.json").write_text(json.dumps(edit(json.loads((mha / "config.json").read_text()))))
    fails(capsys, tmp_path, [src, "-g", 2], expected)
    capsys.readouterr()
    assert main(["inspect", str(src)]) == 2


def test_config_not_json(capsys, tmp_path, mha):
    src = copy_of(mha, tmp_path / "src")
    (src / "config.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    fails(capsys, tmp_path, [src, "-g", 2], "nested too deeply")
    (src / "config.json").write_bytes(b"\xff\xfe{")
    fails(capsys, tmp_path, [src, "-g", 2], "config.json is not valid JSON")


def hostile_header(mha: Path, src: Path, edit) -> None:
    header, data = raw_header(mha / "model.safetensors")
    write_raw(src / "model.safetensors", edit(header), data)


K0, V0 = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda h: b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (
            lambda h: {
                **h,
                K0: {**h[K0], "data_offsets": [-8, h[K0]["data_offsets"][1] - h[K0]["data_offsets"][0] - 8]},
            },
            f"corrupt safetensors entry for '{K0}'",
        ),
        (lambda h: {**h, "__metadata__": ["pt"]}, "__metadata__ must map strings to strings"),
        (lambda h: {**h, "__metadata__": {"format": 1}}, "__metadata__ must map strings to strings"),
        (lambda h: {**h, K0: {**h[K0], "dtype": "F7"}}, f"corrupt safetensors entry for '{K0}'"),
        (lambda h: {**h, K0: {**h[K0], "shape": [64.0, 64]}}, f"corrupt safetensors entry for '{K0}'"),
        (lambda h: {**h, K0: {**h[K0], "shape": [1e999, 64]}}, f"corrupt safetensors entry for '{K0}'"),
        (lambda h: {**h, K0: [1, 2, 3]}, f"corrupt safetensors entry for '{K0}'"),
        (lambda h: {**h, V0: {**h[V0], "data_offsets": h[K0]["data_offsets"]}}, "share bytes"),
        (
            lambda h: json.dumps(h)[:-1].encode() + b', "' + K0.encode() + b'": ' + json.dumps(h[K0]).encode() + b"}",
            f"the key '{K0}' appears twice",
        ),
    ],
)
def test_hostile_safetensors_header(capsys, tmp_path, mha, edit, expected):
    src = copy_of(mha, tmp_path / "src")
    hostile_header(mha, src, edit)
    fails(capsys, tmp_path, [src, "-g", 2], expected)


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda wm, outside: list(wm), "weight_map must map tensor names to shard files"),
        (lambda wm, outside: {k: 1 for k in wm}, "weight_map must map tensor names to shard files"),
        (lambda wm, outside: {**wm, K0: str(outside)}, "is not a file inside"),
        (lambda wm, outside: {**wm, K0: "../outside.safetensors"}, "is not a file inside"),
        (lambda wm, outside: {**wm, K0: "sub/../../outside.safetensors"}, "is not a file inside"),
    ],
)
def test_hostile_index_reads_nothing_outside_src(capsys, tmp_path, sharded, edit, expected):
    src = copy_of(sharded, tmp_path / "src")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((src / sorted(p.name for p in src.glob("model-*.safetensors"))[0]).read_bytes())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = edit(index["weight_map"], outside)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with files_opened() as opened:
        fails(capsys, tmp_path, [src, "-g", 2], expected)
    assert any(f.path.parent == src for f in opened)  # the recording works: it saw the source being read
    assert not [f for f in opened if f.path == outside]


def test_every_safetensors_dtype_is_known_and_copied_byte_for_byte(tmp_path, mha):
    """U32, U64, F8_E8M0, C64, F4, F6… (issue #10): valid files, copied exactly, header and bytes."""
    from uptrain.checkpoint.reader import ST_DTYPES, dtype_bits, read_safetensors_header

    header, data = raw_header(mha / "model.safetensors")
    src = copy_of(mha, tmp_path / "src")
    extra = {}
    for i, code in enumerate(sorted(ST_DTYPES)):
        bits = dtype_bits(ST_DTYPES[code])
        shape = [2, 8]  # 16 elements: a whole number of bytes for 4- and 6-bit types too
        payload = bytes((i * 37 + j) % 256 for j in range(16 * bits // 8))
        extra[f"extra.{code.lower()}"] = (
            {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]},
            payload,
        )
        data += payload
    write_raw(src / "model.safetensors", {**header, **{k: v for k, (v, _) in extra.items()}}, data)
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "-g", "2"]) == 0
    _, converted = read_safetensors_header(out / "model.safetensors")
    by_name = {t.name: t for t in converted}
    raw = (out / "model.safetensors").read_bytes()
    header_out, _ = raw_header(out / "model.safetensors")
    for name, (entry, payload) in extra.items():
        t = by_name[name]
        assert raw[t.start : t.end] == payload, name
        assert header_out[name]["dtype"] == entry["dtype"] and header_out[name]["shape"] == entry["shape"]


def test_inspect_refuses_impossible_numbers(capsys, tmp_path, mha):
    one_line_error(capsys, ["inspect", mha, "--context", -1], "--context must be at least 1")
    one_line_error(capsys, ["inspect", mha, "--batch", 0], "--batch must be at least 1")
    src = copy_of(mha, tmp_path / "src")
    config = json.loads((mha / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_key_value_heads": -8}))
    one_line_error(capsys, ["inspect", src], "num_key_value_heads is -8")


def test_inspect_answers_at_once_for_huge_head_counts(capsys, tmp_path, mha):
    import time

    src = copy_of(mha, tmp_path / "src")
    config = json.loads((mha / "config.json").read_text())
    n = 10**12
    (src / "config.json").write_text(
        json.dumps({**config, "num_attention_heads": n, "num_key_value_heads": n, "hidden_size": n, "head_dim": None})
    )
    capsys.readouterr()
    t0 = time.perf_counter()
    assert main(["inspect", str(src), "--json"]) == 0
    elapsed = time.perf_counter() - t0
    info = json.loads(capsys.readouterr().out)
    assert len(info["options"]) == 13 * 13  # 10**12 = 2**12 · 5**12
    assert [o["num_kv_heads"] for o in info["options"]][:6] == [1, 2, 4, 5, 8, 10]
    assert elapsed < 0.5, elapsed
    # A prime near the limit: the slowest factorisation there is, still well under a second.
    p = 1_099_511_627_689  # the largest prime below 2**40
    (src / "config.json").write_text(
        json.dumps({**config, "num_attention_heads": p, "num_key_value_heads": p, "hidden_size": p, "head_dim": None})
    )
    t0 = time.perf_counter()
    assert main(["inspect", str(src), "--json"]) == 0
    assert [o["num_kv_heads"] for o in json.loads(capsys.readouterr().out)["options"]] == [1, p]
    assert time.perf_counter() - t0 < 0.5
    (src / "config.json").write_text(json.dumps({**config, "num_attention_heads": 2**41}))
    one_line_error(capsys, ["inspect", src], "num_attention_heads is 2199023255552")
