"""`uptrain.speed` on tiny real checkpoints: the cache it measures, the decoding it times, its refusals.

No timing assertions: speed is for the benchmarks (BENCHMARKS.md), not for tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.convert import tiny_models
from tests.modeling import classic_models
from uptrain import UptrainError
from uptrain.convert import convert_checkpoint
from uptrain.speed import PeakMemory, format_speed_table, greedy_sample, load_model, measure_speed, random_prompt

HEADS, HEAD_DIM, LAYERS = 8, 8, 2
GROUPS = (4, 2, 1)
RESULT_KEYS = {
    "model",
    "num_kv_heads",
    "context",
    "new_tokens",
    "batch",
    "dtype",
    "device",
    "repeats",
    "prefill_s",
    "decode_s_per_token",
    "time_per_sample_s",
    "decode_tokens_per_s",
    "spread",
    "kv_cache_bytes",
    "peak_memory_bytes",
    "compiled",
    "cross_attention_num_kv_heads",  # None for decoder-only models
    "cross_attention_cache_bytes",
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_with_conversions(model, folder: Path, groups=GROUPS) -> dict[int, Path]:
    """The MHA checkpoint and its conversions to each G, by number of KV heads."""
    model.save_pretrained(folder / "mha")
    paths = {HEADS: folder / "mha"}
    for g in groups:
        paths[g] = convert_checkpoint(folder / "mha", folder / f"g{g}", g, progress=False)
    return paths


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict[int, Path]:
    return save_with_conversions(tiny_models.build_model("llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> dict[int, Path]:
    return save_with_conversions(classic_models.build("gpt2"), tmp_path_factory.mktemp("gpt2"))


def llama_with_positions(folder: Path, positions: int) -> Path:
    config = AutoConfig.for_model("llama", **dict(tiny_models.COMMON, max_position_embeddings=positions))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_cache_bytes_are_h_over_g_times_less(family, request):
    paths = request.getfixturevalue(family)
    context, new_tokens, batch = 8, 3, 2
    results = measure_speed(
        [str(paths[g]) for g in (HEADS, *GROUPS)], context=context, new_tokens=new_tokens, batch=batch, repeats=1
    )
    by_g = {r["num_kv_heads"]: r for r in results}
    assert set(by_g) == {HEADS, *GROUPS} and [r["model"] for r in results] == [str(paths[g]) for g in (HEADS, *GROUPS)]
    # The cache after a sample holds the prompt and every new token but the last (never fed back).
    mha_bytes = 2 * LAYERS * HEADS * HEAD_DIM * 4 * batch * (context + new_tokens - 1)
    assert by_g[HEADS]["kv_cache_bytes"] == mha_bytes
    for g in GROUPS:
        assert by_g[g]["kv_cache_bytes"] * (HEADS // g) == mha_bytes, g
    for r in results:
        assert set(r) == RESULT_KEYS and r["compiled"] is None
        assert r["cross_attention_num_kv_heads"] is None and r["cross_attention_cache_bytes"] is None
        assert (r["context"], r["new_tokens"], r["batch"], r["dtype"], r["device"]) == (8, 3, 2, "float32", "cpu")
        assert r["decode_tokens_per_s"] == pytest.approx(batch / r["decode_s_per_token"])
        for key in ("prefill_s", "decode_s_per_token", "time_per_sample_s", "decode_tokens_per_s"):
            assert 0 < r["spread"][key]["min"] <= r[key] <= r["spread"][key]["max"] < math.inf, key
        assert r["peak_memory_bytes"] is None or r["peak_memory_bytes"] >= 0
    table = format_speed_table(results).splitlines()
    assert len(table) == 3 + len(results) and all(str(paths[g])[-32:] in "\n".join(table) for g in paths)


def no_cache_greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding the slow way: the whole sequence through the model for every token."""
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            token = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
    return ids[:, prompt.shape[1] :]


@pytest.mark.parametrize("model_type", ["llama", *classic_models.ARCHITECTURES])
def test_timed_decoding_is_greedy_decoding(model_type, tmp_path):
    """What the timings measure is real decoding with the cache: the tokens equal a no-cache loop's,
    on each architecture after conversion (uptrain's *_gqa modeling for the classic ones)."""
    build = tiny_models.build_model if model_type == "llama" else classic_models.build
    mha = build(model_type)
    with torch.no_grad():  # 20× the initial weights: each next token depends on the context, so a broken cache shows
        for p in mha.parameters():
            if p.dim() >= 2:
                p.mul_(20)
    mha.save_pretrained(tmp_path / "mha")
    convert_checkpoint(tmp_path / "mha", tmp_path / "gqa", 2, progress=False)
    model = load_model(tmp_path / "gqa", "float32", torch.device("cpu"))
    assert model.config.num_key_value_heads == 2
    prompt = random_prompt(model, batch=2, context=6, device=torch.device("cpu"))
    with torch.inference_mode():
        sample = greedy_sample(model, prompt, 4, torch.device("cpu"))
    assert len(sample.decode_step_s) == 3
    assert sample.tokens.tolist() == no_cache_greedy(model, prompt, 4).tolist()


def test_static_cache_decoding_is_greedy_decoding(llama):
    """The --compile path's decoding (a static cache, reset between samples; a compiled decode step)
    gives the same tokens as the dynamic cache's. TorchDynamo with its eager backend stands in for
    inductor and CUDA graphs here: it traces the same graph, in seconds."""
    from transformers import StaticCache

    cpu = torch.device("cpu")
    model = load_model(llama[2], "float32", cpu)
    prompt = random_prompt(model, batch=2, context=6, device=cpu)
    cache = StaticCache(config=model.config, max_cache_len=6 + 4)
    decode = torch.compile(model.forward, backend="eager")
    with torch.inference_mode():
        expected = greedy_sample(model, prompt, 4, cpu).tokens.tolist()
        for _ in range(2):
            cache.reset()
            assert greedy_sample(model, prompt, 4, cpu, cache=cache, decode=decode).tokens.tolist() == expected


def assert_one_line_refusal(call, pattern: str) -> None:
    with PeakMemory(torch.device("cpu")) as peak, pytest.raises(UptrainError, match=pattern) as err:
        call()
    assert "\n" not in str(err.value)
    # Refused before the cache (or any model) is allocated: a refusal costs next to no memory.
    assert peak.bytes is None or peak.bytes < 64 * 2**20, peak.bytes


def test_refuses_a_context_beyond_the_positions(llama, gpt2):
    # Llama's max_position_embeddings and GPT-2's n_positions are both 64 in the tiny configs.
    for folder in (llama[2], gpt2[2]):
        assert_one_line_refusal(
            lambda folder=folder: measure_speed([folder], context=60, new_tokens=8),
            r"context 60 \+ new tokens 8 = 68 is beyond the model's 64 positions",
        )
    measure_speed([llama[2]], context=60, new_tokens=4, repeats=1)  # exactly the positions: runs


def test_refuses_a_cache_beyond_free_memory(tmp_path):
    folder = llama_with_positions(tmp_path / "long", 2**40)
    # 2 layers × 8 heads × 8 dims × 2 (K, V) × 4 bytes = 1 KiB a position: 10^6 × 10^5 positions is ~100 TB.
    assert_one_line_refusal(
        lambda: measure_speed([folder], context=100_000, new_tokens=2, batch=1_000_000),
        r"KV cache of batch 1000000 × 100002 positions needs .* GiB, more than the .* GiB free",
    )


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"compile": True}, "--compile needs a CUDA device"),
        ({"device": "tpu"}, "--device 'tpu': use cpu, cuda or cuda:N"),
        ({"new_tokens": 1}, "--new-tokens must be a whole number ≥ 2"),
        ({"batch": 0}, "--batch must be a whole number ≥ 1"),
        ({"dtype": "int8"}, "--dtype 'int8' is not one of"),
    ],
)
def test_refuses_bad_options(llama, options, pattern):
    assert_one_line_refusal(lambda: measure_speed([llama[2]], **{"context": 8, **options}), re.escape(pattern))


def test_refuses_a_checkpoint_given_twice(llama):
    assert_one_line_refusal(lambda: measure_speed([llama[2], llama[4], llama[2]], context=8), "given twice")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resident-peak reset is Linux-only")
def test_peak_memory_holds_the_cache(tmp_path):
    folder = llama_with_positions(tmp_path / "long", 512)
    [result] = measure_speed([folder], context=256, new_tokens=2, batch=16, repeats=1)
    assert result["kv_cache_bytes"] == 1024 * 16 * 257  # 4 MiB: well above allocator noise
    assert result["peak_memory_bytes"] >= result["kv_cache_bytes"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resident-peak reset is Linux-only")
def test_peak_memory_is_the_enclosed_code_s_own():
    with PeakMemory(torch.device("cpu")) as busy:
        buffer = torch.ones(8 * 2**20)  # 32 MiB, every page touched
        del buffer
    with PeakMemory(torch.device("cpu")) as idle:  # the peak before it began is not its own
        pass
    assert busy.bytes > 30 * 2**20 and idle.bytes < 4 * 2**20, (busy.bytes, idle.bytes)


def test_the_speed_command_measures_every_model_given(llama, capsys):
    from uptrain.cli import main

    argv = ["speed", str(llama[8]), str(llama[2]), "--context", "8", "--new-tokens", "3", "--repeats", "1", "--json"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["num_kv_heads"] for r in rows] == [8, 2]
    assert rows[0]["kv_cache_bytes"] == 4 * rows[1]["kv_cache_bytes"]
    assert all(r["context"] == 8 and r["new_tokens"] == 3 and r["time_per_sample_s"] > 0 for r in rows)
    assert main(["speed", str(llama[8]), "--context", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "beyond the model's" in err[0]


ALL_ARCHITECTURES = [("native", a) for a in tiny_models.ARCHITECTURES] + [
    ("classic", a) for a in classic_models.ARCHITECTURES
]


@pytest.mark.parametrize(("kind", "model_type"), ALL_ARCHITECTURES, ids=[a for _, a in ALL_ARCHITECTURES])
def test_every_architecture_is_measured_with_a_cache_h_over_g_smaller(kind, model_type, tmp_path):
    """Every supported architecture, native or `*_gqa`: measured, and its cache really holds G heads."""
    build = tiny_models.build_model if kind == "native" else classic_models.build
    paths = save_with_conversions(build(model_type), tmp_path, groups=(2,))
    mha, gqa = measure_speed([str(paths[HEADS]), str(paths[2])], context=6, new_tokens=2, batch=1, repeats=1)
    assert (mha["num_kv_heads"], gqa["num_kv_heads"]) == (HEADS, 2)
    assert mha["kv_cache_bytes"] > 0 and mha["kv_cache_bytes"] == (HEADS // 2) * gqa["kv_cache_bytes"]
    assert all(r["time_per_sample_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in (mha, gqa))


# Encoder–decoders: 8 heads of 8 dims in the decoder, 2 decoder layers, as above.
SEQ2SEQ_CONFIGS = {
    "t5": dict(
        vocab_size=128,
        d_model=48,  # d_kv is independent of d_model / heads in T5
        d_kv=HEAD_DIM,
        num_heads=HEADS,
        num_layers=1,
        num_decoder_layers=LAYERS,
        d_ff=64,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    ),
    "bart": dict(
        vocab_size=128,
        d_model=HEADS * HEAD_DIM,
        encoder_layers=1,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    ),
    "whisper": dict(
        vocab_size=128,
        d_model=HEADS * HEAD_DIM,
        encoder_layers=1,
        decoder_layers=LAYERS,
        encoder_attention_heads=4,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=12,
        max_target_positions=16,
        num_mel_bins=8,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=3,
    ),
}
# UMT5: T5's geometry, with a position bias in every self-attention layer (two encoder layers, so
# that the encoder's second one has its own too).
SEQ2SEQ_CONFIGS["umt5"] = {**SEQ2SEQ_CONFIGS["t5"], "num_layers": LAYERS}


def build_seq2seq(model_type: str, **overrides):
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    config = AutoConfig.for_model(model_type, **{**SEQ2SEQ_CONFIGS[model_type], **overrides})
    torch.manual_seed(0)
    auto = AutoModelForSpeechSeq2Seq if model_type == "whisper" else AutoModelForSeq2SeqLM
    return auto.from_config(config).eval()


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    for model_type in SEQ2SEQ_CONFIGS:
        build_seq2seq(model_type).save_pretrained(root / model_type)
    return {model_type: root / model_type for model_type in SEQ2SEQ_CONFIGS}


@pytest.mark.parametrize("model_type", list(SEQ2SEQ_CONFIGS))
def test_encoder_decoder_cache_holds_both_attentions(model_type, seq2seq):
    """The source is encoded once; the cache holds M self-attention positions and the encoder's N
    cross-attention positions, every decoder layer, all 8 heads (MHA): measured from both caches."""
    context = None if model_type == "whisper" else 10
    new_tokens, batch = 3, 2
    [r] = measure_speed([seq2seq[model_type]], context=context, new_tokens=new_tokens, batch=batch, repeats=1)
    source = 12 if model_type == "whisper" else 10  # Whisper: its encoder's positions, the only length it takes
    per_position = 2 * LAYERS * HEADS * HEAD_DIM * 4 * batch
    assert r["context"] == source and (r["num_kv_heads"], r["cross_attention_num_kv_heads"]) == (HEADS, HEADS)
    assert r["cross_attention_cache_bytes"] == per_position * source
    assert r["kv_cache_bytes"] == per_position * (source + new_tokens)
    assert set(r) == RESULT_KEYS
    assert r["time_per_sample_s"] > r["prefill_s"] > 0 and r["decode_tokens_per_s"] > 0


def no_cache_seq2seq_greedy(model, prompt: torch.Tensor, new_tokens: int, start: int) -> torch.Tensor:
    """Greedy decoding the slow way: source and every decoder token so far through the whole model."""
    source = "input_features" if prompt.is_floating_point() else "input_ids"
    ids = torch.full((prompt.shape[0], 1), start)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(**{source: prompt}, decoder_input_ids=ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, 1:]


def _umt5_sees_later_tokens() -> bool:
    """transformers' own UMT5 before its self-attention layer built its attention with
    `is_causal` (5.17 does not; 5.24 does) gives SDPA no causal mask for the decoder's
    self-attention when no mask is passed: its uncached decoding sees later tokens, so it
    disagrees with its cached decoding."""
    import inspect

    from transformers.models.umt5.modeling_umt5 import UMT5LayerSelfAttention

    return "is_causal" not in inspect.getsource(UMT5LayerSelfAttention.__init__)


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(
            t,
            marks=[pytest.mark.xfail(_umt5_sees_later_tokens(), reason="transformers' UMT5 is not causal", strict=True)]
            if t == "umt5"
            else [],
        )
        for t in SEQ2SEQ_CONFIGS
    ],
)
def test_timed_encoder_decoder_decoding_is_greedy_decoding(model_type, tmp_path):
    """Encoding once and decoding with both caches gives the tokens of the no-cache loop: the
    timings measure real decoding."""
    from uptrain.speed import decoder_start_token

    model = build_seq2seq(model_type)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # large weights: each next token depends on the context, so a broken cache shows
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    model.save_pretrained(tmp_path / "model")
    model = load_model(tmp_path / "model", "float32", torch.device("cpu"))
    prompt = random_prompt(model, batch=2, context=12 if model_type == "whisper" else 7, device=torch.device("cpu"))
    with torch.inference_mode():
        sample = greedy_sample(model, prompt, 5, torch.device("cpu"))
    expected = no_cache_seq2seq_greedy(model, prompt, 5, decoder_start_token(model))
    assert sample.tokens.tolist() == expected.tolist()
    assert len(set(expected.flatten().tolist())) > 2  # not one token repeated: the check can fail


@pytest.mark.parametrize(
    ("model_type", "options", "pattern"),
    [
        ("bart", {"context": 65}, "a source of 65 tokens is beyond the encoder's 64 positions"),
        ("whisper", {"new_tokens": 17}, "17 new tokens are beyond the decoder's 16 positions"),
        ("whisper", {"context": 100}, "encoder takes exactly 12 positions (30 s of audio frames), not --context 100"),
        ("t5", {"context": 8, "compile": True}, "--compile needs a CUDA device"),
    ],
)
def test_encoder_decoder_refusals(model_type, options, pattern, seq2seq):
    assert_one_line_refusal(lambda: measure_speed([seq2seq[model_type]], **options), re.escape(pattern))


def test_encoder_decoder_cache_beyond_free_memory(seq2seq):
    # T5 has relative positions (no limit): memory alone stops a huge source or batch.
    assert_one_line_refusal(
        lambda: measure_speed([seq2seq["t5"]], context=10, new_tokens=2, batch=10**12),
        r"the KV cache of batch 1000000000000 × 12 positions needs .* GiB",
    )


@pytest.mark.parametrize("model_type", ["t5", "umt5"])
def test_a_t5_source_whose_attention_cannot_fit_is_refused(model_type, seq2seq):
    """T5's relative position bias is heads × N × N (from N × N int64 buckets) under every
    attention kernel: --context 100000 asked for ~400 GB, a cache of a few MB beside it. It was
    allocated, and ended in a traceback (issue #34)."""
    assert_one_line_refusal(
        lambda: measure_speed([seq2seq[model_type]], context=100_000, new_tokens=2),
        r"attention over a prompt of 100000 tokens \(batch 1\) needs .* GiB, which grows with the square of "
        r"--context, and the KV cache .* GiB more: more than the .* GiB free on cpu; lower --context",
    )


@pytest.mark.parametrize("model_type", ["llama", "bart", "whisper", "t5"])
def test_eager_attention_counts_its_scores(model_type, seq2seq, tmp_path):
    """Eager attention holds batch × heads × N × N scores and their softmax while the prompt is
    read (a decoder-only model its N × N mask too); the fused kernels none. Checked with the
    implementation the loaded model reports, before its first forward."""
    from uptrain.speed_checks import model_shape

    folder = llama_with_positions(tmp_path / "long", 2**40) if model_type == "llama" else seq2seq[model_type]
    shape = model_shape(folder, model_type)
    heads = (shape.encoder or shape.geometry).num_heads
    n, batch, size = 1000, 3, 4
    scores = batch * n * n * size * (2 * heads + (1 if shape.cross is None else 0))
    bias = heads * n * n * size + 4 * n * n * 8 if model_type == "t5" else 0
    assert shape.attention_bytes(batch, n, "float32", "eager") == scores + bias
    assert shape.attention_bytes(batch, n, "float32", "sdpa") == bias
    cpu = torch.device("cpu")
    context = 30_000_000 if model_type == "llama" else 100_000
    shape = dataclasses.replace(shape, source_positions=None, fixed_source=False)  # no position limit in the way
    shape.check_cache_fits(1, 200, 2, "float32", cpu, "eager")  # small: fits
    with pytest.raises(UptrainError, match=r"attention over a prompt of .* lower --context") as err:
        shape.check_cache_fits(1, context, 2, "float32", cpu, "eager")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model_type", list(SEQ2SEQ_CONFIGS))
def test_converted_encoder_decoder_caches_shrink_exactly_h_over_g(model_type, seq2seq, tmp_path):
    """Converted (*_gqa, the decoder's self- and cross-attention by default), both caches hold G heads."""
    paths = {HEADS: seq2seq[model_type]}
    for g in GROUPS:
        paths[g] = convert_checkpoint(seq2seq[model_type], tmp_path / f"g{g}", g, progress=False)
    context = None if model_type == "whisper" else 10
    results = measure_speed([paths[g] for g in paths], context=context, new_tokens=3, batch=2, repeats=1)
    by_g = {r["num_kv_heads"]: r for r in results}
    mha = by_g[HEADS]
    for g in GROUPS:
        assert by_g[g]["cross_attention_num_kv_heads"] == g
        assert by_g[g]["kv_cache_bytes"] * (HEADS // g) == mha["kv_cache_bytes"], g
        assert by_g[g]["cross_attention_cache_bytes"] * (HEADS // g) == mha["cross_attention_cache_bytes"], g
    # Only the decoder self-attention converted: the cross-attention cache keeps its 8 heads.
    self_only = convert_checkpoint(seq2seq[model_type], tmp_path / "self", 2, attention="decoder-self", progress=False)
    [r] = measure_speed([self_only], context=context, new_tokens=3, batch=2, repeats=1)
    assert (r["num_kv_heads"], r["cross_attention_num_kv_heads"]) == (2, HEADS)
    assert r["cross_attention_cache_bytes"] == mha["cross_attention_cache_bytes"]
    assert (r["kv_cache_bytes"] - r["cross_attention_cache_bytes"]) * 4 == (
        mha["kv_cache_bytes"] - mha["cross_attention_cache_bytes"]
    )


def test_the_cache_of_per_layer_kv_heads_is_summed_layer_by_layer(tmp_path):
    """What `uptrain speed` checks and reports of a conversion with per-layer KV heads: each layer's
    own cache, summed (not layers × the largest), read from config.json without loading the model."""
    from tests.modeling.classic_models import build as build_classic
    from uptrain.cli import main
    from uptrain.speed_checks import model_shape

    build_classic("gpt2").save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--kv-heads-per-layer", "4,1"]) == 0
    shape = model_shape(tmp_path / "out", "per-layer")
    assert shape.geometry.kv_heads_per_layer == (4, 1)
    assert shape.cache_bytes(batch=3, context=10, new_tokens=2, dtype="float16") == 2 * (4 + 1) * 8 * 2 * 3 * 12
