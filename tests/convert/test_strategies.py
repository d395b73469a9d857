"""The strategy registry's two kinds and the one conversion both entry points run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.convert.test_calibrated import build, save
from tests.convert.tiny_models import build_model
from tests.modeling.classic_models import build as build_classic
from uptrain.convert import convert_checkpoint, convert_model, prepare
from uptrain.convert import pooling as registry
from uptrain.convert.calibration import collect_attention_moments
from uptrain.convert.in_memory import converted_tensors
from uptrain.convert.pipeline import Calibration
from uptrain.convert.spec import CalibrationSettings, conversion_spec


class KeepFirstHead(registry.WholeLayerStrategy):
    """A whole-layer strategy written as a user would add one: each group keeps its first KV
    head, from the whole layer, with no statistics — what row pooling's `first` computes."""

    name = "first-of-layer"
    reference = "test: the first head of each group, from the whole layer"
    needs_calibration = False
    folds_into_queries = False

    def solve(self, attention, groups, moment):
        return None

    def apply(self, attention, groups, solution):
        d, r = attention.head_dim, attention.num_kv_heads // groups

        def first(t):
            return None if t is None else t.view(groups, r, d, *t.shape[1:])[:, 0].reshape(groups * d, *t.shape[1:])

        kv = {f: first(getattr(attention, f)) for f in ("k_w", "k_b", "v_w", "v_b")}
        return replace(attention, **kv, num_kv_heads=groups)


def test_every_registered_strategy_is_of_one_kind():
    for name, strategy in registry.STRATEGIES.items():
        assert isinstance(strategy, (registry.RowPooling, registry.WholeLayerStrategy)), name
        assert strategy.name == name
    assert [n for n, s in registry.STRATEGIES.items() if s.merges_layers] == ["calibrated"]
    calibrated = registry.get_strategy("calibrated")
    assert calibrated.needs_calibration and calibrated.folds_into_queries
    assert not any(registry.get_strategy(n).needs_calibration for n in ("mean", "first", "random"))


def test_a_whole_layer_strategy_class_runs_through_both_entry_points(monkeypatch, tmp_path):
    """Registered as a class, a whole-layer strategy needs no change in any caller: the plan
    reads whole layers, the merger applies it, provenance names it; its exact result equals
    row pooling's `first`, on disk and in memory."""
    monkeypatch.setitem(registry.STRATEGIES, KeepFirstHead.name, KeepFirstHead())
    model = build_model("llama")  # attention biases: rewritten by the merge too
    model.save_pretrained(tmp_path / "src")
    rows = convert_checkpoint(tmp_path / "src", tmp_path / "rows", 2, pooling="first", progress=False)
    layers = convert_checkpoint(tmp_path / "src", tmp_path / "layers", 2, pooling=KeepFirstHead.name, progress=False)
    with prepare(conversion_spec(source=str(tmp_path / "src"), num_kv_heads=2, pooling=KeepFirstHead.name)) as p:
        kinds = {t.out.name: t.kind for t in p.plan.tensors}
    assert kinds["model.layers.0.self_attn.k_proj.bias"] == "layer"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "layer"
    on_disk = load_file(layers / "model.safetensors")
    assert on_disk.keys() == load_file(rows / "model.safetensors").keys()
    for name, tensor in load_file(rows / "model.safetensors").items():
        assert torch.equal(on_disk[name], tensor), name
    assert json.loads((layers / "uptrain.json").read_text())["pooling"] == KeepFirstHead.name
    # A strategy that writes no card text of its own gets the one every whole-layer merge shares.
    assert f"`{KeepFirstHead.name}` merge ({KeepFirstHead.reference})" in (layers / "README.md").read_text()
    in_memory = convert_model(model, 2, pooling=KeepFirstHead.name).state_dict()
    for name, tensor in on_disk.items():
        assert torch.equal(in_memory[name], tensor), name


# Fused Q|K|V tensors, pooled per layer: phi3's weight; BLOOM's weight and bias.
SOURCES = {"phi3": (lambda: build_model("phi3"), 2), "bloom": (lambda: build_classic("bloom"), 4)}


@pytest.mark.parametrize("name", SOURCES)
def test_checkpoint_and_model_follow_one_plan(name, tmp_path):
    """`prepare` and `convert_model` derive the same plan (every tensor's name, dtype, shape,
    kind and sources) from a checkpoint and from the model it was saved from (file order and
    state-dict order aside; a state dict also holds the tied weights a checkpoint leaves out)."""
    build_source, pooled = SOURCES[name]
    model = build_source()
    model.save_pretrained(tmp_path / "src")
    _, in_memory = converted_tensors(model, 2)
    with prepare(conversion_spec(source=str(tmp_path / "src"), num_kv_heads=2)) as prepared:
        on_disk = {t.out.name: t for t in prepared.plan.tensors}
        from_model = {t.out.name: t for t in in_memory.tensors}
        assert prepared.plan.config_kv_heads == in_memory.config_kv_heads
    assert {name: from_model[name] for name in on_disk} == on_disk
    assert all(from_model[name].kind == "copy" for name in from_model.keys() - on_disk.keys())
    assert sum(t.kind == "fused" for t in on_disk.values()) == pooled


@pytest.mark.parametrize(("pooling", "grouping"), [("calibrated", "contiguous"), ("mean", "similarity")])
def test_in_memory_whole_layer_merges_equal_the_checkpoint(pooling, grouping, tokenizer, calibration_text, tmp_path):
    model = build("llama", tokenizer)
    src = save(model, tokenizer, tmp_path / "src")
    moments, info = collect_attention_moments(
        src,
        str(calibration_text),
        CalibrationSettings(calibration_tokens=512, calibration_seq_len=64, calibration_device="cpu"),
    )
    calibration = Calibration(moments, info)
    out = convert_checkpoint(
        src, tmp_path / "out", 2, pooling=pooling, grouping=grouping, calibration=calibration, progress=False
    )
    converted = convert_model(model, 2, pooling=pooling, grouping=grouping, calibration=calibration)
    in_memory = converted.state_dict()
    for name, tensor in load_file(out / "model.safetensors").items():
        assert torch.equal(in_memory[name], tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7, 11, 4, 2]])
    with torch.no_grad():
        assert torch.equal(converted.eval()(ids).logits, loaded(ids).logits)
