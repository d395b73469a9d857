"""`convert_model` converts a model in memory exactly as `uptrain convert` converts its checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.convert.tiny_models import ARCHITECTURES, build_model
from tests.modeling.classic_models import ARCHITECTURES as CLASSIC
from tests.modeling.classic_models import build as build_classic
from uptrain import UptrainError
from uptrain.convert import convert_checkpoint, convert_model

TOKENS = torch.tensor([[1, 5, 9, 3, 7, 11, 4, 2]])


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@pytest.mark.parametrize("pooling", ["mean", "random"])
def test_in_memory_equals_checkpoint_conversion(model_type, pooling, tmp_path):
    model = build_model(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 2, pooling=pooling, progress=False)
    converted = convert_model(model, 2, pooling=pooling)

    assert converted.config.num_key_value_heads == 2 and model.config.num_key_value_heads == 8
    on_disk = load_file(out / "model.safetensors")
    in_memory = converted.state_dict()
    assert set(on_disk) <= set(in_memory)
    for name, tensor in on_disk.items():
        assert torch.equal(in_memory[name], tensor), name
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # source untouched
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(converted.eval()(TOKENS).logits, loaded(TOKENS).logits)


def test_in_memory_identity_and_refusals():
    model = build_model("llama")
    with torch.no_grad():
        assert torch.equal(convert_model(model, 8)(TOKENS).logits, model(TOKENS).logits)
    with pytest.raises(UptrainError, match="does not divide"):
        convert_model(model, 3)
    with pytest.raises(UptrainError, match="needs calibration statistics"):
        convert_model(model, 2, pooling="calibrated")
    with pytest.raises(UptrainError, match="unknown pooling"):
        convert_model(model, 2, pooling="median")


@pytest.mark.parametrize("model_type", CLASSIC)
def test_in_memory_classic_architectures_equal_checkpoint_conversion(model_type, tmp_path):
    model = build_classic(model_type)
    model.save_pretrained(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 2, progress=False)
    converted = convert_model(model, 2).eval()
    assert converted.config.model_type == f"{model_type}_gqa" and converted.config.num_key_value_heads == 2
    in_memory = converted.state_dict()
    for name, tensor in load_file(out / "model.safetensors").items():
        if name in in_memory:  # old checkpoints also carry buffers the GQA classes do not (GPT-2's attn.bias)
            assert torch.equal(in_memory[name], tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(converted(TOKENS).logits, loaded(TOKENS).logits)
