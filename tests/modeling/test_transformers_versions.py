"""Converted GPT-2, GPT-NeoX, OPT, GPT-J and BLOOM checkpoints load and generate identically
under transformers 4.57 (the last 4.x), without uptrain, from the files beside the weights,
and under the installed transformers 5 with uptrain's registered classes: the same logits,
bit for bit, and the same greedy `generate()` with the KV cache, on eager and SDPA attention.

transformers' own models of these architectures agree across the two versions bit for bit
with SDPA (OPT and BLOOM with eager too); GPT-2's and GPT-J's eager attention differ by an
ulp (4.x divides the scores by √d, 5.x multiplies by d^-½). The GQA modeling does its own
eager arithmetic, the same under both, so bit-for-bit equality is what is required of it.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import uptrain.modeling  # noqa: F401  registers gpt2_gqa, …: the in-process side loads without trust_remote_code
from tests.modeling import load_without_uptrain
from tests.modeling.classic_models import ARCHITECTURES, SHARED, build, token_ids
from tests.modeling.second_environment import falcon_rewritten_between, transformers4_python
from uptrain.convert import convert_checkpoint

BACKENDS = ["eager", "sdpa"]


@pytest.fixture(scope="module")
def transformers4():
    return transformers4_python()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each architecture converted to G = 2 (of 8 heads) by the current uptrain; folder names
    unique per architecture (transformers caches remote code by the folder's name)."""
    root = tmp_path_factory.mktemp("classic")
    folders = {}
    for model_type in ARCHITECTURES:
        build(model_type, init_std=0.5).save_pretrained(root / f"{model_type}-src")
        folders[model_type] = str(
            convert_checkpoint(root / f"{model_type}-src", root / f"{model_type}-gqa", 2, progress=False)
        )
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one row
    spec = {"folders": folders, "ids": ids.tolist(), "mask": mask.tolist(), "backends": BACKENDS, "new_tokens": 8}
    (root / "spec.json").write_text(json.dumps(spec))
    return root, spec


@pytest.fixture(scope="module")
def under_4_57(transformers4, converted) -> dict:
    """What `load_without_uptrain.py` gives in the transformers 4.57 environment."""
    return run_in(transformers4[0], converted[0])


def run_in(python, root) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    # -I: nothing but the environment's own packages on the path (no script folder, no user site).
    result = subprocess.run(
        [str(python), "-I", load_without_uptrain.__file__, str(root / "spec.json")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_transformers_4_57_and_5_give_the_same_logits_and_tokens(transformers4, converted, under_4_57):
    spec, old = converted[1], under_4_57
    assert old["transformers"].startswith("4.57.") and old["transformers"] == transformers4[1]["transformers"]
    new = load_without_uptrain.results(
        spec, lambda folder, backend: AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend)
    )
    assert sorted(old["results"]) == sorted(new) == sorted(f"{t}/{b}" for t in ARCHITECTURES for b in BACKENDS)
    for case, expected in new.items():
        got = old["results"][case]
        for what in ("logits", "padded", "generated"):
            if what != "generated" and case.startswith("falcon") and falcon_rewritten_between(old["transformers"]):
                close = torch.testing.assert_close
                close(floats(got[what]), floats(expected[what]), rtol=1e-5, atol=1e-5, msg=f"{case}: {what}")
                continue
            assert got[what] == expected[what], f"{case}: {what} differ under transformers {old['transformers']}"
    # The generation is not degenerate (one token repeated), so equal tokens say something.
    for case, result in new.items():
        assert len({t for row in result["generated"] for t in row[-spec["new_tokens"] :]}) > 3, case


def test_eager_and_sdpa_agree_under_transformers_4_57(under_4_57):
    """Every backend 4.57 has on CPU gives the same model: logits within float32 noise and the
    same tokens."""
    old = under_4_57["results"]
    for model_type in ARCHITECTURES:
        eager, sdpa = old[f"{model_type}/eager"], old[f"{model_type}/sdpa"]
        for what in ("logits", "padded"):
            a, b = floats(eager[what]), floats(sdpa[what])
            # float32 noise is relative: 4e-6 of the largest logit (GPT-Neo's eager, unscaled
            # scores, differs from SDPA by 1.6e-5 on logits of 14)
            torch.testing.assert_close(a, b, rtol=0, atol=4e-6 * a.abs().max().item(), msg=f"{model_type}: {what}")
        assert eager["generated"] == sdpa["generated"], model_type


@pytest.fixture(scope="module")
def mla_converted(tmp_path_factory):
    """A tiny Llama with tied embeddings (as the reference's) converted to MLA (`--target mla`)."""
    root = tmp_path_factory.mktemp("mla")
    config = LlamaConfig(
        **SHARED,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        initializer_range=0.5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "llama-src")
    out = convert_checkpoint(root / "llama-src", root / "llama-mla", target="mla", kv_rank=48, rope_dims=16)
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    spec = {"folders": {"mla": str(out)}, "ids": ids.tolist(), "mask": mask.tolist(), "backends": BACKENDS}
    spec.update(new_tokens=8, native=True)
    (root / "spec.json").write_text(json.dumps(spec))
    return root, spec


def test_an_mla_conversion_loads_under_transformers_4_57_as_under_5(transformers4, mla_converted):
    """transformers 4.57's own DeepseekV2ForCausalLM takes the MLA output's config keys and weights
    (the top-level `rope_theta` with no `rope_scaling`: the plain rotary, which the YaRN-at-factor-1
    `rope_parameters` spells for 5.x and vLLM): the same logits within float32 rounding, relative
    4e-6 of the largest as between eager and SDPA (4.57 expands the latent into keys and values
    before caching them, 5.x after: other orders of the same sums; measured 9e-7), and the same
    greedy tokens."""
    root, spec = mla_converted
    old = run_in(transformers4[0], root)
    assert old["transformers"].startswith("4.57.")
    new = load_without_uptrain.results(
        spec, lambda folder, backend: AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend)
    )
    assert sorted(old["results"]) == sorted(new) == [f"mla/{b}" for b in BACKENDS]
    for case, expected in new.items():
        got = old["results"][case]
        for what in ("logits", "padded"):
            a, b = floats(got[what]), floats(expected[what])
            torch.testing.assert_close(a, b, rtol=0, atol=4e-6 * b.abs().max().item(), msg=f"{case}: {what}")
        assert got["generated"] == expected["generated"], case
        assert len({t for row in expected["generated"] for t in row[-spec["new_tokens"] :]}) > 3, case


def floats(hexes: list[str]) -> torch.Tensor:
    return torch.tensor([float.fromhex(x) for x in hexes])
