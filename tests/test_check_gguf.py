"""scripts/check_gguf.py's route into llama.cpp's GGUF converter: which pre-tokenizer it names for
a tokenizer the converter does not know, which folder the converter reads for a per-layer
output, and (where the script's cache holds llama.cpp, skipped otherwise: CI has none) that the
converter writes each layer's KV heads of uptrain's per-layer outputs into the GGUF.

The full check (llama.cpp built, greedy tokens against transformers, the KV cache) is the script
itself: tens of minutes the first time, not a test (docs/results/serving.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from uptrain.architecture.converted import native_per_layer_config
from uptrain.modeling.modeling_decilm import DeciLMConfig, DeciLMForCausalLM

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "uptrain" / "assets" / "reference"
SPEC = importlib.util.spec_from_file_location("check_gguf", REPO / "scripts" / "check_gguf.py")
check_gguf = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_gguf)

CACHE = Path(os.environ.get("UPTRAIN_GGUF_CACHE", Path.home() / ".cache" / "uptrain-gguf"))
CONVERTERS = sorted(CACHE.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))


def test_a_byte_level_regex_tokenizer_is_named_gpt2_and_nothing_else_is():
    spec = json.loads((REFERENCE / "tokenizer.json").read_text())
    assert check_gguf.pre_tokenizer_name(spec) == "gpt-2"
    assert check_gguf.pre_tokenizer_name({**spec, "normalizer": {"type": "NFC"}}) is None
    no_regex = {**spec["pre_tokenizer"], "use_regex": False}
    assert check_gguf.pre_tokenizer_name({**spec, "pre_tokenizer": no_regex}) is None
    metaspace = {"type": "Metaspace", "replacement": "▁"}
    assert check_gguf.pre_tokenizer_name({**spec, "pre_tokenizer": metaspace}) is None


def per_layer_folder(folder: Path, kv_heads: tuple[int, ...], intermediate: int, vocab: int = 128) -> Path:
    """A tiny per-layer Llama in the DeciLM layout (what `uptrain convert --kv-heads-per-layer`
    writes), with the reference's tokenizer files."""
    source = dict(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=len(kv_heads),
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    DeciLMForCausalLM(DeciLMConfig.from_dict(native_per_layer_config(source, kv_heads))).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REFERENCE / name, folder / name)
    return folder


def test_the_converter_reads_block_configs_where_ffn_mult_reaches_the_width(tmp_path):
    folder = per_layer_folder(tmp_path / "m", (4, 2), intermediate=256)  # ffn_mult 6.0 of 64
    assert check_gguf.gguf_source(folder) == folder
    assert not (tmp_path / "m.gguf-view").exists()


def test_the_converter_reads_a_view_without_block_configs_where_no_ffn_mult_does(tmp_path):
    folder = per_layer_folder(tmp_path / "m", (4, 2), intermediate=192)
    config = json.loads((folder / "config.json").read_text())
    assert [b["ffn"].get("intermediate_size") for b in config["block_configs"]] == [192, 192]
    view = check_gguf.gguf_source(folder)
    assert view == tmp_path / "m.gguf-view"
    seen = json.loads((view / "config.json").read_text())
    assert seen == {k: v for k, v in config.items() if k != "block_configs"}
    assert seen["num_key_value_heads_per_layer"] == [4, 2] and seen["intermediate_size"] == 192
    others = sorted(p.name for p in folder.iterdir() if p.name != "config.json")
    assert sorted(p.name for p in view.iterdir() if p.name != "config.json") == others
    assert all((view / name).resolve() == (folder / name).resolve() for name in others)
    assert json.loads((folder / "config.json").read_text()) == config  # the checkpoint is untouched


def test_a_plain_llama_is_read_as_it_is():
    assert check_gguf.gguf_source(REFERENCE) == REFERENCE


GGUF_FIELDS = """
import json, sys
import gguf
reader = gguf.GGUFReader(sys.argv[1])
arch = reader.fields["general.architecture"].contents()
fields = {k.removeprefix(arch + "."): reader.fields[k].contents() for k in reader.fields
          if k.startswith(arch + ".") and ("head_count" in k or "feed_forward" in k)}
shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
print(json.dumps({"arch": arch, "pre": reader.fields["tokenizer.ggml.pre"].contents(), **fields, "shapes": shapes}))
"""


@pytest.mark.skipif(not CONVERTERS, reason=f"llama.cpp's converter is not in {CACHE}: run scripts/check_gguf.py")
@pytest.mark.parametrize("intermediate", [256, 192], ids=["ffn_mult", "intermediate_size"])
def test_llama_cpps_converter_writes_each_layers_kv_heads(tmp_path, intermediate):
    llama_cpp = CONVERTERS[-1].parent
    site = CACHE / "site"
    folder = per_layer_folder(tmp_path / "m", (4, 1), intermediate, vocab=8192)
    gguf = tmp_path / "m.gguf"
    check_gguf.convert_to_gguf(check_gguf.gguf_source(folder), gguf, llama_cpp, site)
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    shown = subprocess.run([sys.executable, "-c", GGUF_FIELDS, str(gguf)], capture_output=True, text=True, env=env)
    assert shown.returncode == 0, shown.stderr[-2000:]
    fields = json.loads(shown.stdout)
    assert fields["arch"] == "deci" and fields["pre"] == "gpt-2"
    assert fields["attention.head_count_kv"] == [4, 1]
    width = fields["feed_forward_length"]
    assert (width if isinstance(width, list) else [width] * 2) == [intermediate] * 2
    # GGUF shapes are (columns, rows): each layer's K and V have that layer's heads · 16 rows.
    for layer, heads in enumerate((4, 1)):
        for part in ("attn_k", "attn_v"):
            assert fields["shapes"][f"blk.{layer}.{part}.weight"] == [64, heads * 16]
