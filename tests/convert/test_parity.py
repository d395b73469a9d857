"""Conversion is linear algebra on weights: test it exactly against transformers' forward."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.convert.tiny_models import ARCHITECTURES, HEADS, build_model, logits, make_heads_identical, save
from uptrain.convert import convert_checkpoint
from uptrain.speed import output_cache


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def state(folder):
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_identity_at_g_equals_h(model_type, tmp_path):
    """G = h: same tensors bit for bit, same logits bit for bit."""
    model = build_model(model_type)
    src = save(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", num_kv_heads=HEADS, progress=False)
    before, after = state(src), state(out)
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert torch.equal(logits(load(out)), logits(model))


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_identical_heads_convert_losslessly(model_type, num_kv_heads, tmp_path):
    """Heads that are equal within each group pool to themselves for mean and first."""
    model = build_model(model_type)
    make_heads_identical(model, num_kv_heads)
    src = save(model, tmp_path / "src")
    reference = logits(model)
    for pooling in ("mean", "first"):
        out = convert_checkpoint(src, tmp_path / pooling, num_kv_heads, pooling=pooling, progress=False)
        converted = load(out)
        assert converted.config.num_key_value_heads == num_kv_heads
        torch.testing.assert_close(logits(converted), reference, rtol=1e-5, atol=1e-5)
    # random re-initialises K/V: it must not be lossless, or the test above proves nothing.
    out = convert_checkpoint(src, tmp_path / "random", num_kv_heads, pooling="random", progress=False)
    assert not torch.allclose(logits(load(out)), reference, atol=1e-3)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_loads_generates_and_caches_g_heads(model_type, tmp_path):
    src = save(build_model(model_type), tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)
    assert len(cache.layers) == model.config.num_hidden_layers
    for layer in cache.layers:
        assert layer.keys.shape[1] == 2 and layer.values.shape[1] == 2


def _head_means(weight: torch.Tensor, head_dim: int, groups: list[list[int]]) -> torch.Tensor:
    rows = []
    for group in groups:
        total = sum(weight[i * head_dim : (i + 1) * head_dim].double() for i in group)
        rows.append(total / len(group))
    return torch.cat(rows).to(weight.dtype)


@pytest.mark.parametrize("source_kv_heads,num_kv_heads", [(8, 2), (8, 4), (4, 2), (4, 1)])
def test_mean_pooling_matches_independent_group_means(source_kv_heads, num_kv_heads, tmp_path):
    model = build_model("qwen2", num_kv_heads=source_kv_heads)  # qwen2: K/V biases are pooled too
    src = save(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", num_kv_heads, progress=False)
    before, after = state(src), state(out)
    r = source_kv_heads // num_kv_heads
    groups = [list(range(j * r, (j + 1) * r)) for j in range(num_kv_heads)]
    for layer in range(2):
        for part in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            name = f"model.layers.{layer}.self_attn.{part}"
            torch.testing.assert_close(after[name], _head_means(before[name], 8, groups), rtol=1e-6, atol=1e-7)
        for untouched in ("q_proj.weight", "q_proj.bias", "o_proj.weight"):
            name = f"model.layers.{layer}.self_attn.{untouched}"
            assert torch.equal(after[name], before[name])
    provenance = json.loads((out / "uptrain.json").read_text())
    assert provenance["kv_groups"] == groups
    assert provenance["query_to_kv"] == [i // (8 // num_kv_heads) for i in range(8)]


def test_grouping_is_contiguous(tmp_path):
    """Head i filled with the value i: group j must average heads j·r … (j+1)·r − 1, exactly."""
    model = build_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for i in range(HEADS):
                    proj.weight[i * 8 : (i + 1) * 8] = float(i)
    src = save(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    k = state(out)["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(k[:8], torch.full((8, 64), 1.5))  # mean of heads 0..3
    assert torch.equal(k[8:], torch.full((8, 64), 5.5))  # mean of heads 4..7
    out = convert_checkpoint(src, tmp_path / "first", 2, pooling="first", progress=False)
    v = state(out)["model.layers.1.self_attn.v_proj.weight"]
    assert torch.equal(v[:8], torch.zeros(8, 64)) and torch.equal(v[8:], torch.full((8, 64), 4.0))


def test_random_is_seeded_and_scaled(tmp_path):
    src = save(build_model("llama"), tmp_path / "src")
    a = state(convert_checkpoint(src, tmp_path / "a", 2, pooling="random", seed=3, progress=False))
    b = state(convert_checkpoint(src, tmp_path / "b", 2, pooling="random", seed=3, progress=False))
    c = state(convert_checkpoint(src, tmp_path / "c", 2, pooling="random", seed=4, progress=False))
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert abs(a[name].std().item() - 0.02) < 0.004  # the config's initializer_range
    assert torch.equal(a["model.layers.0.self_attn.k_proj.bias"], torch.zeros(16))
