"""`uptrain.speed` on tiny real checkpoints: the cache it measures, the decoding it times, its refusals.

No timing assertions: speed is for the benchmarks (BENCHMARKS.md), not for tests.
"""

from __future__ import annotations

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
