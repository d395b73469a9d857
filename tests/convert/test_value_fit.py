"""`--value-fit output` (uptrain/convert/value_refit.py): the calibrated merge's values refit to each
head's attention output under the merged keys, from a second calibration pass. On a tiny real
Whisper calibrated from speech pairs: its projected moments and refit equal the full-moment
computation (transformers' own attention probabilities, the (D+1)² moments of the study script's
`refit_values`); exact where the merge is; its output error below the plain merge's; λ → ∞ the
plain merge's values; refusals in one line."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.convert.test_calibrated_whisper import ALL, convert, logits, speech, whisper  # noqa: F401  (fixture)
from uptrain.cli import main
from uptrain.convert.calibrated import LayerAttention, _augment, _psd_sqrt, _value_inputs, apply_calibrated, regularised
from uptrain.convert.calibration_seq2seq import uniform_moment
from uptrain.convert.spec import CalibrationSettings
from uptrain.convert.value_refit import refit_solution
from uptrain.objectives.prompts import PromptKeys

G = 2
CLIPS = 8  # calibration reads the first 8 speech pairs (2 batches of 4)
SETTINGS = CalibrationSettings(calibration_tokens=CLIPS * 256)


def calibrated(src: Path, data: Path, **options):
    """(the prepared conversion, its calibration, each refit target) of `src` to G KV heads in
    every attention, `--value-fit output` unless `options` say otherwise."""
    from uptrain.convert.pipeline import calibrate, prepare
    from uptrain.convert.spec import conversion_spec

    values = dict(pooling="calibrated", attention=ALL, calibration_data=str(data), language="en", value_fit="output")
    values["calibration_tokens"] = SETTINGS.calibration_tokens
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


def module_path(attention: str, layer: int) -> str:
    paths = {"encoder": "model.encoder.layers.{}.self_attn", "decoder-self": "model.decoder.layers.{}.self_attn"}
    return paths.get(attention, "model.decoder.layers.{}.encoder_attn").format(layer)


def pooled_by_transformers(src: Path, data: Path, targets: dict) -> dict:
    """Per target: (z, z') [h, n, D+1], each head's attention-pooled inputs over the kept queries,
    from transformers' own (eager) attention probabilities: the source model's, and the source
    model with only that module's queries and keys replaced by the merged ones."""
    from transformers import WhisperForConditionalGeneration

    from uptrain.architecture import architecture
    from uptrain.convert.calibration_seq2seq import calibration_batches

    model = WhisperForConditionalGeneration.from_pretrained(src, attn_implementation="eager").eval()
    batches, _ = calibration_batches(src, architecture("whisper"), str(data), SETTINGS, 4, PromptKeys("en"))
    with torch.no_grad():  # the source model's attention, once per batch
        source_outs = [model(**batch, output_attentions=True) for batch in batches]
    found = {}
    for (name, layer), merged in targets.items():
        keyed = copy.deepcopy(model)
        path = module_path(name, layer)
        module = keyed.get_submodule(path)
        h = merged.num_heads
        with torch.no_grad():
            module.q_proj.weight.copy_(merged.q_w)
            module.q_proj.bias.copy_(merged.q_b)
            module.k_proj.weight.copy_(
                merged.k_w.view(G, -1, merged.k_w.shape[1]).repeat_interleave(h // G, 0).flatten(0, 1)
            )
        rows = {"z": [], "z'": []}
        read = {}

        def hook(module, args, kwargs, read=read):
            kv = kwargs.get("key_value_states")
            read["x"] = kv if kv is not None else kwargs.get("hidden_states", args[0] if args else None)

        for batch, source_out in zip(batches, source_outs):
            handle = keyed.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
            with torch.no_grad():  # the module's inputs are the source model's: only its own keys changed
                outs = {"z": source_out, "z'": keyed(**batch, output_attentions=True)}
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


@pytest.fixture(scope="module")
def refit(speech, tmp_path_factory):  # noqa: F811
    """The tiny Whisper converted to G = 2 in every attention with `--value-fit output` (written to
    out/ beside it): (its calibration, each target's source layer, the plain calibrated merge's
    solution, transformers' pooled inputs (z, z'), each `RefitTarget`, the second pass's moments)."""
    from uptrain.convert.calibration_seq2seq import collect_output_moments
    from uptrain.convert.pipeline import execute
    from uptrain.convert.value_refit import RefitTarget

    src = whisper(tmp_path_factory.mktemp("valuefit") / "src")
    prepared, calibration = calibrated(src, speech)
    with prepared:
        execute(prepared, src.parent / "out", calibration=calibration, progress=False)
        sources = source_layers(prepared)
        # the plain calibrated merge: the same moments, the values not refit
        plain = prepared.conversion.merger(prepared.checkpoint, dataclasses.replace(calibration, site_solved=None))
        solutions = {t: plain.mergers[t[0]].solved(t[1])[0].merge for t in sources}
    merged = {t: apply_calibrated(sources[t], G, solutions[t]) for t in sources}
    targets = {t: RefitTarget(sources[t], merged[t], G) for t in sources}
    found = collect_output_moments(str(src), str(speech), targets, SETTINGS, keys=PromptKeys(language="en"))
    return calibration, sources, solutions, pooled_by_transformers(src, speech, merged), targets, found


def test_projected_refit_equals_the_full_moment_refit(refit):
    """The second pass's projected moments are those of transformers' own attention probabilities
    projected, and the conversion's refit is the full-moment refit (every attention, G = 2 of 4)."""
    calibration, sources, _, pooled, targets, found = refit
    assert set(sources) == {(n, layer) for n in ("encoder", "decoder-self", "cross") for layer in range(2)}
    for t, layer in sources.items():
        z, z_merged = pooled[t]
        assert found[t].count == z.shape[1]
        assert not torch.allclose(z, z_merged, atol=1e-3)  # the merged keys move the attention
        for q in range(layer.num_heads):
            a = targets[t].value_inputs[q // (layer.num_heads // G)]
            v = _augment(layer.v_w, layer.v_b)[q * layer.head_dim : (q + 1) * layer.head_dim]
            merged_moment = a @ z_merged[q].mT @ z_merged[q] @ a.mT
            torch.testing.assert_close(found[t].merged[q], merged_moment, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(found[t].cross[q], v @ z[q].mT @ z_merged[q] @ a.mT, rtol=1e-5, atol=1e-7)
        converted = apply_calibrated(layer, G, calibration.site_solved[t[0]][t[1]].merge)
        c = uniform_moment(calibration.moments, *t)
        expected = reference_refit(layer, z, z_merged, c, calibration.info["value_fit_blend"])
        torch.testing.assert_close(head_paths(converted), expected, rtol=1e-4, atol=1e-6)


def test_the_folder_holds_the_refit_and_loads(refit, tmp_path_factory):
    """`execute` writes the refit (not the plain merge) into the converted checkpoint, which loads."""
    from transformers import AutoModelForSpeechSeq2Seq

    import uptrain.modeling  # noqa: F401  registers whisper_gqa

    calibration, sources, _, _, _, _ = refit
    out = next(Path(tmp_path_factory.getbasetemp()).glob("valuefit*/out"))
    tensors = load_file(out / "model.safetensors")
    for (name, layer), source in sources.items():
        converted = apply_calibrated(source, G, calibration.site_solved[name][layer].merge)
        prefix = module_path(name, layer)
        for field, rel in (("v_w", "v_proj.weight"), ("v_b", "v_proj.bias"), ("o_w", "out_proj.weight")):
            written = tensors[f"{prefix}.{rel}"].to(torch.float64)
            torch.testing.assert_close(written, getattr(converted, field), rtol=1e-5, atol=1e-6)
    model = AutoModelForSpeechSeq2Seq.from_pretrained(out)
    for name, layer in sources:
        assert model.get_submodule(module_path(name, layer)).k_proj.weight.shape[0] == G * sources[name, layer].head_dim


def output_error(layer: LayerAttention, merged: LayerAttention, z, z_merged) -> float:
    """Σ_q E‖O'_q V'_g z'_q − O_q V_s z_q‖²: the attention output's error under the merged keys."""
    wanted = z @ head_paths(layer).mT  # [h, n, D]
    return float((z_merged @ head_paths(merged).mT - wanted).pow(2).sum(-1).mean(-1).sum())


def test_the_refit_loses_less_of_the_attention_output_than_the_plain_merge(refit):
    calibration, sources, solutions, pooled, _, found = refit
    for t, layer in sources.items():
        c = uniform_moment(calibration.moments, *t)
        fitted = apply_calibrated(layer, G, refit_solution(layer, G, solutions[t], found[t], c, blend=0.0))
        plain = apply_calibrated(layer, G, solutions[t])
        assert output_error(layer, fitted, *pooled[t]) < 0.9 * output_error(layer, plain, *pooled[t]), t


def test_a_large_blend_gives_the_plain_merge_values(refit):
    calibration, sources, solutions, _, _, found = refit
    for t, layer in sources.items():
        c = uniform_moment(calibration.moments, *t)
        blended = apply_calibrated(layer, G, refit_solution(layer, G, solutions[t], found[t], c, blend=1e8))
        plain = apply_calibrated(layer, G, solutions[t])
        torch.testing.assert_close(head_paths(blended), head_paths(plain), rtol=1e-4, atol=1e-6)
        small = apply_calibrated(layer, G, refit_solution(layer, G, solutions[t], found[t], c, blend=0.1))
        assert not torch.allclose(head_paths(small), head_paths(plain), rtol=1e-2, atol=1e-4)


def interleave_heads(folder: Path, order: list[int]) -> None:
    """Renumber every attention's heads of the Whisper at `folder` (q/k/v rows, o columns): exact."""
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(folder)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("Attention"):
                d = module.head_dim
                rows = torch.tensor([h * d + i for h in order for i in range(d)])
                for proj in (module.q_proj, module.k_proj, module.v_proj):
                    proj.weight.copy_(proj.weight[rows])
                    if proj.bias is not None:
                        proj.bias.copy_(proj.bias[rows])
                module.out_proj.weight.copy_(module.out_proj.weight[:, rows])
    model.save_pretrained(folder)


@pytest.mark.parametrize("grouping", ["contiguous", "similarity"])
def test_exactly_related_heads_refit_exactly_and_the_folder_records_it(grouping, speech, tmp_path, capsys):  # noqa: F811
    src = whisper(tmp_path / "src", related_groups=G)
    if grouping == "similarity":  # related heads 0, 1 and 2, 3 renumbered to 0, 2 and 1, 3: groups to find
        interleave_heads(src, [0, 2, 1, 3])
    argv = ["--value-fit", "output", "--grouping", grouping]
    assert convert(src, tmp_path / "out", G, speech, *argv) == 0, capsys.readouterr().err
    torch.testing.assert_close(logits(tmp_path / "out", speech), logits(src, speech), rtol=1e-4, atol=1e-4)
    record = json.loads((tmp_path / "out" / "uptrain.json").read_text())
    if grouping == "similarity":
        assert record["attentions"]["cross"]["kv_head_order"]["0"] == [0, 2, 1, 3]
    assert record["calibration"]["value_fit"] == "output" and record["calibration"]["value_fit_blend"] == 0.1
    assert "--value-fit output" in (tmp_path / "out" / "README.md").read_text()


def test_layers_an_allocation_keeps_at_their_heads_are_copied_not_refit(speech, tmp_path, capsys):  # noqa: F811
    """Per-layer KV heads: a layer left at its 4 source heads is the source's bit for bit; the
    merged ones are refit (they differ from the plain merge's)."""
    src = whisper(tmp_path / "src")
    per_layer = ["--attention", "decoder-self,cross", "--kv-heads-per-layer", "4,2/2,4", "--language", "en"]
    for fit in ("inputs", "output"):
        argv = ["convert", str(src), str(tmp_path / fit), "--pooling", "calibrated", "--calibration-data", str(speech)]
        assert main([*argv, *per_layer, "--value-fit", fit]) == 0, capsys.readouterr().err
    source = load_file(src / "model.safetensors")
    plain, fitted = (load_file(tmp_path / fit / "model.safetensors") for fit in ("inputs", "output"))
    for kept in ("model.decoder.layers.0.self_attn", "model.decoder.layers.1.encoder_attn"):
        for rel in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "v_proj.bias", "out_proj.weight"):
            assert torch.equal(fitted[f"{kept}.{rel}"], source[f"{kept}.{rel}"]), (kept, rel)
    for merged in ("model.decoder.layers.1.self_attn", "model.decoder.layers.0.encoder_attn"):
        assert fitted[f"{merged}.k_proj.weight"].shape[0] == 2 * 8
        assert torch.equal(fitted[f"{merged}.k_proj.weight"], plain[f"{merged}.k_proj.weight"])  # the keys as solved
        assert not torch.allclose(fitted[f"{merged}.out_proj.weight"], plain[f"{merged}.out_proj.weight"], atol=1e-4)


def refused(capsys, argv: list[str], out: Path, says: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not out.exists()


def test_value_fit_is_refused_in_one_line_where_it_does_not_apply(speech, tmp_path, capsys):  # noqa: F811
    from tests.convert.test_calibrated_encoder_decoder import build, decoder_only_source

    src, out = whisper(tmp_path / "src"), tmp_path / "out"
    whisper_argv = ["convert", str(src), str(out), "-g", "2", "--calibration-data", str(speech), "--language", "en"]
    says = "--value-fit output refits the values of a calibrated merge, and --pooling mean solves none"
    refused(capsys, [*whisper_argv, "--value-fit", "output"], out, says)
    says = "--value-fit-blend weighs the inputs fit within --value-fit output"
    refused(capsys, [*whisper_argv, "--pooling", "calibrated", "--value-fit-blend", "1"], out, says)
    refused(capsys, [*whisper_argv, "--value-fit", "output", "--value-fit-blend", "-1"], out, "value_fit_blend")
    llama, text = decoder_only_source(tmp_path)
    calibrated = ["-g", "2", "--pooling", "calibrated", "--calibration-data", str(text), "--value-fit", "output"]
    says = "--value-fit output applies to encoder–decoders' calibrated merge; this model is decoder-only"
    refused(capsys, ["convert", str(llama), str(out), *calibrated], out, says)
    mla = ["convert", str(llama), str(out), "--target", "mla", "--kv-rank", "8", "--value-fit", "output"]
    refused(capsys, mla, out, "--target mla takes --kv-rank or --kv-budget (and --rope-dims), not --value-fit")
    build("t5").save_pretrained(tmp_path / "t5")
    says = "and T5's adds a relative position bias to the scores: not supported"
    refused(capsys, ["convert", str(tmp_path / "t5"), str(out), *calibrated], out, says)
