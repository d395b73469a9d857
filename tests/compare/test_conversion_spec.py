"""`uptrain compare` converts each run as `uptrain train` converts its `source`: one mapping
from the training keys to the conversion's (`train.config.training_conversion`), so that
calibration reads the text the runs train on, as they read it."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from uptrain.compare.spec import CompareSpec
from uptrain.convert.spec import DEFAULT_VALUE_FIT_BLEND, ConversionSpec
from uptrain.options import keys_of
from uptrain.train.config import TrainConfig

# Every key of a run that can decide how its conversion calibrates, with a value other than its default.
TRAINED = dict(
    train_data=["a.jsonl", "b.jsonl"],
    dataset_config="sample-10BT",
    train_split="held-out",
    seq_len=64,
    text_field="body",
    sample_by="line",
    language="fr",
    speech_task="translate",
    source_lang="deu_Latn",
    target_lang="fra_Latn",
    objective="pairs",
    seed=7,
    grouping="similarity",
    attention="encoder,cross",
    calibration_tokens=1000,
    calibration_device="cpu",
    calibration_dtype="bfloat16",
    calibration_weighting="attention",
    value_fit="output",
    value_fit_blend=0.5,
    source_hash="sha256",
)
# ConversionSpec keys `uptrain convert` alone sets (train and compare convert with their defaults),
# and those each run sets itself.
# The MLA keys: `uptrain train`'s `source` takes them too (tests/train/test_mla_model.py), and
# `uptrain compare` sets them per MLA run (its --target mla runs: tests/compare/test_mla.py).
CONVERT_ONLY = {
    *("dtype", "max_shard_size", "allow_pickle", "target", "kv_rank", "rope_dims", "rotary_key", "mla_init"),
    *("rope_stride", "rope_residual"),
}
PER_RUN = {
    *("source", "num_kv_heads", "kv_heads_per_layer", "kv_budget", "allocation", "allocation_cost", "cross_kv_weight"),
    "pooling",
}


def both(values: dict, tmp_path) -> tuple[ConversionSpec, ConversionSpec]:
    """The conversion `uptrain train` and `uptrain compare` make of the same keys."""
    train = TrainConfig(
        source="src",
        num_kv_heads=2,
        pooling="calibrated",
        eval_data="eval.jsonl",
        output_dir=str(tmp_path / "run"),
        # compare's defaults of the keys train requires
        **{"train_data": "train.jsonl", "seq_len": 256, "batch_size": 8, "lr": 1e-3, "max_steps": 3, **values},
    )
    compare = CompareSpec(
        model="src", num_kv_heads=[2], pooling=["calibrated"], output_dir=str(tmp_path / "cmp"), max_steps=3, **values
    )
    return train.conversion_spec(), compare.conversion_spec(2, "calibrated")


@settings(max_examples=40, deadline=None)
@given(chosen=st.sets(st.sampled_from(sorted(TRAINED))))
def test_train_and_compare_convert_alike(chosen, tmp_path_factory):
    values = {key: TRAINED[key] for key in chosen}
    if "train_data" not in values:
        values["train_data"] = "train.jsonl"  # compare's default is the shipped corpus, train has none
    if "value_fit_blend" in values:
        values["value_fit"] = TRAINED["value_fit"]  # the blend weighs within the output fit: refused alone
    from_train, from_compare = both(values, tmp_path_factory.mktemp("runs"))
    assert from_train == from_compare


def test_every_calibration_key_comes_from_the_run(tmp_path):
    """With every run key off its default, no key of the conversion is left at its own default:
    none is forgotten by the mapping (text_field, sample_by, dataset_config and train_split were)."""
    from_train, from_compare = both(TRAINED, tmp_path)
    assert from_train == from_compare
    defaults = {key.name: key.default for key in keys_of(ConversionSpec)}
    for field in dataclasses.fields(ConversionSpec):
        if field.name not in CONVERT_ONLY | PER_RUN:
            assert getattr(from_compare, field.name) != defaults[field.name], field.name


def test_train_carries_each_way_of_choosing_the_kv_heads(tmp_path):
    """`uptrain train`'s `source` converts with the KV heads its keys choose, each way as `uptrain convert`."""
    keys = {"train_data": "train.jsonl", "seq_len": 256, "batch_size": 8, "lr": 1e-3, "max_steps": 3}
    common = dict(source="src", eval_data="eval.jsonl", output_dir=str(tmp_path / "run"), **keys)
    for chosen in (
        {"num_kv_heads": 2},
        {"kv_heads_per_layer": "4,2"},
        {"kv_budget": 0.25},
        {"kv_budget": 0.25, "allocation": "calibrated"},
        {"kv_budget": 0.25, "allocation": "calibrated", "allocation_cost": "merge"},
        {"kv_budget": 0.25, "allocation": "calibrated", "cross_kv_weight": 37.5},
    ):
        spec = TrainConfig(**common, **chosen).conversion_spec()
        keys = ("num_kv_heads", "kv_heads_per_layer", "kv_budget", "allocation", "allocation_cost", "cross_kv_weight")
        default = dict.fromkeys(keys) | {"allocation": "uniform"}
        assert {k: getattr(spec, k) for k in keys} == default | chosen


def test_mla_runs_convert_without_the_gqa_merges_keys(tmp_path):
    """`--target gqa mla` with the calibrated merge's keys: the GQA runs take them, the MLA runs
    (which `uptrain convert --target mla` refuses them for) convert at their defaults."""
    keys = {"calibration_weighting": "attention", "value_fit": "output", "value_fit_blend": 0.5}
    spec = CompareSpec(
        model="src",
        kv_budget=[0.25],
        target=["gqa", "mla"],
        pooling=["calibrated"],
        output_dir=str(tmp_path / "cmp"),
        max_steps=3,
        train_data="train.jsonl",
        grouping="similarity",
        **keys,
    )
    gqa = spec.budget_conversion_spec(0.25, "uniform", "calibrated")
    assert {k: getattr(gqa, k) for k in keys} == keys and gqa.grouping == "similarity"
    defaults = {"calibration_weighting": "uniform", "value_fit": "inputs", "value_fit_blend": DEFAULT_VALUE_FIT_BLEND}
    for init in ("svd", "calibrated"):
        latent = spec.latent_conversion_spec(0.25, init)
        assert latent.target == "mla" and {k: getattr(latent, k) for k in keys} == defaults
        assert latent.grouping == "contiguous"
