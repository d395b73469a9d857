"""`uptrain speed --engine vllm`: MHA and each G served in vLLM side by side, in one run.

Run in the cached vLLM environment (tests/modeling/vllm_environment.py), on the tiny Llama of
tests/modeling/test_vllm.py (4 heads of 32) and its G = 2 and G = 1 conversions: the KV
capacity each engine reports in the same space grows exactly h/G-fold, and so does the maximum
concurrency; every model is timed. The same for its tiny Whisper and its G = 1 conversion
(decoder self + cross), served audio: the cross-attention's cache of the encoder's 1500 frames
at G heads. Without vLLM, one line says how to install it; what vLLM cannot serve (T5, BART) or
what makes no sense for Whisper is refused in one line before vLLM is needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from transformers import WhisperFeatureExtractor

from tests.modeling.test_vllm import HEADS, LAYERS, MEL_BINS, tiny_llama, tiny_whisper, tiny_whisper_per_layer
from tests.modeling.vllm_environment import vllm_python
from tests.test_inspect import tiny_whisper as whisper_without_processor
from tests.test_speed import build_seq2seq
from uptrain.cli import main
from uptrain.convert import convert_checkpoint
from uptrain.speed_vllm import format_vllm_table


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_one_line_says_how_to_install_it(tmp_path):
    tiny_llama(tmp_path / "llama")
    result = subprocess.run(
        [sys.executable, "-m", "uptrain", "speed", "--engine", "vllm", str(tmp_path / "llama"), "--context", "16"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "pip install 'uptrain[vllm]'" in result.stderr and "Traceback" not in result.stderr


def test_a_context_beyond_the_positions_is_refused_before_vllm_is_needed(tmp_path):
    tiny_llama(tmp_path / "llama")
    positions = json.loads((tmp_path / "llama" / "config.json").read_text())["max_position_embeddings"]
    result = subprocess.run(
        [sys.executable, "-m", "uptrain", "speed", "--engine", "vllm", str(tmp_path / "llama")]
        + ["--context", str(positions - 1), "--new-tokens", "2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"is beyond the model's {positions} positions" in result.stderr


def refusal(capsys, *argv) -> str:
    """The one line `uptrain speed --engine vllm ARGV` refuses with."""
    capsys.readouterr()
    assert main(["speed", "--engine", "vllm", *map(str, argv)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("uptrain speed: error: ") and "\n" not in error, error
    return error


@pytest.mark.parametrize("model_type", ["t5", "bart"])
def test_encoder_decoders_vllm_does_not_serve_are_refused_naming_why(model_type, tmp_path, capsys):
    build_seq2seq(model_type).save_pretrained(tmp_path / model_type)
    error = refusal(capsys, tmp_path / model_type)
    assert f"vLLM 0.32 does not serve {model_type} (no class for it" in error


def test_what_makes_no_sense_for_whisper_is_refused_before_vllm_is_needed(tmp_path, capsys):
    tiny_whisper(tmp_path / "whisper")  # 1500 frames, 64 decoder positions, its processor
    # --context is the encoder's frames, the only length Whisper's encoder takes.
    assert "its encoder takes exactly 1500 positions" in refusal(capsys, tmp_path / "whisper", "--context", 448)
    # The decoder's start token and the new tokens within its positions.
    error = refusal(capsys, tmp_path / "whisper", "--new-tokens", 64)
    assert "the decoder's start token + 64 new tokens are beyond its 64 positions" in error
    tiny_llama(tmp_path / "llama")
    assert "not both" in refusal(capsys, tmp_path / "llama", tmp_path / "whisper", "--context", 16)
    whisper_without_processor().save_pretrained(tmp_path / "bare")
    assert "no feature extractor loads from it" in refusal(capsys, tmp_path / "bare", "--new-tokens", 8)


def speed_rows(tmp_path, models, *flags: str) -> list[dict]:
    """`uptrain speed --engine vllm MODELS FLAGS --json` in the vLLM environment: one row a model."""
    python = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "VLLM_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    command = [str(python), "-m", "uptrain", "speed", "--engine", "vllm", *map(str, models), *flags, "--json"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_speed_in_vllm_reports_mha_and_each_g_side_by_side(tmp_path):
    """Also: every batch, the warm-up's too, reads fresh prompts in full. vLLM's prefix cache (on
    by default) keeps a prompt's whole blocks (128 positions on CPU): had a timed batch repeated
    an earlier batch's prompts of 250 tokens, it would be served 128 of each from it, and its
    time would be decode and a cached prefill, not a request's."""
    tiny_llama(tmp_path / "llama-g4", positions=256)
    models = [tmp_path / "llama-g4"]
    for g in (2, 1):
        models.append(convert_checkpoint(tmp_path / "llama-g4", tmp_path / f"llama-g{g}", g, progress=False))
    flags = ["--context", "250", "--new-tokens", "6", "--batch", "2", "--repeats", "2", "--kv-cache-gib", "1"]
    rows = speed_rows(tmp_path, models, *flags)
    assert [r["num_kv_heads"] for r in rows] == [4, 2, 1]
    mha = rows[0]
    for r in rows:
        assert r["kv_cache_tokens"] == mha["kv_cache_tokens"] * HEADS // r["num_kv_heads"]
        # A request of 250 + 6 positions takes whole blocks of the cache.
        assert r["kv_tokens_per_request"] == 250 + 6 and r["block_size"] < 250
        assert r["max_concurrency"] == r["kv_cache_tokens"] / r["block_size"] / -(-256 // r["block_size"])
        assert r["time_per_sample_s"] > 0 and r["output_tokens_per_s"] == 2 * 6 / r["time_per_sample_s"]
        # vLLM's own count of each request's prompt tokens served from its prefix cache, summed
        # over the warm-up and both timed batches.
        assert r["prefix_cached_tokens"] == 0


@pytest.mark.slow
def test_speed_in_vllm_serves_whisper_audio_and_its_cross_attention_cache_holds_g_heads(tmp_path):
    """vLLM caches each decoder layer's self- and cross-attention in blocks of one pool, each
    position K and V of G heads: in the same space a G = 1 conversion (decoder self + cross)
    holds h/G times MHA's positions, and a request holds its 1500 frames and its decoder's."""
    tiny_whisper(tmp_path / "whisper-g4")
    # Its processor's files with no processor class named (as scripts/make_whisper_base.py writes
    # them): the feature extractor's own file beside the tokenizer's, which vLLM's Whisper must
    # still load as a WhisperProcessor for a whisper_gqa conversion (the plugin names the class).
    (tmp_path / "whisper-g4" / "processor_config.json").unlink()
    WhisperFeatureExtractor(feature_size=MEL_BINS).save_pretrained(tmp_path / "whisper-g4")
    tokenizer = json.loads((tmp_path / "whisper-g4" / "tokenizer_config.json").read_text())
    del tokenizer["processor_class"]
    (tmp_path / "whisper-g4" / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    g1 = convert_checkpoint(
        tmp_path / "whisper-g4", tmp_path / "whisper-g1", 1, attention="decoder-self,cross", progress=False
    )
    flags = ["--new-tokens", "8", "--batch", "2", "--repeats", "1", "--kv-cache-gib", "1"]
    rows = speed_rows(tmp_path, [tmp_path / "whisper-g4", g1], *flags)
    assert [(r["num_kv_heads"], r["cross_attention_num_kv_heads"]) for r in rows] == [(4, 4), (1, 1)]
    # float32 K and V of each decoder layer (self and cross share a position's bytes), 4 heads of 32.
    mha = 2**30 // (2 * LAYERS * HEADS * 32 * 4)
    assert [r["kv_cache_tokens"] for r in rows] == [mha, mha * HEADS]
    for r in rows:
        assert (r["context"], r["audio_seconds"], r["kv_tokens_per_request"]) == (1500, 30, 1500 + 1 + 8)
        blocks = -(-1500 // r["block_size"]) + -(-(1 + 8) // r["block_size"])  # cross's and self's
        assert r["max_concurrency"] == r["kv_cache_tokens"] / r["block_size"] / blocks
        assert r["time_per_sample_s"] > 0 and r["output_tokens_per_s"] == 2 * 8 / r["time_per_sample_s"]
    table = format_vllm_table(rows)
    assert "30 s of audio (1500 encoder frames" in table and " 4.00 " in table.splitlines()[-1]


def test_max_concurrency_refuses_what_cannot_work_in_one_line_before_vllm_is_needed(tmp_path, capsys):
    tiny_llama(tmp_path / "llama")
    llama = tmp_path / "llama"
    assert "unknown concurrency 'often'; choose from batch, max" in refusal(capsys, llama, "--concurrency", "often")
    # max sets each model's requests itself.
    error = refusal(capsys, llama, "--concurrency", "max", "--batch", 4)
    assert "as many requests as its KV cache holds, not --batch 4: drop --batch" in error
    # transformers decodes a batch; the requests its cache holds are vLLM's.
    capsys.readouterr()
    assert main(["speed", str(llama), "--concurrency", "max", "--context", "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "--concurrency max is --engine vllm's" in error, error
    # A space under one request's K and V: float32, 2 layers × 4 heads of 32, K and V, 32 + 8 positions.
    one_request = 2 * LAYERS * HEADS * 32 * 4 * (32 + 8)
    flags = ["--concurrency", "max", "--context", 32, "--new-tokens", 8, "--dtype", "float32"]
    error = refusal(capsys, llama, *flags, "--kv-cache-gib", (one_request - 1) / 2**30)
    assert f"one request of 40 positions fills {one_request / 2**20:.2f} MiB of KV cache (float32)" in error
    assert "give a larger --kv-cache-gib" in error
    # A Whisper whose decoder layers differ in KV heads: vLLM keeps their caches in pools apart.
    tiny_whisper_per_layer(tmp_path / "whisper")
    error = refusal(capsys, tmp_path / "whisper", "--concurrency", "max", "--new-tokens", 8)
    assert "self- and cross-attention caches differ in KV heads" in error and "--concurrency batch" in error


# The reference Llama (8 heads of 32, 6 layers) served at max concurrency: MHA, G = 2 (a quarter
# of its KV bytes) and a per-layer conversion (17 of MHA's 48 KV heads), in a KV space of exactly
# 5 of MHA's blocks (float32: 128 positions × 2 × 48 heads × 32 × 4 bytes = 1.5 MiB a block).
SERVED_HEADS = {"mha": [8] * 6, "g2": [2] * 6, "per-layer": [8, 4, 2, 1, 1, 1]}
CAPACITY_BLOCK = 128 * 2 * 48 * 32 * 4
CAPACITY_SPACE = 5 * CAPACITY_BLOCK


@pytest.mark.slow
def test_max_concurrency_gives_each_model_the_requests_its_kv_bytes_hold(tmp_path):
    """Each model gets, and vLLM runs at once, the requests whole blocks of its own KV bytes hold
    (summed layer by layer), less vLLM's null block; G = 2 has 4 times MHA's blocks."""
    from uptrain.demo import REFERENCE

    models = [
        REFERENCE,
        convert_checkpoint(REFERENCE, tmp_path / "g2", 2, progress=False),
        convert_checkpoint(
            REFERENCE, tmp_path / "per-layer", kv_heads_per_layer=SERVED_HEADS["per-layer"], progress=False
        ),
    ]
    # A request of 120 + 8 positions: one block of 128.
    flags = ["--concurrency", "max", "--context", "120", "--new-tokens", "8", "--repeats", "1"]
    rows = speed_rows(tmp_path, models, *flags, "--kv-cache-gib", str(CAPACITY_SPACE / 2**30), "--dtype", "float32")
    assert [r["kv_heads_per_layer"] for r in rows] == [None, None, SERVED_HEADS["per-layer"]]
    expected = {}
    for r, (case, heads) in zip(rows, SERVED_HEADS.items()):
        assert r["block_size"] == 128 and r["kv_tokens_per_request"] == 120 + 8
        blocks = CAPACITY_SPACE // (128 * 2 * sum(heads) * 32 * 4)  # float32 K and V of each layer's heads
        assert r["kv_cache_tokens"] == blocks * 128
        expected[case] = blocks - 1  # one block a request; vLLM keeps one block empty
        assert r["requests"] == r["batch"] == expected[case], case
        # vLLM ran them all at once, none evicted and recomputed.
        assert (r["in_flight"], r["preemptions"]) == (expected[case], 0), case
        assert r["output_tokens_per_s"] == r["requests"] * 8 / r["time_per_sample_s"]
    # MHA: 5 blocks, 4 requests; G = 2: 20 blocks, 19 requests; 17 heads: 14 blocks, 13 requests.
    assert expected == {"mha": 4, "g2": 19, "per-layer": 13}
    table = format_vllm_table(rows)
    assert " 8,4,2,1,1,1 " in table and "as many sequences at once as each KV cache" in table


@pytest.mark.slow
def test_max_concurrency_refuses_a_space_whose_whole_blocks_hold_no_request(tmp_path):
    """Two of MHA's blocks: a request of 248 + 8 positions fits their bytes (no refusal before
    vLLM), but takes both blocks, and vLLM keeps one empty."""
    from uptrain.demo import REFERENCE

    flags = ["--concurrency", "max", "--context", "248", "--new-tokens", "8", "--dtype", "float32"]
    command = [str(vllm_python()), "-m", "uptrain", "speed", "--engine", "vllm", str(REFERENCE), *flags]
    command += ["--kv-cache-gib", str(2 * CAPACITY_BLOCK / 2**30)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "VLLM_"))}
    result = subprocess.run(command, env=env | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and error.startswith("uptrain speed: error: "), result.stderr[-2000:]
    assert "vLLM finds no room for one request of 256 positions in --kv-cache-gib 0.00292969" in error
    assert "give a larger --kv-cache-gib" in error
