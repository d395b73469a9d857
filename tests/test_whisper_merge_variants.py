"""scripts/whisper_merge_variants.py's `output` refit on a tiny random Whisper: exact where the merge
is exact (heads identical within groups), its moments the attention-pooled inputs transformers'
own attention probabilities give, and each head's map the by-hand least squares."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import whisper_merge_variants as variants  # noqa: E402

HEADS, DIM = 8, 8


def tiny_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=96,
        d_model=HEADS * DIM,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=30,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
        attn_implementation="eager",
    )
    model = WhisperForConditionalGeneration(config).eval()
    batches, encoded = [], []
    for _ in range(3):  # 4 clips of 30 frames, targets of 6–12 tokens (the rest padding)
        labels = torch.randint(3, 96, (4, 12))
        for row, length in enumerate((12, 9, 7, 6)):
            labels[row, length:] = -100
        batches.append({"labels": labels})
        with torch.inference_mode():
            encoded.append(model.get_encoder()(torch.randn(4, 8, 60)))
    return model, batches, encoded


def logits(model, batches, encoded):
    with torch.inference_mode():
        return torch.cat([model(encoder_outputs=e, labels=b["labels"]).logits for b, e in zip(batches, encoded)])


@pytest.mark.parametrize("variant", ["output", "sequential-output"])
def test_output_refit_exact_where_merge_is(variant):
    model, batches, encoded = tiny_whisper()
    with torch.no_grad():  # each pair of heads shares its keys and values: G = 4 merges exactly
        for layer in model.model.decoder.layers:
            for module in (layer.self_attn, layer.encoder_attn):
                for proj in (module.k_proj, module.v_proj):
                    w = proj.weight.view(HEADS // 2, 2, DIM, -1)
                    w[:, 1] = w[:, 0]
                module.v_proj.bias.view(HEADS // 2, 2, DIM)[:, 1] = module.v_proj.bias.view(HEADS // 2, 2, DIM)[:, 0]
    merged = variants.variant_model(model, 4, variant, batches, encoded, blend=0.1)
    assert not torch.equal(
        merged.model.decoder.layers[0].encoder_attn.v_proj.weight,
        model.model.decoder.layers[0].encoder_attn.v_proj.weight,
    )
    torch.testing.assert_close(logits(merged, batches, encoded), logits(model, batches, encoded), atol=2e-4, rtol=0)


def test_output_moments_and_maps_by_hand():
    """The variant's moments (uptrain's `--value-fit output` pass, projected into each group's value
    span) are those of transformers' own attention probabilities, and each head's refit map is the
    by-hand least squares fit."""
    from uptrain.convert.calibrated import _augment, apply_calibrated
    from uptrain.convert.value_refit import RefitTarget, refit_solution

    model, batches, encoded = tiny_whisper()
    target = ("cross", 1)
    found = variants.collect(model, [target], batches, encoded)[target]
    layer, solution = variants.solve(variants.attention_module(model, *target), 2, found, "uniform")
    merged = apply_calibrated(layer, 2, solution)
    refit_target = RefitTarget(layer, merged, 2)
    moments = variants.collect_outputs(model, {target: refit_target}, batches, encoded)[target]
    # By hand: the attention transformers computes with the merged queries and keys of this one
    # module (everything before it MHA), and MHA's own, pooling the encoder's states.
    keyed = copy.deepcopy(model)
    module = variants.attention_module(keyed, *target)
    with torch.no_grad():
        module.q_proj.weight.copy_(merged.q_w)
        module.q_proj.bias.copy_(merged.q_b)
        module.k_proj.weight.copy_(variants.repeated(merged.k_w, 2, HEADS))
    rows, rows_merged = [], []
    with torch.inference_mode():
        for batch, outputs in zip(batches, encoded):
            x = outputs.last_hidden_state.to(torch.float64)
            x = torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1)  # x̃ = [x, 1], by hand
            valid = batch["labels"] != -100
            for source, kept in ((model, rows), (keyed, rows_merged)):
                p = source(encoder_outputs=outputs, labels=batch["labels"], output_attentions=True).cross_attentions[1]
                pooled = p.to(torch.float64) @ x[:, None]  # [b, h, t, D+1]
                kept += [pooled[i][:, valid[i]] for i in range(len(valid))]
    z, z_merged = torch.cat(rows, 1), torch.cat(rows_merged, 1)  # [h, n, D+1]
    assert moments.count == z.shape[1]
    source_v = _augment(layer.v_w, layer.v_b)
    for h in range(HEADS):
        a, v = refit_target.value_inputs[h // (HEADS // 2)], source_v[h * DIM : (h + 1) * DIM]
        torch.testing.assert_close(moments.merged[h], a @ z_merged[h].mT @ z_merged[h] @ a.mT, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(moments.cross[h], v @ z[h].mT @ z_merged[h] @ a.mT, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(z, z_merged, atol=1e-3)  # the merged keys move the attention
    # Each head's map, given the refit's shared values V', is the least squares fit of V_h z by M_h V' z'.
    refit = apply_calibrated(layer, 2, refit_solution(layer, 2, solution, moments, found.get("uniform"), blend=0.0))
    shared = _augment(refit.v_w, refit.v_b)
    for h in range(HEADS):
        group = h // (HEADS // 2)
        read = z_merged[h] @ shared[group * DIM : (group + 1) * DIM].mT  # [n, d]
        wanted = z[h] @ source_v[h * DIM : (h + 1) * DIM].mT
        by_hand = torch.linalg.lstsq(read, wanted).solution.mT  # M_h
        o = layer.o_w[:, h * DIM : (h + 1) * DIM]
        torch.testing.assert_close(refit.o_w[:, h * DIM : (h + 1) * DIM], o @ by_hand, rtol=1e-4, atol=1e-6)
