"""Converted encoder–decoder checkpoints load with plain Auto classes and compute what the
source computes: at G = h bit for bit, with identical heads in each group losslessly (through
`uptrain convert`, the real pipeline), and `generate()` with the cache (G heads in both the
self- and the cross-attention cache) equals generation without it. T5, UMT5 and the BART-style
M2M100 (NLLB) and Pegasus, their biases, norms and position biases moved off their initial values
so that pooling them is tested."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

import uptrain.modeling  # noqa: F401  registers t5_gqa, …: plain Auto classes load the outputs
from uptrain.convert import convert_checkpoint
from uptrain.speed import output_cache

T5_SHAPE = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4)
T5_IDS = dict(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
# BART-style, 4 heads of 8 dims each side, as T5_SHAPE.
BART_SHAPE = dict(
    vocab_size=64,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=32,
)
# M2M100 counts its positions from the padding token, so the decoder must not start with it
# (with the cache, positions come from the cache's length instead): its own ids.
M2M100_IDS = dict(decoder_start_token_id=2, pad_token_id=1, bos_token_id=0, eos_token_id=2)
ARCHITECTURES = {
    "t5": lambda: T5ForConditionalGeneration(T5Config(**T5_SHAPE, **T5_IDS)),
    "t5-v1.1": lambda: T5ForConditionalGeneration(
        T5Config(**T5_SHAPE, **T5_IDS, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    ),
    "mt5": lambda: MT5ForConditionalGeneration(MT5Config(**T5_SHAPE, **T5_IDS)),
    "umt5": lambda: UMT5ForConditionalGeneration(UMT5Config(**T5_SHAPE, **T5_IDS, tie_word_embeddings=False)),
    "m2m_100": lambda: M2M100ForConditionalGeneration(M2M100Config(**BART_SHAPE, **M2M100_IDS)),
    "pegasus": lambda: PegasusForConditionalGeneration(PegasusConfig(**BART_SHAPE, **T5_IDS)),
}
# The GQA class each converts to where it is not T5's (UMT5: its own, a position bias in every layer).
GQA_CLASS = {
    "umt5": "UMT5GQAForConditionalGeneration",
    "m2m_100": "M2M100GQAForConditionalGeneration",
    "pegasus": "PegasusGQAForConditionalGeneration",
}


def build(name: str):
    """The architecture's model (seed 0), its biases and norms randomised (fresh: zeros and ones),
    T5's position biases moved off their init too."""
    torch.manual_seed(0)
    model = ARCHITECTURES[name]().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("bias") or "norm" in key or "relative_attention_bias" in key:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def inputs(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(2, vocab, (2, 7), generator=g),
        "decoder_input_ids": torch.randint(2, vocab, (2, 5), generator=g),
    }


def kv_modules(model):
    """Every K/V projection of the model's attentions (T5: `k`, `v`; the others `k_proj`, `v_proj`)."""
    return [m for name, m in model.named_modules() if name.endswith((".k", ".v", ".k_proj", ".v_proj"))]


def identical_heads_within_groups(model, heads: int, groups: int) -> None:
    """Make each group's K/V heads (weights and biases) copies of its first, so pooling them loses nothing."""
    per = heads // groups
    with torch.no_grad():
        for module in kv_modules(model):
            for p in (module.weight, module.bias):
                if p is None:
                    continue
                w = p.view(heads, -1, *p.shape[1:])
                for g in range(groups):
                    w[g * per : (g + 1) * per] = w[g * per].clone()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_g_equal_h_is_the_source_bit_for_bit(name, tmp_path):
    source = build(name)
    source.save_pretrained(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 4, progress=False)
    converted = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(converted).__name__ == GQA_CLASS.get(name, "T5GQAForConditionalGeneration")
    batch = inputs(source.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(converted(**batch).logits, source(**batch).logits)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_identical_heads_pool_losslessly_and_the_caches_hold_g_heads(name, tmp_path):
    source = build(name)
    identical_heads_within_groups(source, 4, 2)
    source.save_pretrained(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 2, progress=False)
    converted = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    batch = inputs(source.config.vocab_size)
    with torch.no_grad():
        expected = source(**batch).logits
        got = converted(**batch, use_cache=True)
    torch.testing.assert_close(got.logits, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    cache = output_cache(got)
    assert cache.self_attention_cache.layers[0].keys.shape[1] == 2
    assert cache.cross_attention_cache.layers[0].keys.shape[1] == 2
    # The encoder was not chosen (default --attention decoder-self,cross): its K/V keep 4 heads.
    assert kv_modules(converted.get_encoder())[0].weight.shape[0] == 4 * 8
    with torch.no_grad():
        cached = converted.generate(batch["input_ids"], max_new_tokens=6, do_sample=False)
        uncached = converted.generate(batch["input_ids"], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_the_feature_extractor_and_sentencepiece_files_travel_with_the_weights(tmp_path):
    """A Whisper checkpoint's preprocessor_config.json (its feature extractor, which speech
    training and transcription read) and Marian's source/target .spm files are copied byte for byte."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        decoder_start_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
    )
    WhisperForConditionalGeneration(config).save_pretrained(tmp_path / "src")
    WhisperFeatureExtractor(feature_size=8).save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "source.spm").write_bytes(b"\x00sentencepiece model bytes")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 2, progress=False)
    for name in ("preprocessor_config.json", "source.spm"):
        assert (out / name).read_bytes() == (tmp_path / "src" / name).read_bytes()
    assert WhisperFeatureExtractor.from_pretrained(out).feature_size == 8
