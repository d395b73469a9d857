"""Similarity grouping on encoder–decoders: each attention (encoder, decoder self-, cross-)
renumbers its heads per layer, from its own input's moment (cross-attention's K and V read the
encoder's output) or in weight space, and records its order per attention. UMT5's per-layer
relative position bias moves with its layer's query heads; T5's, computed once and shared by
every layer of a stack, cannot, and is refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.convert.test_calibrated_encoder_decoder import ALL, KV, build, calibration_batches, head_dim, load, logits
from uptrain import UptrainError
from uptrain.architecture import architecture
from uptrain.convert import convert_checkpoint, convert_model
from uptrain.convert.calibration_seq2seq import seq2seq_moments
from uptrain.convert.pipeline import Calibration

G = 2


def interleave_identical_heads(model, groups: int) -> None:
    """In every attention, K/V heads s and s + groups (weights and biases) are made identical:
    the groups similarity finds are {j, j + groups, …}, not contiguous ones."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if KV.search(name) is None:
                continue
            d = head_dim(model, name)
            heads = p.data.view(p.shape[0] // d, d, *p.shape[1:])
            for s in range(groups, heads.shape[0]):
                heads[s] = heads[s % groups]


def moments_of(model, name: str) -> Calibration:
    return Calibration(
        seq2seq_moments(model, architecture(model.config.model_type), calibration_batches(name), progress=False)
    )


def similarity(src, out, g: int, calibration: Calibration | None, attention: str = ALL):
    return convert_checkpoint(
        src, out, g, grouping="similarity", attention=attention, calibration=calibration, progress=False
    )


def expected_order(heads: int, groups: int) -> list[int]:
    return [s for j in range(groups) for s in range(j, heads, groups)]


@pytest.mark.parametrize("calibrated", [False, True], ids=["weight-space", "calibrated"])
@pytest.mark.parametrize("name", ["bart", "whisper", "umt5"])
def test_identical_heads_in_similarity_groups_pool_losslessly(name, calibrated, tmp_path):
    model = build(name)
    interleave_identical_heads(model, G)
    model.save_pretrained(tmp_path / "src")
    out = similarity(tmp_path / "src", tmp_path / "out", G, moments_of(model, name) if calibrated else None)
    torch.testing.assert_close(logits(load(out, name), name), logits(model, name), rtol=1e-5, atol=1e-5)
    record = json.loads((out / "uptrain.json").read_text())
    assert record["grouping"] == "similarity"
    for attention, site in record["attentions"].items():
        order = expected_order(site["source_num_key_value_heads"], G)
        assert site["kv_head_order"] == {str(i): order for i in range(site["num_layers"])}, attention
        assert site["kv_groups"]["0"] == [order[: len(order) // G], order[len(order) // G :]]
    assert record["kv_head_order"] == record["attentions"]["decoder-self"]["kv_head_order"]
    assert record["kv_groups"] == record["attentions"]["decoder-self"]["kv_groups"]
    card = (out / "README.md").read_text()
    assert "renumbered" in card and "`attentions.cross.kv_groups`" in card


@pytest.mark.parametrize("name", ["bart", "umt5"])
def test_similarity_at_g_equals_h_reproduces_logits(name, tmp_path):
    model = build(name)
    model.save_pretrained(tmp_path / "src")
    out = similarity(tmp_path / "src", tmp_path / "out", 8, moments_of(model, name), attention="decoder-self,cross")
    torch.testing.assert_close(logits(load(out, name), name), logits(model, name), rtol=1e-5, atol=1e-5)


def test_umt5_position_bias_moves_with_its_layers_query_heads(tmp_path):
    """Each UMT5 self-attention layer's relative_attention_bias columns follow that layer's renumbered heads."""
    from safetensors.torch import load_file

    model = build("umt5")
    interleave_identical_heads(model, G)
    model.save_pretrained(tmp_path / "src")
    out = similarity(tmp_path / "src", tmp_path / "out", G, None)
    before, after = load_file(tmp_path / "src" / "model.safetensors"), load_file(out / "model.safetensors")
    order = expected_order(8, G)
    biases = [n for n in before if n.endswith("relative_attention_bias.weight")]
    assert len(biases) == 5  # every self-attention layer: 2 encoder, 3 decoder
    for n in biases:
        assert torch.equal(after[n], before[n][:, order]), n


def test_t5_cross_attention_alone_may_be_renumbered(tmp_path):
    """T5's cross-attention has no position bias: its heads renumber per layer, exactly."""
    model = build("t5")
    interleave_identical_heads(model, G)
    model.save_pretrained(tmp_path / "src")
    out = similarity(tmp_path / "src", tmp_path / "out", G, None, attention="cross")
    torch.testing.assert_close(logits(load(out, "t5"), "t5"), logits(model, "t5"), rtol=1e-5, atol=1e-5)
    record = json.loads((out / "uptrain.json").read_text())
    assert record["attentions"]["cross"]["kv_head_order"]["0"] == expected_order(8, G)
    assert "kv_head_order" not in record and "kv_head_order" not in record["attentions"]["decoder-self"]


@pytest.mark.parametrize("attention", ["decoder-self,cross", "encoder"])
def test_t5_shared_position_bias_is_refused_in_one_line(attention, tmp_path):
    build("t5").save_pretrained(tmp_path / "src")
    with pytest.raises(UptrainError) as err:
        similarity(tmp_path / "src", tmp_path / "out", G, None, attention=attention)
    message = str(err.value)
    assert "\n" not in message
    assert re.search(
        r"cannot renumber the heads of T5's (decoder|encoder) self-attention: its relative_attention_bias", message
    )
    assert "serves every layer" in message
    assert not (tmp_path / "out").exists()


def test_in_memory_similarity_equals_the_checkpoint(tmp_path):
    from safetensors.torch import load_file

    model = build("umt5")
    interleave_identical_heads(model, G)
    model.save_pretrained(tmp_path / "src")
    calibration = moments_of(model, "umt5")
    out = similarity(tmp_path / "src", tmp_path / "out", G, calibration)
    in_memory = convert_model(model, G, grouping="similarity", attention=ALL, calibration=calibration).state_dict()
    for tensor_name, tensor in load_file(out / "model.safetensors").items():
        assert torch.equal(in_memory[tensor_name], tensor), tensor_name


def _cross_layer(model, layer: int):
    from uptrain.convert.calibrated import LayerAttention

    attn = model.model.decoder.layers[layer].encoder_attn
    heads, d = attn.num_heads, attn.head_dim

    def f64(t):
        return t.detach().double()

    return LayerAttention(
        *(f64(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)),
        *(f64(m.bias) for m in (attn.q_proj, attn.k_proj, attn.v_proj)),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d,
        rotary_dim=0,
    )


def test_cross_attention_heads_are_compared_under_the_encoder_output(tmp_path):
    """With calibration, cross-attention's K/V heads are compared under the moment of what they
    read, the encoder's output — not the decoder states its queries read."""
    from uptrain.convert.calibrated import head_similarity, similarity_order

    model = build("bart")
    model.save_pretrained(tmp_path / "src")
    calibration = moments_of(model, "bart")
    g = 4  # pairs of heads: in this model the pairs differ between the two moments, in every layer
    out = similarity(tmp_path / "src", tmp_path / "out", g, calibration, attention="cross")
    recorded = json.loads((out / "uptrain.json").read_text())["attentions"]["cross"]["kv_head_order"]
    encoder_output = calibration.moments["cross.keys_values"].double()
    assert len(recorded) == model.config.decoder_layers
    for i, order in recorded.items():
        layer = _cross_layer(model, int(i))
        decoder_states = calibration.moments[f"cross.{i}"].double()  # what the layer's queries read
        assert order == similarity_order(head_similarity(layer, encoder_output), g)
        assert order != similarity_order(head_similarity(layer, decoder_states), g)


def test_the_records_shared_bias_is_the_modelings():
    """`position_bias_shared`, which decides the refusal, says what the GQA modeling does."""
    from uptrain.modeling.modeling_t5_gqa import T5GQAAttention
    from uptrain.modeling.modeling_umt5_gqa import UMT5GQAAttention

    for model_type, attention_class in (("t5", T5GQAAttention), ("mt5", T5GQAAttention), ("umt5", UMT5GQAAttention)):
        assert architecture(model_type).position_bias_shared == (not attention_class.bias_in_every_layer), model_type
    assert not any(architecture(t).position_bias_shared for t in ("bart", "whisper", "llama", "gpt2"))
