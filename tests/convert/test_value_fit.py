"""`--value-fit output` (uptrain/convert/value_refit.py): the calibrated merge's values refit to each
head's attention output under the merged keys, from a second calibration pass. On a tiny real
Whisper calibrated from speech pairs: its projected moments and refit equal the full-moment
computation (transformers' own attention probabilities, the (D+1)² moments of the study script's
`refit_values`); exact where the merge is; its output error below the plain merge's; λ → ∞ the
plain merge's values; refusals in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.convert.test_calibrated_whisper import ALL, convert, logits, speech, whisper  # noqa: F401  (fixture)
from uptrain.cli import main
from uptrain.convert.calibrated import LayerAttention, _augment, _psd_sqrt, _value_inputs, apply_calibrated, regularised

G = 2


def calibrated(src: Path, data: Path, **options):
    """(the prepared conversion, its calibration, each refit target) of `src` to G KV heads in
    every attention, `--value-fit output` unless `options` say otherwise."""
    from uptrain.convert.pipeline import calibrate, prepare
    from uptrain.convert.spec import conversion_spec

    values = dict(pooling="calibrated", attention=ALL, calibration_data=str(data), language="en", value_fit="output")
    spec = conversion_spec(source=str(src), num_kv_heads=G, **values | options)
    prepared = prepare(spec)
    return prepared, calibrate(prepared, progress=False)


def source_layers(prepared) -> dict[tuple[str, int], LayerAttention]:
    merger = prepared.conversion.merger(prepared.checkpoint, None)
    return {(n, layer): m.attention(layer) for n, m in merger.mergers.items() for layer in range(m.geometry.num_layers)}


def head_paths(layer: LayerAttention) -> torch.Tensor:
    """Each query head's value path O_q V_s(q), weights and bias: [h, D, D+1] (what a merge's choice
    of basis inside a group leaves unchanged)."""
    d, v = layer.head_dim, _augment(layer.v_w, layer.v_b)
    return torch.stack(
        [
            layer.o_w[:, q * d : (q + 1) * d] @ v[(q // layer.n_rep) * d : (q // layer.n_rep + 1) * d]
            for q in range(layer.num_heads)
        ]
    )


def pooled_by_transformers(src: Path, data: Path, targets: dict) -> dict:
    """Per target: (z, z') [h, n, D+1], each head's attention-pooled inputs over the kept queries,
    from transformers' own (eager) attention probabilities: the source model's, and the source
    model with only that module's queries and keys replaced by the merged ones."""
    from transformers import WhisperForConditionalGeneration

    from uptrain.architecture import architecture
    from uptrain.convert.calibration_seq2seq import calibration_batches
    from uptrain.convert.spec import CalibrationSettings
    from uptrain.objectives.prompts import PromptKeys

    model = WhisperForConditionalGeneration.from_pretrained(src, attn_implementation="eager").eval()
    batches, _ = calibration_batches(
        src, architecture("whisper"), str(data), CalibrationSettings(), 4, PromptKeys("en")
    )
    found = {}
    for (name, layer), merged in targets.items():
        keyed = copy.deepcopy(model)
        paths = {"encoder": "model.encoder.layers.{}.self_attn", "decoder-self": "model.decoder.layers.{}.self_attn"}
        path = paths.get(name, "model.decoder.layers.{}.encoder_attn").format(layer)
        module = keyed.get_submodule(path)
        h = merged.num_heads
        with torch.no_grad():
            module.q_proj.weight.copy_(merged.q_w)
            module.q_proj.bias.copy_(merged.q_b)
            module.k_proj.weight.copy_(
                merged.k_w.view(G, -1, merged.k_w.shape[1]).repeat_interleave(h // G, 0).flatten(0, 1)
            )
        rows = {"z": [], "z'": []}
        for batch in batches:
            read = {}

            def hook(module, args, kwargs):
                kv = kwargs.get("key_value_states")
                read["x"] = kv if kv is not None else kwargs.get("hidden_states", args[0] if args else None)

            handle = model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
            with torch.no_grad():
                outs = {key: m(**batch, output_attentions=True) for key, m in (("z", model), ("z'", keyed))}
            handle.remove()
            x = read["x"].to(torch.float64)
            x = torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1)
            valid = batch["labels"] != -100 if name != "encoder" else torch.ones(x.shape[:2], dtype=torch.bool)
            for key, out in outs.items():
                probs = {"encoder": out.encoder_attentions, "decoder-self": out.decoder_attentions}
                p = probs.get(name, out.cross_attentions)[layer].to(torch.float64)
                pooled = p @ x[:, None]  # [b, h, t, D+1]
                rows[key] += [pooled[i][:, valid[i]] for i in range(len(valid))]
        found[(name, layer)] = (torch.cat(rows["z"], 1), torch.cat(rows["z'"], 1))
    return found


def reference_refit(layer, z, z_merged, c_inputs, blend):
    """The study script's `refit_values` on full (D+1)² moments (MHA): the shared V' per group and
    each head's o_proj columns, as [h, D, D+1] value paths."""
    h, d = layer.num_heads, layer.head_dim
    r, n = h // G, z.shape[1]
    c_merged = z_merged.mT @ z_merged / n + blend * c_inputs
    cross = z.mT @ z_merged / n + blend * c_inputs
    v_aug = _augment(layer.v_w, layer.v_b)
    paths = []
    for j in range(G):
        heads = range(j * r, (j + 1) * r)
        a = _value_inputs(layer, v_aug, j, r)
        c_group = regularised(a @ (sum(c_merged[s] for s in heads) / r) @ a.mT)
        target = 0.0
        for s in heads:
            o = layer.o_w[:, s * d : (s + 1) * d]
            read = _psd_sqrt(o.mT @ o) @ v_aug[s * d : (s + 1) * d] @ cross[s] @ a.mT
            target = target + read.mT @ read
        lower = torch.linalg.cholesky(c_group)
        whiten = torch.linalg.solve_triangular(lower, torch.eye(len(lower), dtype=lower.dtype), upper=False)
        vecs = torch.linalg.eigh(whiten @ target @ whiten.mT)[1]
        w = (whiten.mT @ vecs[:, -d:].flip(1)).mT @ a
        for s in heads:
            own = regularised(w @ c_merged[s] @ w.mT)
            head_map = torch.linalg.solve(own, (v_aug[s * d : (s + 1) * d] @ cross[s] @ w.mT).mT).mT
            paths.append(layer.o_w[:, s * d : (s + 1) * d] @ head_map @ w)
    return torch.stack(paths)


def test_projected_refit_equals_the_full_moment_refit(speech, tmp_path):  # noqa: F811
    """The second pass's projected moments are those of transformers' own attention probabilities
    projected, and the refit from them is the full-moment refit (every attention, G = 2 of 4)."""
    from uptrain.convert.calibration_seq2seq import collect_output_moments, uniform_moment
    from uptrain.convert.value_refit import RefitTarget

    src = whisper(tmp_path / "src")
    prepared, calibration = calibrated(src, speech)
    with prepared:
        sources = source_layers(prepared)
        merged = {t: apply_calibrated(sources[t], G, calibration.site_solved[t[0]][t[1]].merge) for t in sources}
        assert set(sources) == {(n, layer) for n in ("encoder", "decoder-self", "cross") for layer in range(2)}
        pooled = pooled_by_transformers(src, speech, merged)
        targets = {t: RefitTarget(sources[t], merged[t], G) for t in sources}
        found = collect_output_moments(str(src), str(speech), targets, keys=_keys())
    for t, layer in sources.items():
        z, z_merged = pooled[t]
        assert found[t].count == z.shape[1]
        assert not torch.allclose(z, z_merged, atol=1e-3)  # the merged keys move the attention
        for q in range(layer.num_heads):
            a = targets[t].value_inputs[q // (layer.num_heads // G)]
            v = _augment(layer.v_w, layer.v_b)[q * layer.head_dim : (q + 1) * layer.head_dim]
            torch.testing.assert_close(
                found[t].merged[q], a @ z_merged[q].mT @ z_merged[q] @ a.mT, rtol=1e-5, atol=1e-7
            )
            torch.testing.assert_close(found[t].cross[q], v @ z[q].mT @ z_merged[q] @ a.mT, rtol=1e-5, atol=1e-7)
        refit = apply_calibrated(layer, G, calibration.site_solved[t[0]][t[1]].merge)
        c = uniform_moment(calibration.moments, *t)
        expected = reference_refit(layer, z, z_merged, c, calibration.info["value_fit_blend"])
        torch.testing.assert_close(head_paths(refit), expected, rtol=1e-4, atol=1e-6)


def _keys():
    from uptrain.objectives.prompts import PromptKeys

    return PromptKeys(language="en")


def test_exactly_related_heads_refit_exactly_and_the_folder_records_it(speech, tmp_path, capsys):  # noqa: F811
    src = whisper(tmp_path / "src", related_groups=G)
    assert convert(src, tmp_path / "out", G, speech, "--value-fit", "output") == 0, capsys.readouterr().err
    torch.testing.assert_close(logits(tmp_path / "out", speech), logits(src, speech), rtol=1e-4, atol=1e-4)
    record = json.loads((tmp_path / "out" / "uptrain.json").read_text())
    assert record["calibration"]["value_fit"] == "output" and record["calibration"]["value_fit_blend"] == 0.1
    assert "--value-fit output" in (tmp_path / "out" / "README.md").read_text()
