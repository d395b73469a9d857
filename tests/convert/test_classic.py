"""GPT-2, GPT-NeoX, … (no GQA in transformers): conversion to uptrain's GQA modeling, on tiny
real checkpoints, checked against the unmodified transformers models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import uptrain.modeling  # noqa: F401  registers gpt2_gqa, …: `load` uses plain AutoModelForCausalLM
from tests.modeling.classic_models import (
    ARCHITECTURES,
    HEAD_DIM,
    HEADS,
    build,
    make_heads_identical,
    reads_config_aliases,
    token_ids,
)
from uptrain.convert import convert_checkpoint
from uptrain.speed import output_cache

# GPT-2-style configs (n_head, n_layer, n_embd) need uptrain.model_info to read those names.
NEEDS_ALIASES = {"gpt2", "gptj", "bloom"}
# Backends on which transformers' own model is no reference to match bit for bit.
NO_REFERENCE = {
    ("bloom", "sdpa"): "transformers' BLOOM has no SDPA",
    ("mpt", "sdpa"): "transformers' MPT has no SDPA",
    ("gpt_neo", "sdpa"): "transformers' GPT-Neo has no SDPA",
    # Its eager attention adds ALiBi twice (once unscaled into the scores, once / √d in the mask
    # it builds); its SDPA, its default, once, as the GQA modeling does on every backend.
    ("falcon", "eager"): "transformers' eager Falcon with ALiBi adds ALiBi twice",
}


def arch_params(cases=ARCHITECTURES):
    """One pytest parameter per case (an architecture's name, or a tuple starting with it),
    skipped while uptrain cannot read that architecture's config."""
    mark = pytest.mark.skipif(
        not reads_config_aliases(),
        reason="uptrain.model_info.attention_geometry does not read n_head/n_layer/n_embd yet",
    )
    params = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, marks=[mark] if values[0] in NEEDS_ALIASES else []))
    return params


def state(folder):
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One saved source checkpoint per architecture, built once."""
    built = {}

    def get(model_type):
        if model_type not in built:
            model = build(model_type)
            folder = tmp_path_factory.mktemp(model_type)
            model.save_pretrained(folder)
            built[model_type] = (model, folder)
        return built[model_type]

    return get


@pytest.mark.parametrize("model_type", arch_params())
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_g_equals_h_reproduces_transformers_exactly(model_type, attn, sources, tmp_path):
    """G = h: every tensor keeps its bits (fused Q/K/V layouts included) and the GQA modeling's
    logits equal the unmodified transformers model's, bit for bit."""
    if (model_type, attn) in NO_REFERENCE:
        pytest.skip(
            f"{NO_REFERENCE[model_type, attn]} to match bit for bit (tests/modeling/test_backends.py compares "
            "every backend of the GQA modeling with transformers' default within float32 noise)"
        )
    model, src = sources(model_type)
    out = convert_checkpoint(src, tmp_path / "out", HEADS, progress=False)
    before, after = state(src), state(out)
    assert len(before) == len(after)
    for name, tensor in before.items():
        renamed = name.replace("embed_out.", "lm_head.")  # transformers' own NeoX rename, made on disk
        assert torch.equal(after[renamed], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"{model_type}_gqa" and config["num_key_value_heads"] == HEADS
    converted = load(out, attn_implementation=attn)
    assert type(converted).__name__.endswith("GQAForCausalLM")
    reference = AutoModelForCausalLM.from_pretrained(src, attn_implementation=attn).eval()
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one row
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, reference(ids).logits)
        assert torch.equal(converted(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("model_type", arch_params())
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_identical_heads_convert_losslessly(model_type, num_kv_heads, tmp_path):
    model = build(model_type)
    make_heads_identical(model, num_kv_heads)
    model.save_pretrained(tmp_path / "src")
    ids = token_ids()
    with torch.no_grad():
        reference = model(ids).logits
    for pooling in ("mean", "first"):
        out = convert_checkpoint(tmp_path / "src", tmp_path / pooling, num_kv_heads, pooling=pooling, progress=False)
        converted = load(out)
        assert converted.config.num_key_value_heads == num_kv_heads
        with torch.no_grad():
            torch.testing.assert_close(converted(ids).logits, reference, rtol=1e-5, atol=1e-5)
    # random re-initialises K/V: it must not be lossless, or the test above proves nothing.
    out = convert_checkpoint(tmp_path / "src", tmp_path / "random", num_kv_heads, pooling="random", progress=False)
    with torch.no_grad():
        assert not torch.allclose(load(out)(ids).logits, reference, atol=1e-3)


@pytest.mark.parametrize("model_type", arch_params())
def test_gqa_forward_generate_and_train_with_g_heads_cached(model_type, sources, tmp_path):
    _, src = sources(model_type)
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    model = load(out)
    ids = token_ids(length=6)
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert len(cache.layers) == 2
    for layer in cache.layers:
        assert layer.keys.shape == (2, 2, 6, HEAD_DIM) and layer.values.shape == (2, 2, 6, HEAD_DIM)
    assert generated.shape == (2, 11)
    # Decoding with the cache gives what a full forward over the same tokens gives.
    with torch.no_grad():
        full = model(generated[:, :-1]).logits[:, -1]
    assert torch.equal(full.argmax(-1), generated[:, -1])

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = token_ids(seed=3, length=16)
    losses = []
    for _ in range(4):
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("model_type", arch_params())
def test_loads_with_trust_remote_code_without_uptrain(model_type, sources, tmp_path):
    """A fresh process without uptrain loads the checkpoint from the modeling file beside the
    weights, and computes the same logits as uptrain's registered classes."""
    _, src = sources(model_type)
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    assert {"attention.py", f"modeling_{model_type}_gqa.py"} <= {p.name for p in out.iterdir()}
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
ids = torch.tensor({token_ids().tolist()})
with torch.no_grad():
    output = model(ids, use_cache=True)
torch.save(output.logits, {str(tmp_path / "logits.pt")!r})
assert (getattr(output, 'cache', None) or output.past_key_values).layers[0].keys.shape[1] == 2
assert not [m for m in sys.modules if m.split('.')[0] == 'uptrain'], 'uptrain was imported'
print(type(model).__module__)
"""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith("transformers_modules.")
    with torch.no_grad():
        expected = load(out)(token_ids()).logits
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)


@pytest.mark.parametrize("model_type", arch_params())
def test_converted_checkpoint_pools_further(model_type, sources, tmp_path):
    """8 → 4 → 2 KV heads (first pooling) equals 8 → 2 directly, tensor for tensor: the GQA
    layout is read back with r query heads per group."""
    _, src = sources(model_type)
    mid = convert_checkpoint(src, tmp_path / "g4", 4, pooling="first", progress=False)
    twice = convert_checkpoint(mid, tmp_path / "g2_twice", 2, pooling="first", progress=False)
    once = convert_checkpoint(src, tmp_path / "g2_once", 2, pooling="first", progress=False)
    a, b = state(twice), state(once)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((twice / "config.json").read_text())["model_type"] == f"{model_type}_gqa"


@pytest.mark.parametrize("model_type", arch_params(["gpt_neox", "bloom", "falcon"]))
def test_per_head_fused_stored_form_is_per_group(model_type, sources, tmp_path):
    """NeoX, BLOOM and Falcon: query_key_value rows of the output are [G, r + 2, d]: the group's
    query heads in order, then the mean of its K heads, then the mean of its V heads."""
    _, src = sources(model_type)
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    name = {
        "gpt_neox": "gpt_neox.layers.1.attention.query_key_value.weight",
        "bloom": "transformer.h.1.self_attention.query_key_value.weight",
        "falcon": "transformer.h.1.self_attention.query_key_value.weight",
    }[model_type]
    before = state(src)[name].view(HEADS, 3, HEAD_DIM, -1)
    after = state(out)[name].view(2, HEADS // 2 + 2, HEAD_DIM, -1)
    for j in range(2):
        group = before[4 * j : 4 * (j + 1)]
        assert torch.equal(after[j, :4], group[:, 0])
        torch.testing.assert_close(after[j, 4], group[:, 1].mean(0), rtol=0, atol=1e-7)
        torch.testing.assert_close(after[j, 5], group[:, 2].mean(0), rtol=0, atol=1e-7)


@pytest.mark.parametrize("model_type", arch_params(["gpt2"]))
def test_gpt2_stored_form(model_type, sources, tmp_path):
    """c_attn columns of the output are [Q | K (G·d) | V (G·d)], K and V the means of their groups."""
    _, src = sources(model_type)
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    for part in ("weight", "bias"):
        name = f"transformer.h.0.attn.c_attn.{part}"
        before, after = state(src)[name], state(out)[name]
        assert after.shape[-1] == 64 + 2 * 2 * HEAD_DIM
        assert torch.equal(after[..., :64], before[..., :64])
        for block in (1, 2):  # K, V
            heads = before[..., 64 * block : 64 * (block + 1)].reshape(*before.shape[:-1], 2, 4, HEAD_DIM)
            pooled = after[..., 64 + 16 * (block - 1) : 64 + 16 * block]
            torch.testing.assert_close(pooled, heads.mean(-2).reshape(pooled.shape), rtol=0, atol=1e-7)


@pytest.mark.parametrize("model_type", arch_params(["mpt"]))
def test_mpt_stored_form(model_type, sources, tmp_path):
    """Wqkv rows of the output are [Q | K (G·d) | V (G·d)], K and V the means of their groups."""
    _, src = sources(model_type)
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    name = "transformer.blocks.1.attn.Wqkv.weight"
    before, after = state(src)[name], state(out)[name]
    assert after.shape == (64 + 2 * 2 * HEAD_DIM, 64)
    assert torch.equal(after[:64], before[:64])
    for block in (1, 2):  # K, V
        heads = before[64 * block : 64 * (block + 1)].view(2, 4, HEAD_DIM, 64)
        pooled = after[64 + 16 * (block - 1) : 64 + 16 * block].view(2, HEAD_DIM, 64)
        torch.testing.assert_close(pooled, heads.mean(1), rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "model_type,prefix", arch_params([("gpt2", "transformer."), ("opt", "model."), ("bloom", "transformer.")])
)
def test_checkpoints_saved_without_the_base_prefix(model_type, prefix, sources, tmp_path):
    """The original GPT-2, OPT and BLOOM checkpoints name tensors without the base model's
    prefix (h.0.attn.…, decoder.layers.0.…): they convert and load the same."""
    _, src = sources(model_type)
    tensors = {name.removeprefix(prefix): t for name, t in state(src).items()}
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file(tensors, bare / "model.safetensors", metadata={"format": "pt"})
    (bare / "config.json").write_text((src / "config.json").read_text())
    out = convert_checkpoint(bare, tmp_path / "out", 2, progress=False)
    assert not [name for name in state(out) if name.startswith(prefix)]
    with torch.no_grad():
        reference = load(convert_checkpoint(src, tmp_path / "prefixed", 2, progress=False))(token_ids()).logits
        assert torch.equal(load(out)(token_ids()).logits, reference)
