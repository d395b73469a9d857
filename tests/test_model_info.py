"""model_info's per-layer KV heads (#32's config contract): the reader, the geometry and its bytes."""

from __future__ import annotations

import pytest

from uptrain import UptrainError
from uptrain.model_info import attention_geometry, layer_kv_heads, per_layer_key, stack_geometry

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 64}


def test_per_layer_key_sits_beside_the_scalar():
    assert per_layer_key("num_key_value_heads") == "num_key_value_heads_per_layer"
    assert per_layer_key("cross_attention_num_key_value_heads") == "cross_attention_num_key_value_heads_per_layer"


def test_layer_kv_heads_reads_the_list_else_repeats_the_scalar_else_the_query_heads():
    listed = {**LLAMA, "num_key_value_heads": 8, "num_key_value_heads_per_layer": [8, 4, 4, 2]}
    assert layer_kv_heads(listed, "num_key_value_heads", 4, 8) == (8, 4, 4, 2)
    assert layer_kv_heads({**LLAMA, "num_key_value_heads": 2}, "num_key_value_heads", 4, 8) == (2, 2, 2, 2)
    assert layer_kv_heads(LLAMA, "num_key_value_heads", 4, 8) == (8, 8, 8, 8)  # no GQA: the query heads
    with pytest.raises(UptrainError, match="has no num_key_value_heads"):
        layer_kv_heads(LLAMA, "num_key_value_heads", 4)


def test_a_list_without_its_scalar_reads_as_the_modeling_reads_it():
    """The *_gqa configs take the scalar as the list's largest entry when only the list is given;
    uptrain's reader agrees (it neither falls back to the query heads nor refuses)."""
    alone = {**LLAMA, "num_key_value_heads_per_layer": [4, 2, 2, 1]}
    assert layer_kv_heads(alone, "num_key_value_heads", 4, 8) == (4, 2, 2, 1)
    assert attention_geometry(alone).num_kv_heads == 4


@pytest.mark.parametrize(
    "listed, message",
    [
        ([8, 4, 2], "must list 4 layers' KV heads"),
        ((8, 4, 4, 2), "must list 4 layers' KV heads"),  # a JSON list, not another shape
        ([8, 4, 0, 2], "holds 0, not a whole number of KV heads ≥ 1"),
        ([8, 4, True, 2], "holds True, not a whole number"),
        ([8, 4, 2.0, 2], "holds 2.0, not a whole number"),
        ([8, 4, 3, 2], "holds 3 KV heads, which do not divide 8 heads"),
        ([4, 4, 2, 2], "largest entry 4 is not num_key_value_heads 8"),
    ],
)
def test_layer_kv_heads_refuses_a_damaged_list_in_one_line(listed, message):
    config = {**LLAMA, "num_key_value_heads": 8, "num_key_value_heads_per_layer": listed}
    with pytest.raises(UptrainError, match=message) as caught:
        layer_kv_heads(config, "num_key_value_heads", 4, 8)
    assert "\n" not in str(caught.value)


def test_attention_geometry_sums_the_kv_cache_layer_by_layer():
    config = {**LLAMA, "num_key_value_heads": 8, "num_key_value_heads_per_layer": [8, 4, 4, 2]}
    geometry = attention_geometry(config)
    assert (geometry.num_kv_heads, geometry.kv_heads_per_layer, geometry.head_dim) == (8, (8, 4, 4, 2), 8)
    assert geometry.layer_kv_heads() == (8, 4, 4, 2)
    assert geometry.kv_cache_bytes_per_token(2) == 2 * (8 + 4 + 4 + 2) * 8 * 2
    assert geometry.kv_cache_bytes_per_token(2, num_kv_heads=1) == 2 * 4 * 1 * 8 * 2  # one G for every layer
    assert geometry.valid_num_kv_heads() == [1, 2]  # a single G must divide every layer's heads


def test_a_uniform_config_reads_as_today():
    geometry = attention_geometry({**LLAMA, "num_key_value_heads": 4})
    assert geometry.kv_heads_per_layer is None and geometry.layer_kv_heads() == (4, 4, 4, 4)
    assert geometry.kv_cache_bytes_per_token(4) == 2 * 4 * 4 * 8 * 4
    # A list whose layers all agree is uniform too: the geometry says so by None.
    same = {**LLAMA, "num_key_value_heads": 4, "num_key_value_heads_per_layer": [4, 4, 4, 4]}
    assert attention_geometry(same) == geometry


def test_stack_geometry_reads_each_attentions_own_list():
    config = {
        "model_type": "bart",
        "d_model": 32,
        "decoder_layers": 3,
        "decoder_attention_heads": 4,
        "cross_attention_num_key_value_heads": 4,
        "cross_attention_num_key_value_heads_per_layer": [1, 4, 2],
        "decoder_num_key_value_heads": 2,  # uniform self-attention beside a per-layer cross one
    }
    keys = dict(
        layers_key="decoder_layers", heads_key="decoder_attention_heads", head_dim_key=None, hidden_key="d_model"
    )
    cross = stack_geometry(config, kv_heads_key="cross_attention_num_key_value_heads", **keys)
    assert (cross.num_kv_heads, cross.kv_heads_per_layer) == (4, (1, 4, 2))
    assert cross.kv_cache_bytes_per_token(4) == 2 * (1 + 4 + 2) * 8 * 4
    decoder = stack_geometry(config, kv_heads_key="decoder_num_key_value_heads", **keys)
    assert (decoder.num_kv_heads, decoder.kv_heads_per_layer) == (2, None)
    with pytest.raises(UptrainError, match="must list 3 layers"):
        stack_geometry(
            {**config, "cross_attention_num_key_value_heads_per_layer": [4, 4]},
            kv_heads_key="cross_attention_num_key_value_heads",
            **keys,
        )
