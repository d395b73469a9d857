"""The architecture registry: one record per model_type, converted `*_gqa` types found by one
function, one-line refusal of an unknown model_type, and records that agree with the files."""

from __future__ import annotations

import re

import pytest

from uptrain import UptrainError
from uptrain.architecture import (
    ATTENTIONS,
    DECODER_SELF,
    architecture,
    auto_class_name,
    converted_architectures,
    find_architecture,
    modeling_of,
    source_model_type,
    supported_model_types,
)
from uptrain.architecture.converted import MODELING_DIR, modeling_files


def test_converted_types_read_as_their_source():
    assert source_model_type("gpt2_gqa") == "gpt2"
    assert source_model_type("t5_gqa") == "t5"  # mt5 converts to t5_gqa too: t5 is its source
    assert source_model_type("llama") == "llama"
    assert source_model_type("nope_gqa") == "nope_gqa"
    assert architecture("bloom_gqa") is architecture("bloom")
    assert find_architecture("nope") is None and find_architecture(None) is None


def test_an_unknown_model_type_is_one_line():
    with pytest.raises(UptrainError) as err:
        architecture("nope")
    message = str(err.value)
    assert "\n" not in message and message.startswith("unsupported model_type 'nope'; supported: ")
    assert all(t in message for t in ("llama", "gpt2_gqa", "whisper_gqa", "mt5"))
    assert message.endswith(", ".join(supported_model_types()))


def test_every_record_is_consistent():
    for model_type in supported_model_types():
        record = architecture(model_type)
        assert record.attentions[0] in ATTENTIONS and DECODER_SELF in record.attentions
        assert record.attentions == tuple(a for a in ATTENTIONS if a in record.attentions)  # model order
        assert len(record.sites) in (1, 3)
        # The modeling a checkpoint of this type is written with: a source's `*_gqa`, or the
        # converted type's own (nemotron-nas: the per-layer layout of llama).
        modeling = modeling_of(model_type) or record.modeling
        if modeling is not None:
            assert (MODELING_DIR / f"{modeling.module}.py").is_file()
            siblings = {f"{m}.py" for m in modeling.siblings}
            assert set(modeling_files(model_type)) == {f"{modeling.module}.py", "attention.py", *siblings}
            assert all(path.is_file() for path in modeling_files(model_type).values())
        else:
            assert modeling_files(model_type) == {}
        if record.modeling is not None:
            assert record.modeling.model_type == f"{source_model_type(record.modeling.model_type)}_gqa"
        # A family transformers reads with one num_key_value_heads says how a per-layer output of it
        # is written (a layout uptrain models) or why it is refused.
        assert record.modeling is not None or bool(record.per_layer_modeling) != bool(record.per_layer_refusal)
    # Every modeling file on disk is some record's, and every converted type some record's
    # modeling (mT5 shares T5's): a new family adds a record and a file, and edits no list here.
    records = [architecture(t) for t in supported_model_types()]
    with_modeling = [m for r in records for m in (r.modeling, r.per_layer_modeling) if m is not None]
    assert {m.module for m in with_modeling} == {p.stem for p in MODELING_DIR.glob("modeling_*.py")}
    assert set(converted_architectures()) == {m.model_type for m in with_modeling}
    assert all(modeling_of(t).model_type == t for t in converted_architectures())
    assert source_model_type("nemotron-nas") == "llama"


def test_one_auto_class_per_config():
    assert auto_class_name({"model_type": "whisper"}) == "AutoModelForSpeechSeq2Seq"
    assert auto_class_name({"model_type": "whisper_gqa"}) == "AutoModelForSpeechSeq2Seq"
    assert auto_class_name({"model_type": "mt5"}) == "AutoModelForSeq2SeqLM"
    assert auto_class_name({"model_type": "gpt2_gqa"}) == "AutoModelForCausalLM"
    assert auto_class_name({"model_type": "unknown", "is_encoder_decoder": True}) == "AutoModelForSeq2SeqLM"
    assert auto_class_name({"model_type": "unknown"}) == "AutoModelForCausalLM"


def test_one_record_per_model_type():
    from uptrain.architecture import REGISTRY
    from uptrain.architecture.decoders import DECODERS
    from uptrain.architecture.encoder_decoders import ENCODER_DECODERS

    assert len(REGISTRY) == len(DECODERS) + len(ENCODER_DECODERS)  # none overwrites another
    assert not set(REGISTRY) & set(converted_architectures())


def test_a_decoder_with_config_names_of_its_own():
    """A decoder-only record may read its geometry under its own names (MPT: n_layers, n_heads,
    d_model), and a converted config records its KV heads where that site says."""
    from uptrain.architecture import StackKeys
    from uptrain.architecture.decoders import decoder_only

    record = decoder_only("mine", "Mine", geometry=StackKeys("n_layers", "n_heads", "num_key_value_heads"))
    geometry = record.stacks({"model_type": "mine", "n_layers": 2, "n_heads": 8, "d_model": 64})[DECODER_SELF].geometry
    assert (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (2, 8, 8, 8)


def test_gpt_neo_reads_its_own_config_names():
    """GPT-Neo's config.json spells the geometry num_layers and num_heads (no num_attention_heads):
    its record reads them, and its converted config keeps them with G under num_key_value_heads."""
    from uptrain.architecture import config_geometry
    from uptrain.architecture.converted import gqa_config

    source = {"model_type": "gpt_neo", "num_layers": 3, "num_heads": 8, "hidden_size": 64, "head_dim": 4}
    converted = gqa_config(source, 2)
    assert converted["model_type"] == "gpt_neo_gqa" and converted["num_key_value_heads"] == 2
    assert {k: converted[k] for k in ("num_layers", "num_heads", "hidden_size")} == dict(
        num_layers=3, num_heads=8, hidden_size=64
    )
    for config, kv in ((source, 8), (converted, 2)):
        geometry = config_geometry(config)  # head_dim is hidden_size // num_heads: GPT-Neo reads no head_dim
        assert (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (3, 8, kv, 8)


def test_mpt_reads_its_own_config_names():
    """MPT's geometry is n_layers, n_heads, d_model (no standard names added to its config), and
    its converted config's KV heads under num_key_value_heads."""
    config = {"model_type": "mpt_gqa", "n_layers": 2, "n_heads": 8, "d_model": 64, "num_key_value_heads": 2}
    geometry = architecture("mpt_gqa").stacks(config)[DECODER_SELF].geometry
    assert (geometry.num_layers, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (2, 8, 2, 8)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"attn_config": {"qk_ln": True}}, "mpt with attn_config.qk_ln: True cannot be converted (transformers' MPT"),
        ({"attn_config": {"attn_type": "grouped_query_attention"}}, "attn_config.attn_type: 'grouped_query_attention'"),
        ({"attn_config": None, "no_bias": False}, "no_bias: False cannot be converted"),  # nested absent: defaults
    ],
)
def test_a_refused_setting_is_one_line_where_the_geometry_is_read(config, message):
    base = {"model_type": "mpt", "n_layers": 2, "n_heads": 8, "d_model": 64}
    with pytest.raises(UptrainError, match=re.escape(message)) as err:
        architecture("mpt").stacks({**base, **config})
    assert "\n" not in str(err.value)
    architecture("mpt").stacks({**base, "attn_config": {"alibi": True, "qk_ln": False}, "no_bias": True})


def test_a_refused_setting_absent_reads_as_its_default():
    """FalconConfig's multi_query defaults to true: a config without it has one KV head."""
    base = {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64}
    with pytest.raises(UptrainError, match="falcon with multi_query: True cannot be converted"):
        architecture("falcon").stacks(base)
    architecture("falcon").stacks({**base, "multi_query": False})


def test_alibi_may_depend_on_a_config_key():
    """BLOOM always has ALiBi from its padding mask; Falcon where `alibi` is true (absent: not);
    MPT's ALiBi takes the document mask, and llama has none."""
    assert architecture("bloom").has_alibi({}) and architecture("bloom_gqa").has_alibi({"alibi": False})
    assert architecture("falcon").has_alibi({"alibi": True}) and architecture("falcon_gqa").has_alibi({"alibi": True})
    assert not architecture("falcon").has_alibi({"alibi": False}) and not architecture("falcon").has_alibi({})
    assert not architecture("mpt").has_alibi({}) and not architecture("llama").has_alibi({"alibi": True})


def test_key_aliases_are_transformers_own():
    """Each record's key_aliases are its config class's attribute_map (the names transformers
    reads as the record's keys), so that a config setting both apart is refused (issue #34)."""
    from transformers import CONFIG_MAPPING

    import uptrain.modeling  # noqa: F401  registers the *_gqa config classes

    for model_type in supported_model_types():
        aliases = architecture(model_type).aliases_in({"model_type": model_type})
        assert dict(aliases) == CONFIG_MAPPING[model_type].attribute_map, model_type


@pytest.mark.parametrize(
    "config, alias",
    [
        (
            {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "num_attention_heads": 2},
            "num_attention_heads",
        ),
        (
            {"model_type": "gpt_neo", "num_layers": 2, "num_heads": 4, "hidden_size": 32, "num_hidden_layers": 3},
            "num_hidden_layers",
        ),
    ],
)
def test_an_alias_apart_from_its_key_is_one_line_where_the_geometry_is_read(config, alias):
    with pytest.raises(UptrainError, match=f"sets {alias}: "):
        architecture(config["model_type"]).stacks(config)
    agreeing = dict(config, **{alias: config[dict(architecture(config["model_type"]).key_aliases)[alias]]})
    architecture(config["model_type"]).stacks(agreeing)
