"""Generated checkpoints, valid and mutated: safetensors headers, shard indexes and config.json.

For every generated source, a conversion either is correct or stops with an UptrainError of
one line; never another exception, never a write outside the output's temporary sibling (and
its lock file), never a read outside the source folder. `uptrain inspect` on the same source
answers or refuses in one line. A decoy checkpoint file sits beside
the source for hostile indexes to point at.

A fixed seed (`derandomize`) and a few dozen examples per test by default; many more under
`-m slow`.
"""

from __future__ import annotations

import atexit
import copy
import json
import math
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.convert.tiny_models import build_model, save
from tests.robustness.opened_files import files_opened
from uptrain import UptrainError
from uptrain.checkpoint.reader import ST_DTYPES, dtype_bits
from uptrain.convert.pipeline import convert_checkpoint
from uptrain.inspect_checkpoint import inspect_checkpoint

FAST = settings(
    max_examples=30,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MANY = settings(FAST, max_examples=400)
KV_ROWS = ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")
G = 2

_BASE = Path(tempfile.mkdtemp(prefix="uptrain-generated-"))
atexit.register(shutil.rmtree, _BASE, ignore_errors=True)  # hypothesis runs examples outside pytest's tmp_path
SINGLE, SHARDED = _BASE / "single", _BASE / "sharded"


@pytest.fixture(scope="module", autouse=True)
def sources() -> None:
    """The tiny Llama the examples mutate, saved whole and in shards."""
    model = build_model("llama")
    save(model, SINGLE)
    save(model, SHARDED, max_shard_size="20KB")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 20)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def split_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join_file(header: dict | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@st.composite
def safetensors_files(draw) -> tuple[str, bytes]:
    """A model.safetensors: the tiny Llama's, plus extra tensors of every dtype, then maybe one
    mutation. Returns (the mutation's name, the file's bytes)."""
    header, data = split_file(SINGLE / "model.safetensors")
    for i in range(draw(st.integers(0, 3))):
        code = draw(st.sampled_from(sorted(ST_DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3)) + [8]  # 8 elements: whole bytes for F4, F6
        nbytes = math.prod(shape) * dtype_bits(ST_DTYPES[code]) // 8
        header[f"extra.t{i}"] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += draw(st.binary(min_size=nbytes, max_size=nbytes))
    kind = draw(
        st.sampled_from(
            ["valid", "field", "entry", "offsets", "overlap", "metadata", "top", "repeat", "truncate", "nested"]
        )
    )
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    if kind == "field":
        header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(json_values)
    elif kind == "entry":
        header[name] = draw(json_values)
    elif kind == "offsets":
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + draw(st.integers(-64, 64)), end + draw(st.integers(-64, 64))]
    elif kind == "overlap":
        other = draw(st.sampled_from(names))
        header[name] = copy.deepcopy(header[other])
    elif kind == "metadata":
        header["__metadata__"] = draw(json_values)
    elif kind == "top":
        return kind, join_file(json.dumps(draw(json_values)).encode(), data)
    elif kind == "repeat":
        raw = json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}}}"
        return kind, join_file(raw.encode(), data)
    elif kind == "truncate":
        whole = join_file(header, data)
        return kind, whole[: draw(st.integers(0, len(whole) - 1))]
    elif kind == "nested":
        depth = draw(st.integers(10, 100_000))
        return kind, join_file(b'{"a":' + b"[" * depth + b"]" * depth + b"}", data)
    return kind, join_file(header, data)


def shard_names() -> list[str]:
    return sorted(p.name for p in SHARDED.glob("model-*.safetensors"))


@st.composite
def index_files(draw) -> tuple[str, bytes]:
    """A model.safetensors.index.json for the sharded tiny Llama, valid or mutated; shard paths
    may point outside the folder (at the decoy), be absolute, empty, or not strings at all."""
    index = json.loads((SHARDED / "model.safetensors.index.json").read_text())
    kind = draw(st.sampled_from(["valid", "path", "path", "path", "value", "weight_map", "top", "drop", "add"]))
    weight_map = index["weight_map"]
    name = draw(st.sampled_from(sorted(weight_map)))
    if kind == "path":
        weight_map[name] = draw(
            st.sampled_from(
                [
                    "../decoy.safetensors",
                    "{decoy}",
                    "sub/../../decoy.safetensors",
                    "./../decoy.safetensors",
                    "",
                    ".",
                    "/",
                    "..",
                    "missing.safetensors",
                    "./" + weight_map[name],
                    draw(st.sampled_from(shard_names())),
                ]
            )
        )
    elif kind == "value":
        weight_map[name] = draw(json_values)
    elif kind == "weight_map":
        index["weight_map"] = draw(json_values)
    elif kind == "top":
        index = draw(json_values)
    elif kind == "drop":
        del weight_map[name]
    elif kind == "add":
        weight_map[draw(st.text(min_size=1, max_size=20))] = draw(st.sampled_from(shard_names()))
    return kind, json.dumps(index).encode()


CONFIG_KEYS = [
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "num_hidden_layers",
    "model_type",
    "rope_parameters",
    "rope_scaling",
    "partial_rotary_factor",
    "initializer_range",
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
    "max_position_embeddings",
    "attention_bias",
]


@st.composite
def config_files(draw) -> tuple[str, bytes]:
    """config.json of the tiny Llama with some keys set to other JSON values (numbers near the
    real ones most often), or replaced whole."""
    config = json.loads((SINGLE / "config.json").read_text())
    if draw(st.integers(0, 9)) == 0:
        return "top", json.dumps(draw(json_values)).encode()
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), max_size=3, unique=True)):
        config[key] = draw(st.integers(-2, 17) | json_values)
    return "keys", json.dumps(config).encode()


OUTCOMES: dict[str, int] = {}  # "kind: converted" / "kind: refused" → count, for a look at what was generated


def convert_generated(source: Path, replace: dict[str, bytes], kind: str = "") -> None:
    """Copy `source` with some files replaced, convert it, and check the outcome and every file
    the conversion opened."""
    root = Path(tempfile.mkdtemp(dir=_BASE))
    try:
        src, out = root / "src", root / "out"
        shutil.copytree(source, src)
        decoy = root / "decoy.safetensors"
        shutil.copyfile(SINGLE / "model.safetensors", decoy)
        for name, raw in replace.items():
            (src / name).write_bytes(raw.replace(b"{decoy}", str(decoy).encode()))
        weights = src / "model.safetensors"
        library_refuses = weights.exists() and not safetensors_library_accepts(weights)
        with files_opened() as opened:
            try:
                convert_checkpoint(src, out, G, progress=False, source_hash="none")
                error = None
            except UptrainError as err:
                error = str(err)
        for f in opened:
            if root not in f.path.parents:
                continue
            if f.writes:
                assert (
                    f.path.name == ".out.uptrain-lock"
                    or f.path.parent.name.startswith(".out.uptrain-tmp-")
                    or out in f.path.parents
                ), f"wrote {f.path}"
            else:
                assert src in f.path.parents or f.path.parent.name.startswith(".out.uptrain-tmp-"), f"read {f.path}"
        leftovers = sorted(p.name for p in root.iterdir() if p.name not in ("src", "out", "decoy.safetensors"))
        assert leftovers == [], leftovers
        try:  # `uptrain inspect` on the same source: a report or one line, never a traceback
            inspect_checkpoint(str(src), context=4096, batch=1)
        except UptrainError as err:
            assert "\n" not in str(err)
        outcome = f"{kind}: {'refused' if error else 'converted'}"
        OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
        assert error is not None or not library_refuses, "accepted a file the safetensors library refuses"
        if error is not None:
            assert error and "\n" not in error, error
            assert not out.exists()
        else:
            check_conversion(src, out)
    finally:
        shutil.rmtree(root)


def safetensors_library_accepts(path: Path) -> bool:
    """The reference reader's verdict on a file's header (transformers loads through it)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt"):
            return True
    except Exception:
        return False


def check_conversion(src: Path, out: Path) -> None:
    """Every tensor but K/V copied byte for byte with its dtype and shape; K/V pooled to G heads."""
    from uptrain.checkpoint.reader import SourceCheckpoint

    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == G
    source, result = SourceCheckpoint(src), SourceCheckpoint(out)
    try:
        assert source.tensors.keys() == result.tensors.keys()
        for name, a in source.tensors.items():
            b = result.tensors[name]
            if name.endswith(KV_ROWS):
                assert b.shape[0] * config["num_attention_heads"] == a.shape[0] * G
                continue
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
                fa.seek(a.start)
                fb.seek(b.start)
                assert fa.read(a.nbytes) == fb.read(b.nbytes), name
    finally:
        source.close()
        result.close()


@FAST
@given(safetensors_files())
def test_generated_safetensors_headers(case):
    kind, raw = case
    convert_generated(SINGLE, {"model.safetensors": raw}, "header " + kind)


@FAST
@given(index_files())
def test_generated_shard_indexes(case):
    kind, raw = case
    convert_generated(SHARDED, {"model.safetensors.index.json": raw}, "index " + kind)


@FAST
@given(config_files())
def test_generated_configs(case):
    kind, raw = case
    convert_generated(SINGLE, {"config.json": raw}, "config " + kind)


@pytest.mark.slow
@MANY
@given(safetensors_files(), index_files(), config_files())
def test_many_generated_checkpoints(header, index, config):
    convert_generated(SINGLE, {"model.safetensors": header[1], "config.json": config[1]})
    convert_generated(SHARDED, {"model.safetensors.index.json": index[1]})
