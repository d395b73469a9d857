"""`uptrain train` with a multi-head latent attention checkpoint (`uptrain convert --target mla`,
DeepSeek-V2 layout) as its model: it loads, trains, and logs the latent's KV-cache bytes."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.train.train_helpers import records
from uptrain import UptrainError
from uptrain.convert import convert_checkpoint
from uptrain.train.config import TrainConfig
from uptrain.train.loop import run_training

RANK, ROPE = 12, 4  # the tiny Llama's heads are 8 × 8: 2 layers × 8 heads × 16 K/V elements in MHA


def test_train_an_mla_conversion_logs_the_latents_cache_bytes(assets, base_config, tmp_path):
    mla = convert_checkpoint(assets["mha"], tmp_path / "mla", target="mla", kv_rank=RANK, rope_dims=ROPE)
    config = TrainConfig(**{**base_config, "model": str(mla), "max_steps": 2, "eval_every": 2, "save_every": 2})
    final = run_training(config)
    recs = records(config.output_dir)
    assert [r["step"] for r in recs] == [0, 1, 2]
    # transformers caches each layer's normalised latent and its shared rotary key: 2 layers × float32.
    per_layer = json.loads((mla / "uptrain.json").read_text())["kv_elements_per_token_per_layer"]["mla"]
    assert per_layer == RANK + ROPE
    assert recs[0]["model/kv_cache_bytes_per_token"] == 2 * per_layer * 4
    # One cached vector per token and layer, read by every head: not the query heads' count.
    assert (recs[0]["model/num_kv_heads"], recs[0]["model/kv_lora_rank"], recs[0]["model/qk_rope_head_dim"]) == (
        1,
        RANK,
        ROPE,
    )
    assert recs[-1]["eval/loss"] < recs[0]["eval/loss"]  # it trains (from random weights here)
    saved = json.loads((final / "config.json").read_text())
    assert (saved["model_type"], saved["kv_lora_rank"], saved["qk_rope_head_dim"]) == ("deepseek_v2", RANK, ROPE)
    card = (final / "README.md").read_text()  # says what it is, not a GQA model nor an unconverted one
    assert "# Uptrained multi-head latent attention model" in card
    assert f"a latent of rank {RANK} and a shared rotary key of {ROPE} columns, from 8 KV heads" in card
    tags = yaml.safe_load(card.split("---\n")[1])["tags"]
    assert {"mla", "multi-head-latent-attention", "uptrained"} <= set(tags) and "gqa" not in tags, tags


def test_train_converts_its_source_to_mla_as_uptrain_convert_does(assets, base_config, tmp_path):
    keys = {"target": "mla", "kv_rank": RANK, "rope_dims": ROPE}
    run = {**base_config, "model": None, "source": str(assets["mha"]), "max_steps": 1, "eval_every": 1, **keys}
    final = run_training(TrainConfig(**run))
    converted = tmp_path / "run" / "converted"
    alone = convert_checkpoint(assets["mha"], tmp_path / "alone", **keys)
    for name in ("config.json", "model.safetensors"):  # the same conversion, byte for byte
        assert (converted / name).read_bytes() == (alone / name).read_bytes(), name
    assert records(tmp_path / "run")[0]["model/kv_cache_bytes_per_token"] == 2 * (RANK + ROPE) * 4
    assert "# Uptrained multi-head latent attention model" in (final / "README.md").read_text()


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"model": "m", "kv_rank": 8}, "`kv_rank` only applies with `source`"),
        ({"source": "s", "target": "mla"}, "--target mla needs one of --kv-rank R"),
        ({"source": "s", "target": "mla", "kv_rank": 8, "num_kv_heads": 2}, "--target mla takes --kv-rank"),
    ],
)
def test_mla_keys_are_refused_where_they_do_not_apply(base_config, keys, message):
    values = {**base_config, "model": None, **keys}
    with pytest.raises(UptrainError, match=message):
        TrainConfig(**values).conversion_spec()


def test_a_source_the_latent_layout_cannot_take_is_refused_before_the_run_folder(base_config, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    run = {**base_config, "model": None, "source": str(tmp_path / "gpt2"), "target": "mla", "kv_rank": 8}
    with pytest.raises(UptrainError):
        run_training(TrainConfig(**run))
    assert not (tmp_path / "run").exists()


def test_a_calibrated_latent_calibrates_on_the_runs_training_text(base_config):
    run = {**base_config, "model": None, "source": "s", "target": "mla", "kv_rank": 8}
    svd = TrainConfig(**run).conversion_spec()
    calibrated = TrainConfig(**run, mla_init="calibrated", rotary_key="calibrated").conversion_spec()
    assert svd.calibration_data is None  # the weight-space SVD reads no data (convert refuses it any)
    assert (calibrated.calibration_data, calibrated.calibration_seq_len) == (run["train_data"], run["seq_len"])
    assert (calibrated.mla_init, calibrated.rotary_key, calibrated.kv_rank) == ("calibrated", "calibrated", 8)
    rotary = TrainConfig(**run, rope_dims=6, rope_stride=2, rope_residual=1).conversion_spec()
    assert (rotary.rope_dims, rotary.rope_stride, rotary.rope_residual) == (6, 2, 1)
