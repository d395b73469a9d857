"""An MLA conversion (`--target mla`, the DeepSeek-V2 layout) serves in vLLM (the CPU build, in the
cached environment of tests/modeling/vllm_environment.py) as `DeepseekV2ForCausalLM`, with
transformers' greedy tokens and the capacity the latent's arithmetic gives.

What vLLM 0.32's CPU build takes (docs/concepts/mla.md, "Serving"): a latent and rotary key of
kv_lora_rank + qk_rope_head_dim = 576 elements (its CPU MLA kernels compile for DeepSeek's 512 + 64
only) and bfloat16 or float16 weights. So the source here is a Llama of hidden 512 (the latent's
rank is at most the hidden size), 4 heads of 128, converted at R = 512, D = 64, bfloat16.

bfloat16 rounds: vLLM and transformers add their products in other orders, so their logits differ
by about bfloat16's rounding. The prompts are chosen (from 60 random ones) so that at every
generated step transformers' float32 margin (top logit minus the second) is over 6 times the
largest logit difference between transformers' own bfloat16 and float32 runs of the same
weights; the test checks that first, so equal tokens say the two compute the same model, not
that the rounding happened to fall the same way.

Also served: a source with tied embeddings (the reference Llama's, Llama 3.2's), whose head the
conversion writes as a copy (vLLM's `DeepseekV2ForCausalLM` never ties: `mla.tied_head`), with
prompts chosen the same way for it; and, as a sentinel, the first conversion with
`rope_type: default`, which vLLM's CPU rotary kernel mis-positions
(`deepseek_v2.rotary_parameters`): when vLLM fixes that, the sentinel fails and the
YaRN-at-factor-1 spelling can go.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.modeling.vllm_environment import served as vllm_served
from uptrain.convert import convert_checkpoint

pytestmark = pytest.mark.slow

HIDDEN, HEADS, HEAD_DIM, LAYERS = 512, 4, 128, 2
RANK, ROPE_DIMS = 512, 64  # R + D = 576, what vLLM's CPU MLA takes
PROMPTS = [
    [12, 118, 111, 90, 45, 63, 74, 15, 48],
    [93, 114, 11, 27, 120, 75],
    [21, 112, 92, 31, 8, 107, 76, 84, 119, 122],
]
TIED_PROMPTS = [[60, 14, 13, 43, 115, 68, 122, 65], [87, 85, 92, 120, 104, 48, 13], [92, 53, 28, 36]]
NEW_TOKENS = 8
KV_SPACE_GIB = 1
BFLOAT16_BYTES = 2


def tiny_llama(folder, tied: bool) -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
        initializer_range=0.05,  # logits of a few units: bfloat16's rounding small against the margins
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, str]:
    """The tiny Llama converted to MLA (bfloat16), a copy written with the plain rotary, and the
    tied Llama converted."""
    root = tmp_path_factory.mktemp("served-mla")
    mla = {"target": "mla", "kv_rank": RANK, "rope_dims": ROPE_DIMS, "dtype": "bfloat16", "progress": False}
    tiny_llama(root / "src", tied=False)
    tiny_llama(root / "tied-src", tied=True)
    tied = convert_checkpoint(root / "tied-src", root / "mla-tied", **mla)
    mla = convert_checkpoint(root / "src", root / "mla", **mla)
    shutil.copytree(mla, root / "mla-default-rope")
    written = json.loads((mla / "config.json").read_text())
    written["rope_parameters"] = {"rope_type": "default", "rope_theta": written["rope_parameters"]["rope_theta"]}
    (root / "mla-default-rope" / "config.json").write_text(json.dumps(written))
    return {"mla": str(mla), "mla-default-rope": str(root / "mla-default-rope"), "mla-tied": str(tied)}


@pytest.fixture(scope="module")
def served(converted, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-mla-run")
    spec = {
        "cases": converted,
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "max_model_len": 64,
        "dtype": "bfloat16",
        "case_prompts": {"mla-tied": TIED_PROMPTS},
    }
    return vllm_served(spec, root, KV_SPACE_GIB, timeout=600)


def greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `prompt` and the float32 logits that chose each."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


@pytest.mark.parametrize("case, prompts", [("mla", PROMPTS), ("mla-tied", TIED_PROMPTS)])
def test_vllm_serves_the_mla_conversion_with_transformers_greedy_tokens(case, prompts, converted, served):
    result = served["cases"][case]
    assert "error" not in result, f"the MLA conversion does not serve in vLLM: {result.get('error')}"
    assert result["architecture"] == "DeepseekV2ForCausalLM"
    full = AutoModelForCausalLM.from_pretrained(converted[case], dtype=torch.float32).eval()
    half = AutoModelForCausalLM.from_pretrained(converted[case], dtype=torch.bfloat16).eval()
    for prompt, tokens in zip(prompts, result["tokens"], strict=True):
        expected, logits = greedy(full, prompt)
        expected_half, logits_half = greedy(half, prompt)
        assert expected_half == expected, prompt  # on the same tokens, so the logits compare step by step
        rounding = (logits - logits_half).abs().max()
        top = logits.topk(2).values
        assert (top[:, 0] - top[:, 1]).min() > 6 * rounding, f"{prompt}: a margin within bfloat16's rounding"
        assert tokens == expected, prompt
    # Not degenerate (one token repeated): equal tokens say something.
    assert len({t for row in result["tokens"] for t in row}) > 3


def test_vllm_caches_the_latent_and_the_rotary_key_once_per_token(served):
    """One cached "head" of R + D = 576 per layer (not the heads' keys and values): the KV space
    holds KV_SPACE_GIB / (layers · 576 · 2 bytes) tokens, in whole blocks."""
    result = served["cases"]["mla"]
    assert list(result["kv_heads"].values()) == [1] * LAYERS, result["kv_heads"]
    block = result["block_size"]
    per_token = LAYERS * (RANK + ROPE_DIMS) * BFLOAT16_BYTES
    assert result["kv_tokens"] == KV_SPACE_GIB * 2**30 // (block * per_token) * block
    # MHA's K and V of the source, in the same space: 2 · heads · 128 = 1024 elements a layer.
    assert result["kv_tokens"] > KV_SPACE_GIB * 2**30 // (LAYERS * 2 * HEADS * HEAD_DIM * BFLOAT16_BYTES)


def test_the_plain_rotary_spelling_still_mispositions_in_vllm(converted, served):
    """Sentinel: `rope_type: default` (the same model in transformers) gives other tokens in vLLM
    0.32's CPU build, whose rotary kernel turns DeepSeek-V2's query rows at the wrong positions."""
    full = AutoModelForCausalLM.from_pretrained(converted["mla-default-rope"], dtype=torch.float32).eval()
    expected = [greedy(full, prompt)[0] for prompt in PROMPTS]
    assert expected == served["cases"]["mla"]["tokens"]  # the same model in transformers
    assert served["cases"]["mla-default-rope"]["tokens"] != expected
