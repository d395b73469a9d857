"""Layer-by-layer calibration against the whole-model reference, on every layout `calibrated` supports."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.convert.test_calibrated import CALIBRATED, build, save
from uptrain import UptrainError
from uptrain.convert import convert_checkpoint
from uptrain.convert.calibration import (
    SpilledMoments,
    attention_input,
    collect_attention_moments,
    fold_attention_input,
    load_calibration_tokenizer,
)
from uptrain.convert.pipeline import Calibration
from uptrain.convert.spec import CalibrationSettings, ConversionSpec

NUM_TOKENS, SEQ_LEN, BATCH = 640, 64, 4  # 10 blocks: the last batch is a short one


def on_cpu(tokens: int, **settings) -> CalibrationSettings:
    """Calibration over `tokens` tokens in blocks of SEQ_LEN, on the CPU."""
    return CalibrationSettings(
        calibration_tokens=tokens, calibration_seq_len=SEQ_LEN, calibration_device="cpu", **settings
    )


def test_calibration_settings_default_as_the_spec_keys_they_are_read_from():
    """A collector called without settings calibrates as `uptrain convert` does by default."""
    assert CalibrationSettings.of(ConversionSpec(source="src", num_kv_heads=2)) == CalibrationSettings()


def whole_model_moments(src, text, num_tokens=NUM_TOKENS, seq_len=SEQ_LEN, batch_size=BATCH) -> dict:
    """The reference (uptrain's first implementation): the whole model in float32, forward
    pre-hooks on every attention module, blocks read exactly as calibration reads them."""
    from transformers import AutoModelForCausalLM

    from uptrain.data.text import load_blocks

    blocks, _ = load_blocks(
        str(text),
        "calibration_data",
        load_calibration_tokenizer(src),
        seq_len,
        text_field="text",
        split="train",
        dataset_config=None,
        sample_by="paragraph",
        streaming=False,
        workers=None,
    )
    count = min(math.ceil(num_tokens / seq_len), len(blocks))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    layers = model.model.layers
    hidden = model.config.hidden_size
    moments = {i: torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64) for i in range(len(layers))}
    handles = [
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: fold_attention_input(moments[i], attention_input(args, kwargs)),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        for start in range(0, count, batch_size):
            model(blocks.take(list(range(start, min(start + batch_size, count)))), use_cache=False)
    for h in handles:
        h.remove()
    return {i: m / (count * seq_len) for i, m in moments.items()}


@pytest.mark.parametrize("model_type", CALIBRATED)
def test_layerwise_moments_equal_whole_model_and_convert_identically(model_type, tokenizer, calibration_text, tmp_path):
    src = save(build(model_type, tokenizer), tokenizer, tmp_path / "src")
    moments, info = collect_attention_moments(
        src, str(calibration_text), on_cpu(NUM_TOKENS), batch_size=BATCH, progress=False
    )
    reference = whole_model_moments(src, calibration_text)
    assert isinstance(moments, SpilledMoments) and sorted(moments) == sorted(reference) == [0, 1]
    assert info["tokens"] == 10 * SEQ_LEN
    for layer in reference:
        assert moments[layer].dtype == torch.float64
        torch.testing.assert_close(moments[layer], reference[layer], rtol=1e-12, atol=1e-12)
        assert moments[layer][-1, -1] == 1  # the constant input: E[1·1]
    outputs = []
    for name, stats in (("layerwise", moments), ("reference", reference)):
        out = convert_checkpoint(
            src, tmp_path / name, 2, pooling="calibrated", calibration=Calibration(stats, info), progress=False
        )
        outputs.append(load_file(out / "model.safetensors"))
    assert outputs[0].keys() == outputs[1].keys()
    assert all(torch.equal(outputs[0][k], outputs[1][k]) for k in outputs[0])


def test_layerwise_moments_in_bfloat16_stay_close(tokenizer, calibration_text, tmp_path):
    """A bf16 forward pass (for GPUs) changes the moments by bf16 rounding, not more."""
    src = save(build("llama", tokenizer), tokenizer, tmp_path / "src")
    full, _ = collect_attention_moments(src, str(calibration_text), on_cpu(256), progress=False)
    half, info = collect_attention_moments(
        src, str(calibration_text), on_cpu(256, calibration_dtype="bfloat16"), progress=False
    )
    assert info["dtype"] == "bfloat16" and half[0].dtype == torch.float64
    for layer in full:
        error = (half[layer] - full[layer]).norm() / full[layer].norm()
        assert 0 < error < 0.05, (layer, error)


def test_missing_layer_weight_is_one_line_error(tokenizer, calibration_text, tmp_path):
    """A checkpoint that lacks a tensor its config implies: refused by name, before any moment."""
    from safetensors.torch import save_file

    src = save(build("llama", tokenizer), tokenizer, tmp_path / "src")
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UptrainError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        collect_attention_moments(src, str(calibration_text), on_cpu(128), progress=False)


def test_spilled_moments_read_one_layer_at_a_time():
    moments = SpilledMoments()
    a, b = torch.randn(5, 5, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    moments.add(0, a)
    moments.add(1, b)
    assert len(moments) == 2 and list(moments) == [0, 1] and 2 not in moments
    assert torch.equal(moments[0], a) and torch.equal(moments[1], b)
    with pytest.raises(KeyError):
        moments[2]


def test_spilled_moments_leave_nothing_behind_a_kill(tmp_path):
    """The spill has no name in TMPDIR at any moment, so a SIGKILL leaves nothing to clean up."""
    code = (
        "import os, signal, torch; from uptrain.convert.calibration import SpilledMoments; m = SpilledMoments(); "
        "m.add(0, torch.ones(64, 64, dtype=torch.float64)); assert torch.equal(m[0], torch.ones(64, 64)); "
        "print(sorted(os.listdir(os.environ['TMPDIR'])), flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True
    )
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.strip() == "[]"  # nothing named while it ran
    assert list(tmp_path.iterdir()) == []  # nor after the kill


def test_progress_bars_for_calibration_and_merge(tokenizer, calibration_text, tmp_path, capsys):
    from contextlib import closing

    from uptrain.architecture import DECODER_SELF, architecture
    from uptrain.checkpoint.reader import SourceCheckpoint
    from uptrain.convert.layer_merge import LayerMerger
    from uptrain.convert.pooling import get_strategy
    from uptrain.model_info import attention_geometry, read_config

    src = save(build("llama", tokenizer), tokenizer, tmp_path / "src")
    capsys.readouterr()
    for progress in (False, True):
        moments, _ = collect_attention_moments(src, str(calibration_text), on_cpu(128), progress=progress)
        assert ("calibrate" in capsys.readouterr().err) == progress
    geometry = attention_geometry(read_config(src))
    for progress in (False, True):
        with closing(SourceCheckpoint(src)) as checkpoint:
            merger = LayerMerger(
                checkpoint,
                architecture("llama").site(DECODER_SELF).layout,
                geometry,
                2,
                get_strategy("mean"),
                "similarity",
                8,
                moments,
                seed=0,
                init_std=0.02,
                progress=progress,
            )
            for layer in range(geometry.num_layers):
                merger.tensor(layer, f"model.layers.{layer}.self_attn.k_proj.weight")
        err = capsys.readouterr().err
        assert ("merge" in err and "2/2" in err) == progress


def test_layers_with_different_masks_get_their_own(tokenizer, calibration_text, tmp_path):
    """Qwen2 with sliding-window attention from layer 1 on: each layer is called with its own
    mask, which the layer-by-layer path must record per layer, not once for all."""
    sliding = dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = build("qwen2", tokenizer, **sliding)
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    src = save(model, tokenizer, tmp_path / "src")
    moments, _ = collect_attention_moments(
        src, str(calibration_text), on_cpu(NUM_TOKENS), batch_size=BATCH, progress=False
    )
    reference = whole_model_moments(src, calibration_text)
    # The same weights with full attention everywhere: layer 2's input differs, so the masks matter.
    full = build("qwen2", tokenizer, **dict(sliding, use_sliding_window=False))
    full_moments = whole_model_moments(save(full, tokenizer, tmp_path / "full"), calibration_text)
    assert (full_moments[2] - reference[2]).abs().max() > 1e-3
    for layer in reference:
        torch.testing.assert_close(moments[layer], reference[layer], rtol=1e-12, atol=1e-12)


def test_streamed_calibration_data_reads_the_same_first_blocks(tokenizer, calibration_text):
    """A Hub dataset is streamed (never downloaded whole); its first blocks are those of the same
    text tokenized up front. Streaming a local file stands in for the Hub here."""
    from uptrain.convert.calibration import _first_blocks
    from uptrain.data.text import load_blocks

    common = dict(text_field="text", split="train", dataset_config=None, sample_by="paragraph", workers=None)
    local, _ = load_blocks(str(calibration_text), "calibration_data", tokenizer, 32, streaming=False, **common)
    streamed, _ = load_blocks(str(calibration_text), "calibration_data", tokenizer, 32, streaming=True, **common)
    assert len(local) > 5
    assert torch.equal(_first_blocks(streamed, 5), _first_blocks(local, 5))
    assert torch.equal(_first_blocks(streamed, 10**6), _first_blocks(local, 10**6))


@pytest.mark.parametrize("options", [dict(pooling="calibrated"), dict(grouping="similarity", pooling="mean")])
def test_merges_solved_during_calibration_equal_merges_from_kept_moments(
    options, tokenizer, calibration_text, tmp_path
):
    """`calibrate` solves each layer's merge as its moment completes and keeps no moment; the
    conversion is bit for bit the one made from the kept moments (compare's path)."""
    from uptrain.convert.pipeline import calibrate, execute, prepare
    from uptrain.convert.spec import conversion_spec

    src = save(build("phi", tokenizer), tokenizer, tmp_path / "src")  # partial rotary: both key paths
    spec = conversion_spec(
        source=str(src),
        num_kv_heads=2,
        calibration_data=str(calibration_text),
        calibration_tokens=NUM_TOKENS,
        calibration_seq_len=SEQ_LEN,
        calibration_device="cpu",
        **options,
    )
    outputs = []
    for keep in (False, True):
        with prepare(spec) as prepared:
            calibration = calibrate(prepared, progress=False, keep_moments=keep)
            if keep:
                assert isinstance(calibration.moments, SpilledMoments) and not calibration.solved
            else:
                assert dict(calibration.moments) == {} and sorted(calibration.solved) == [0, 1]
            out = execute(prepared, tmp_path / f"keep-{keep}", calibration=calibration, progress=False)
        outputs.append((load_file(out / "model.safetensors"), (out / "uptrain.json").read_text()))
    (solved, solved_card), (kept, kept_card) = outputs
    assert solved.keys() == kept.keys() and all(torch.equal(solved[k], kept[k]) for k in solved)
    order = json.loads(solved_card).get("kv_head_order")
    assert order == json.loads(kept_card).get("kv_head_order")


def test_per_layer_moments_are_handed_over_in_layer_order_and_not_kept(tokenizer, calibration_text, tmp_path):
    src = save(build("llama", tokenizer), tokenizer, tmp_path / "src")
    reference, _ = collect_attention_moments(src, str(calibration_text), on_cpu(256), progress=False)
    handed = []
    moments, info = collect_attention_moments(
        src, str(calibration_text), on_cpu(256), progress=False, per_layer=lambda layer, c: handed.append((layer, c))
    )
    assert len(moments) == 0 and info["tokens"] == 256
    assert [layer for layer, _ in handed] == [0, 1]
    assert all(c.dtype == torch.float64 and torch.equal(c, reference[layer]) for layer, c in handed)


def test_a_calibration_solved_for_one_conversion_is_refused_by_another(tokenizer, calibration_text, tmp_path):
    from uptrain.convert.pipeline import calibrate, execute, prepare
    from uptrain.convert.spec import conversion_spec

    src = save(build("llama", tokenizer), tokenizer, tmp_path / "src")
    common = dict(source=str(src), pooling="calibrated", calibration_data=str(calibration_text))
    common.update(calibration_tokens=128, calibration_seq_len=SEQ_LEN, calibration_device="cpu")
    with prepare(conversion_spec(num_kv_heads=2, **common)) as prepared:
        calibration = calibrate(prepared, progress=False)
    with prepare(conversion_spec(num_kv_heads=4, **common)) as other:
        with pytest.raises(UptrainError, match="solved for another conversion"):
            execute(other, tmp_path / "out", calibration=calibration, progress=False)
    assert not (tmp_path / "out").exists()
