"""Variants of MPT and Falcon that the classic tests (tests/convert/test_classic.py and the others
iterating tests/modeling/classic_models.CONFIGS: ALiBi Falcon-RW, MPT without clip_qkv) do not
build: rotary Falcon (with a rotary base other than 4.x's default) and MPT with `clip_qkv`; and
the settings the conversion of either refuses."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import uptrain.modeling  # noqa: F401  registers mpt_gqa, falcon_gqa
from tests.modeling import load_without_uptrain
from tests.modeling.classic_models import HEAD_DIM, HEADS, build, make_heads_identical, token_ids
from tests.modeling.second_environment import falcon_rewritten_between, transformers4_python
from tests.modeling.test_transformers_versions import floats, run_in
from uptrain import UptrainError
from uptrain.convert import convert_checkpoint
from uptrain.speed import output_cache

# name → (model_type, settings over classic_models.CONFIGS)
VARIANTS = {
    "falcon-rotary": (
        "falcon",
        dict(alibi=False, rope_parameters=dict(rope_type="default", rope_theta=500.0)),
    ),
    "mpt-clip_qkv": ("mpt", dict(attn_config=dict(clip_qkv=0.1))),
}


def variant(name: str, **kwargs):
    model_type, settings = VARIANTS[name]
    return build(model_type, **settings, **kwargs)


def load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def padded_batch():
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one row
    return ids, mask


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each variant saved once, and converted to G KV heads on demand."""
    made = {}

    def get(name, num_kv_heads=None):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            model = variant(name, init_std=0.5)  # lively weights: greedy tokens depend on the context
            model.save_pretrained(folder / "src")
            made[name] = (model, folder)
        model, folder = made[name]
        if num_kv_heads is None:
            return model, folder / "src"
        out = folder / f"g{num_kv_heads}"
        if not out.exists():
            convert_checkpoint(folder / "src", out, num_kv_heads, progress=False)
        return model, out

    return get


def test_the_variants_differ_from_the_classic_models():
    """clip_qkv clamps and rotary is not ALiBi: each variant computes another model than the
    classic one from the same weights, so the tests below test something of their own."""
    ids = token_ids()
    with torch.no_grad():
        for name, (model_type, _) in VARIANTS.items():
            classic, other = build(model_type), variant(name)
            other.load_state_dict(classic.state_dict())
            assert not torch.allclose(classic(ids).logits, other(ids).logits, atol=1e-3), name


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_g_equals_h_reproduces_transformers_exactly(name, attn, sources):
    if name.startswith("mpt") and attn == "sdpa":
        pytest.skip("transformers' MPT has no SDPA to match bit for bit")
    _, src = sources(name)
    _, out = sources(name, HEADS)
    converted, reference = load(out, attn_implementation=attn), load(src, attn_implementation=attn)
    ids, mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, reference(ids).logits)
        assert torch.equal(converted(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_identical_heads_convert_losslessly(name, num_kv_heads, tmp_path):
    model = variant(name)
    make_heads_identical(model, num_kv_heads)
    model.save_pretrained(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", num_kv_heads, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(load(out)(token_ids()).logits, model(token_ids()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_g_heads_cached_and_generate_with_the_cache_equals_without(name, sources):
    _, out = sources(name, 2)
    model = load(out)
    ids, mask = padded_batch()
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        cached = model.generate(ids, use_cache=True, **settings)
        uncached = model.generate(ids, use_cache=False, **settings)
    assert [layer.keys.shape for layer in cache.layers] == [(2, 2, ids.shape[1], HEAD_DIM)] * 2
    assert len({t for row in cached[:, ids.shape[1] :].tolist() for t in row}) > 3  # not one token repeated
    assert torch.equal(cached, uncached)


def test_rotary_falcon_runs_on_every_backend(sources):
    """Rotary Falcon has no ALiBi to refuse a backend for: eager, SDPA, flex and a function
    registered with the attention interface (which sees K/V at G heads) agree."""
    calls = []

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[1], key.shape[1]))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("uptrain_test_recording_falcon", recording_sdpa)
    _, out = sources("falcon-rotary", 2)
    ids, _ = padded_batch()
    backends = ("eager", "sdpa", "flex_attention", "uptrain_test_recording_falcon")
    with torch.no_grad():
        logits = {backend: load(out, attn_implementation=backend)(ids).logits for backend in backends}
    assert calls == [(HEADS, 2)] * 2  # both layers
    for backend, value in logits.items():
        torch.testing.assert_close(value, logits["eager"], rtol=1e-4, atol=1e-4, msg=backend)


def test_load_without_uptrain_under_transformers_5_and_4_57(sources, tmp_path):
    """Each variant, from the files beside its weights (trust_remote_code, no uptrain), gives the
    same logits and tokens, bit for bit, under the installed transformers 5, under 4.57, and as
    uptrain's registered classes."""
    folders = {}
    for name in sorted(VARIANTS):
        _, out = sources(name, 2)
        folders[name] = str(out)
    ids, mask = padded_batch()
    spec = {"folders": folders, "ids": ids.tolist(), "mask": mask.tolist(), "backends": ["eager", "sdpa"]}
    spec["new_tokens"] = 6
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    registered = load_without_uptrain.results(
        spec, lambda folder, backend: AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend)
    )
    for python in (sys.executable, transformers4_python()[0]):
        found = run_in(python, tmp_path)
        assert sorted(found["results"]) == sorted(registered), found["transformers"]
        for case, expected in registered.items():
            got, where = found["results"][case], f"{case} under transformers {found['transformers']}"
            if case.startswith("falcon") and falcon_rewritten_between(found["transformers"]):
                assert (got["generated"], got["cache"]) == (expected["generated"], expected["cache"]), where
                for key in ("logits", "padded"):
                    torch.testing.assert_close(floats(got[key]), floats(expected[key]), rtol=1e-5, atol=1e-5, msg=where)
            else:
                assert got == expected, where


REFUSED = [
    ("mpt", {"attn_config": {"qk_ln": True}}, "attn_config.qk_ln: True cannot be converted"),
    ("mpt", {"attn_config": {"attn_type": "multiquery_attention"}}, "attn_config.attn_type"),
    ("mpt", {"attn_config": {"alibi": False}}, "attn_config.alibi: False cannot be converted"),
    ("mpt", {"no_bias": False}, "no_bias: False cannot be converted"),
    ("falcon", {"multi_query": True}, "multi_query: True cannot be converted"),
    ("falcon", {"new_decoder_architecture": True}, "new_decoder_architecture: True cannot be converted"),
]


@pytest.mark.parametrize("model_type,edit,message", REFUSED)
def test_settings_the_modeling_cannot_compute_are_refused(model_type, edit, message, tmp_path):
    build(model_type).save_pretrained(tmp_path / "src")
    config_file = tmp_path / "src" / "config.json"
    config = json.loads(config_file.read_text())
    for key, value in edit.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    config_file.write_text(json.dumps(config))
    with pytest.raises(UptrainError, match=message):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", 2, progress=False)
    assert not (tmp_path / "out").exists()


def test_inspect_refuses_a_setting_whose_geometry_it_would_misread(tmp_path, capsys):
    """Multi-query Falcon (Falcon-7B) has one KV head, which no config key counts: `inspect`
    reads the geometry as the conversion does, refusing it in one line rather than reporting
    num_attention_heads KV heads; multi-head Falcon it reports."""
    from uptrain.cli import main

    build("falcon", multi_query=True).save_pretrained(tmp_path / "mqa")
    build("falcon").save_pretrained(tmp_path / "mha")
    capsys.readouterr()  # save_pretrained's progress bars
    assert main(["inspect", str(tmp_path / "mqa")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "falcon with multi_query: True cannot be converted" in err
    assert main(["inspect", str(tmp_path / "mha"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_key_value_heads"] == HEADS
