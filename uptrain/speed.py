"""`uptrain speed`: what a checkpoint's number of KV heads buys at inference, measured.

The GQA paper's speed metric is time per sample: the prompt, then greedy new tokens with the
KV cache (Table 1, Fig. 3 and 6). Decoding reads the whole cache at every step, so the gain of
fewer KV heads appears once the cache, not the weights, dominates the bytes read per step:
long contexts and large batches (docs/concepts/kv_cache.md). Prefill alone costs MHA and GQA the same
attention FLOPs, so it is timed apart.

Every figure is measured on the real run: the cache's bytes are summed from its tensors after
the run, memory is the process's (CPU) or the allocator's (GPU) peak. Several checkpoints are
measured in alternation (one sample of each in turn), so a noisy moment on a shared machine
hits them all alike. What cannot run is refused with one line before anything big is
allocated: a context past the model's positions, a cache that would not fit in free memory.

Encoder–decoders (T5, BART and its family, Whisper; plain or `*_gqa`) are timed as the paper
times T5: the source (N random token ids, or Whisper's input features: its encoder takes
exactly 30 s of frames) is encoded once, then M tokens are decoded greedily from the decoder's
start token with both caches, the decoder self-attention's (M positions) and the
cross-attention's (the encoder's N positions, projected once at the first step). Their bytes
are summed from both caches' tensors: the cross-attention cache, N positions long at every
step, is where GQA in cross-attention pays.
"""

from __future__ import annotations

import inspect
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError, loading
from uptrain.architecture import auto_class_name
from uptrain.checkpoint.source import resolve_source
from uptrain.model_info import read_config
from uptrain.options import Schema, option
from uptrain.speed_checks import DEFAULT_CONTEXT, check_counts, model_shape, parse_device

DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("transformers", "vllm")
# `--engine vllm`'s requests at once: a fixed number, or as many as each model's KV cache holds.
CONCURRENCIES = {
    "batch": "--batch requests, the same for every model",
    "max": "as many requests as each model's KV cache (--kv-cache-gib) holds, all submitted at once: "
    "what its capacity buys in throughput",
}


@dataclass(kw_only=True)
class SpeedOptions(Schema):
    """`uptrain speed`: the options of `measure_speed`, as flags."""

    models: list[str] = option(
        positional=True,
        metavar="MODEL",
        help="checkpoint folders or Hub ids, converted or not; measured in alternation, one sample of each in turn",
    )
    context: int | None = option(
        None,
        at_least=1,
        help=f"prompt (encoder–decoders: source) length N in tokens, random token ids: speed does not depend on "
        f"them (default: {DEFAULT_CONTEXT}; Whisper: its encoder's positions, the only length it takes)",
    )
    new_tokens: int = option(
        32,
        at_least=2,
        help="tokens M generated greedily after the prompt, with the KV cache; the first comes from the prompt's pass",
    )
    batch: int = option(1, at_least=1, help="sequences B decoded together")
    dtype: str | None = option(
        None, choices=DTYPES, help="weights and cache dtype (default: float32 on CPU, bfloat16 on CUDA)"
    )
    device: str = option("cpu", metavar="cpu|cuda[:N]", help="where the models run")
    repeats: int = option(
        3, at_least=1, help="timed samples per model after one warm-up; medians are reported, with min and max"
    )
    compile: bool = option(
        False,
        help="GPU only: also time a static cache with torch.compile'd decode steps (compile time reported apart); "
        "--engine vllm: vLLM's torch.compile'd model, its serving default (else eager), on CPU or GPU",
    )
    engine: str = option(
        "transformers",
        choices=ENGINES,
        help="what serves the models: transformers (this process's forward) or vllm (a vLLM engine per model, "
        "`uptrain[vllm]`: throughput at --batch sequences at once, or --concurrency max, KV capacity vLLM reports)",
    )
    kv_cache_gib: float = option(
        1.0, help="--engine vllm: the KV-cache space each engine gets, the same for all, in GiB"
    )
    concurrency: str = option(
        "batch",
        choices=CONCURRENCIES,
        help="--engine vllm: how many requests each model is given at once",
    )
    json: bool = option(False, help="one JSON object per model, for scripts")


PROMPT_SEED = 0


def measure_speed(
    models: list[str | Path],
    *,
    context: int | None = None,
    new_tokens: int = 32,
    batch: int = 1,
    dtype: str | None = None,
    device: str = "cpu",
    repeats: int = 3,
    compile: bool = False,
) -> list[dict]:
    """Measure greedy decoding of each checkpoint in `models`; one result dict per model, in order.

    Options (the `uptrain speed` flags):
      models       checkpoint folders or Hub ids, converted or not (native GQA architectures and
                   uptrain's *_gqa ones); measured in alternation, one sample of each in turn
      context      prompt length N in tokens; the prompt is random token ids (speed does not
                   depend on them); an encoder–decoder's source length (default: 1024; Whisper:
                   its encoder's positions, the only length its encoder takes)
      new_tokens   tokens M generated greedily after the prompt, with the KV cache; the first
                   comes from the prompt's pass, each other one from one decode step, at least 2
                   (default: 32)
      batch        sequences B decoded together (default: 1)
      dtype        weights and cache: float32, bfloat16 or float16 (default: float32 on CPU,
                   bfloat16 on CUDA)
      device       cpu, cuda or cuda:N (default: cpu)
      repeats      timed samples per model after one warm-up sample; medians are reported, with
                   min and max (default: 3)
      compile      GPU only: also time the served fast path, a static cache and torch.compile'd
                   decode steps; compilation time is reported apart (default: off)

    Each result holds: model, num_kv_heads (an encoder–decoder's: its decoder self-attention's;
    None for multi-head latent attention, whose cache is a latent and a shared rotary key),
    cross_attention_num_kv_heads (None for a decoder-only model), context, new_tokens, batch,
    dtype, device, repeats; prefill_s (the N-token prompt's pass; an encoder–decoder's encoding
    of the source and its first decoder step), decode_s_per_token (one decode step for all B
    sequences), time_per_sample_s (prompt + M tokens), decode_tokens_per_s (B / decode step);
    spread (min and max over the repeats of each of those four); kv_cache_bytes (summed from
    the cache's tensors after a sample: N + M - 1 positions; an encoder–decoder's, both caches:
    M self-attention positions and N cross-attention ones), cross_attention_cache_bytes (that
    share of kv_cache_bytes; None for a decoder-only model); peak_memory_bytes (the warm-up
    sample's peak over the memory held before it: process RSS on CPU, allocated CUDA memory on
    GPU); compiled (None, or the same timings, kv_cache_bytes and compile_s with --compile).
    """
    torch_device, dtype, sources, shapes, contexts = _checked_models(
        models,
        context=context,
        new_tokens=new_tokens,
        batch=batch,
        dtype=dtype,
        device=device,
        repeats=repeats,
        compile=compile,
    )
    loaded = {s.label: load_model(s.folder, dtype, torch_device) for s in sources}
    for shape in shapes:  # again, now that the weights hold their share, with the attention they load with
        implementation = loaded[shape.label].config._attn_implementation
        shape.check_cache_fits(batch, contexts[shape.label], new_tokens, dtype, torch_device, implementation)
    measured = measure_models(
        loaded,
        context=contexts,
        new_tokens=new_tokens,
        batch=batch,
        repeats=repeats,
        device=torch_device,
        compile=compile,
    )
    return [
        {
            "model": shape.label,
            # A latent-attention model caches no K/V heads: its cache is the latent (kv_cache_bytes).
            "num_kv_heads": None if shape.latent_elements_per_token is not None else shape.geometry.num_kv_heads,
            "cross_attention_num_kv_heads": None if shape.cross is None else shape.cross.num_kv_heads,
            "context": contexts[shape.label],
            "new_tokens": new_tokens,
            "batch": batch,
            "dtype": dtype,
            "device": str(torch_device),
            "repeats": repeats,
            **measured[shape.label],
        }
        for shape in shapes
    ]


def _checked_models(models, *, context, new_tokens, batch, dtype, device, repeats, compile):
    """The cheap refusals of `measure_speed`, before anything is loaded: its options, each
    model's shape and the context it takes. Returns (device, dtype, sources, shapes, contexts)."""
    torch_device = parse_device(device, compile)
    dtype = dtype or ("float32" if torch_device.type == "cpu" else "bfloat16")
    if dtype not in DTYPES:
        raise UptrainError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    asked = {} if context is None else {"context": context}  # None: each model's default
    check_counts(new_tokens=new_tokens, batch=batch, repeats=repeats, **asked)
    if not models:
        raise UptrainError("give at least one checkpoint to measure")
    sources = [resolve_source(m) for m in models]
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):
        twice = next(label for label in labels if labels.count(label) > 1)
        raise UptrainError(f"{twice} is given twice: measure each checkpoint once (--repeats samples it again)")
    shapes = [model_shape(s.folder, s.label) for s in sources]
    contexts = {shape.label: shape.source_length(context) for shape in shapes}
    for shape in shapes:  # cheap refusals first: nothing is loaded yet
        shape.check(contexts[shape.label], new_tokens, batch, dtype, torch_device)
    if compile and any(shape.cross is not None for shape in shapes):
        raise UptrainError(
            "--compile times decoder-only models' static-cache path; drop it for encoder–decoders "
            "(their dynamic-cache decoding is timed without it)"
        )
    return torch_device, dtype, sources, shapes, contexts


def load_model(folder: str | Path, dtype: str, device):
    """A checkpoint as transformers loads it, with its Auto class (causal LM, seq2seq LM or
    speech seq2seq), on `device`, in eval mode."""
    import torch

    import uptrain.modeling  # noqa: F401  registers the *_gqa architectures with the Auto classes

    auto = auto_class_name(read_config(folder))
    model = loading.load_model(folder, "checkpoint", auto, dtype=getattr(torch, dtype), device_map=str(device))
    return model.eval()


def measure_models(
    models: dict,
    *,
    context: int | dict[str, int],
    new_tokens: int,
    batch: int,
    repeats: int,
    device,
    compile: bool = False,
) -> dict[str, dict]:
    """Time loaded models on the same random prompt: one warm-up sample each (which also gives
    the peak memory), then `repeats` samples taken in turn, model after model. `context` is one
    prompt length for all, or one per name. Returns, per name, the measurement keys of
    `measure_speed`'s results."""
    import torch

    contexts = context if isinstance(context, dict) else dict.fromkeys(models, context)
    check_counts(new_tokens=new_tokens, batch=batch, repeats=repeats)
    for length in contexts.values():
        check_counts(context=length)
    device = torch.device(device)
    samples: dict[str, list[Sample]] = {name: [] for name in models}
    peaks: dict[str, int | None] = {}
    with torch.inference_mode():
        prompts = {name: random_prompt(model, batch, contexts[name], device) for name, model in models.items()}
        for name, model in models.items():
            with PeakMemory(device) as peak:
                greedy_sample(model, prompts[name], new_tokens, device)
            peaks[name] = peak.bytes
        for _ in range(repeats):
            for name, model in models.items():  # in turn, so a noisy moment hits every model
                samples[name].append(greedy_sample(model, prompts[name], new_tokens, device))
        results = {
            name: {
                **summarise(samples[name], batch),
                "kv_cache_bytes": samples[name][-1].kv_cache_bytes,
                "cross_attention_cache_bytes": samples[name][-1].cross_attention_cache_bytes,
                "peak_memory_bytes": peaks[name],
                "compiled": None,
            }
            for name in models
        }
        if compile:
            for name, model in models.items():
                results[name]["compiled"] = measure_compiled(model, prompts[name], new_tokens, repeats, device)
    return results


def random_prompt(model, batch: int, context: int, device):
    """Random token ids [batch, context]; for a speech encoder–decoder, random input features
    [batch, mel bins, frames] of the length its encoder takes (`context` is its positions, each
    two frames: Whisper's convolution halves the frames)."""
    import torch

    generator = torch.Generator().manual_seed(PROMPT_SEED)
    config = model.config
    if config.is_encoder_decoder and getattr(config, "num_mel_bins", None):
        frames = context * 2
        features = torch.randn((batch, config.num_mel_bins, frames), generator=generator)
        return features.to(device=device, dtype=model.dtype)
    return torch.randint(0, config.vocab_size, (batch, context), generator=generator).to(device)


@dataclass
class Sample:
    prefill_s: float
    decode_step_s: list[float]
    tokens: object  # [batch, new_tokens] generated ids
    kv_cache_bytes: int
    cross_attention_cache_bytes: int | None = None  # the cross-attention's share (encoder–decoders)

    @property
    def time_per_sample_s(self) -> float:
        return self.prefill_s + sum(self.decode_step_s)


def greedy_sample(model, prompt, new_tokens: int, device, cache=None, decode=None) -> Sample:
    """The prompt's pass, then `new_tokens - 1` greedy decode steps with the cache (transformers'
    DynamicCache unless `cache` is given), each timed on its own and synchronised on a GPU.
    `decode` replaces the model's forward for the decode steps (the compiled path).

    An encoder–decoder's prompt is its source: the encoder runs once, and its output is then
    given to every decoder step, the first of which (from the decoder's start token) is timed
    with the encoding as the prompt's pass and fills the cross-attention cache."""
    import torch
    from transformers import DynamicCache, EncoderDecoderCache

    seq2seq = model.config.is_encoder_decoder
    if cache is None:
        # Layers are made as the decoder's are reached: a T5 config's layer count is the encoder's.
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache()) if seq2seq else DynamicCache(config=model.config)
    cache_kw = cache_argument(model)
    decode = decode or model
    synchronize(device)
    start = time.perf_counter()
    if seq2seq:
        source = "input_features" if prompt.is_floating_point() else "input_ids"
        encoded = {"encoder_outputs": model.get_encoder()(**{source: prompt})}
        first = torch.full((prompt.shape[0], 1), decoder_start_token(model), dtype=torch.long, device=prompt.device)
        logits = model(decoder_input_ids=first, use_cache=True, **encoded, **{cache_kw: cache}).logits
    else:
        # logits_to_keep=1: the prompt's full [batch, context, vocab] logits would cost more memory than the cache.
        encoded = {}
        logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_kw: cache}).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    prefill_s = time.perf_counter() - start
    tokens, steps = [token], []
    step_input = "decoder_input_ids" if seq2seq else "input_ids"
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        if decode is not model:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are consumed
        logits = decode(**{step_input: token}, use_cache=True, **encoded, **{cache_kw: cache}).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        steps.append(time.perf_counter() - start)
        tokens.append(token)
    cross = cache.cross_attention_cache if isinstance(cache, EncoderDecoderCache) else None
    return Sample(
        prefill_s,
        steps,
        torch.cat(tokens, dim=1),
        kv_cache_bytes(cache),
        None if cross is None else kv_cache_bytes(cross),
    )


def decoder_start_token(model) -> int:
    """The token an encoder–decoder's decoding starts from: its generation config's, else its
    config's, else the pad token (T5's convention)."""
    for config in (model.generation_config, model.config):
        if getattr(config, "decoder_start_token_id", None) is not None:
            return int(config.decoder_start_token_id)
    return int(model.config.pad_token_id or 0)


def cache_argument(model) -> str:
    """The forward's cache keyword: `cache` in recent transformers 5.x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(output):
    """The cache a forward returned: `output.cache` in recent transformers 5.x, `past_key_values` before."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def kv_cache_bytes(cache) -> int:
    """Bytes the cache's tensors hold, K and V of every layer (of both caches of an
    encoder–decoder, self- and cross-attention): measured, not computed."""
    from transformers import EncoderDecoderCache

    if isinstance(cache, EncoderDecoderCache):
        return kv_cache_bytes(cache.self_attention_cache) + kv_cache_bytes(cache.cross_attention_cache)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarise(samples: list[Sample], batch: int) -> dict:
    """Medians over the samples, each with its min and max as the spread; tokens/s is
    batch / decode_s_per_token, for the median and for each bound alike."""
    per_sample = {
        "prefill_s": [s.prefill_s for s in samples],
        "decode_s_per_token": [statistics.fmean(s.decode_step_s) for s in samples],
        "time_per_sample_s": [s.time_per_sample_s for s in samples],
    }
    result = {k: statistics.median(v) for k, v in per_sample.items()}
    spread = {k: {"min": min(v), "max": max(v)} for k, v in per_sample.items()}
    decode = spread["decode_s_per_token"]
    result["decode_tokens_per_s"] = batch / result["decode_s_per_token"]
    spread["decode_tokens_per_s"] = {"min": batch / decode["max"], "max": batch / decode["min"]}
    return {**result, "spread": spread}


def measure_compiled(model, prompt, new_tokens: int, repeats: int, device) -> dict:
    """The served fast path: a static cache (fixed shapes, so decode steps compile once) and
    the decode step torch.compile'd with CUDA graphs. The prompt's pass stays eager, as in
    transformers' generate. The two warm-up samples (compilation, then graph capture) are
    timed together as compile_s, apart from the timed repeats."""
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + new_tokens)
    decode = torch.compile(model.forward, mode="reduce-overhead")
    start = time.perf_counter()
    for _ in range(2):
        cache.reset()
        greedy_sample(model, prompt, new_tokens, device, cache=cache, decode=decode)
    compile_s = time.perf_counter() - start
    samples = []
    for _ in range(repeats):
        cache.reset()
        samples.append(greedy_sample(model, prompt, new_tokens, device, cache=cache, decode=decode))
    return {**summarise(samples, prompt.shape[0]), "kv_cache_bytes": samples[-1].kv_cache_bytes, "compile_s": compile_s}


class PeakMemory:
    """Peak memory of the enclosed code over what was held when it began.

    GPU: the CUDA allocator's peak. CPU: the process's resident peak (VmHWM, reset at the start
    through /proc/self/clear_refs). Freed heap memory is first handed back to the OS
    (malloc_trim): otherwise the run reuses pages already resident and its peak reads too low.
    `bytes` is None where neither is available (not Linux).
    """

    def __init__(self, device):
        self.device, self.bytes, self._start = device, None, None

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        from uptrain.convert.calibration import release_freed_memory

        release_freed_memory()  # freed heap pages would hide the run's own
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self._start = _status_kib("VmRSS") * 1024
        except (OSError, AttributeError):
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self._start is None:
            return
        if self.device.type == "cuda":
            synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device)) - self._start
        else:
            self.bytes = max(0, _status_kib("VmHWM") * 1024 - self._start)


def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if found is None:
        raise AttributeError(field)
    return int(found.group(1))


def spread_cell(measured: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """One table cell: a measured median and its spread, `median (min–max)`, each times `scale`."""
    spread = measured["spread"][key]
    return f"{measured[key] * scale:{fmt}} ({spread['min'] * scale:{fmt}}–{spread['max'] * scale:{fmt}})"


def format_table(title: str, columns: tuple[tuple[str, int], ...], rows: list[tuple]) -> str:
    """A table for people: `title`, a header of `columns` (heading, width), a rule, then one line
    per row of formatted cells. The first column (the model) is left-aligned and keeps the last
    `width` characters of a longer name; the others are right-aligned."""
    widths = [width for _, width in columns]

    def line(cells) -> str:
        name, *rest = (str(cell) for cell in cells)
        return " ".join([f"{name[-widths[0] :]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))])

    header = line(heading for heading, _ in columns)
    return "\n".join([title, header, "-" * len(header), *(line(row) for row in rows)])


SPEED_COLUMNS = (
    ("model", 32),
    ("G", 3),
    ("prefill s", 9),
    ("decode ms/token", 21),
    ("tokens/s", 9),
    ("time/sample s", 22),
    ("KV cache MiB", 12),
    ("peak MiB", 9),
)


def format_speed_table(results: list[dict]) -> str:
    """The results of `measure_speed` as a table for people."""
    if not results:
        return ""
    first = results[0]
    title = (
        f"greedy decoding: context {first['context']}, {first['new_tokens']} new tokens, batch {first['batch']}, "
        f"{first['device']} {first['dtype']}, median of {first['repeats']} (min–max)"
    )
    rows = []
    for r in results:
        timings = [(r["model"], r)] + ([(r["model"] + " (compiled)", r["compiled"])] if r.get("compiled") else [])
        for name, m in timings:
            peak = r["peak_memory_bytes"] if m is r else None
            rows.append(
                (
                    name,
                    "MLA" if r["num_kv_heads"] is None else r["num_kv_heads"],
                    f"{m['prefill_s']:.3f}",
                    spread_cell(m, "decode_s_per_token", ".2f", scale=1e3),
                    f"{m['decode_tokens_per_s']:.1f}",
                    spread_cell(m, "time_per_sample_s", ".3f"),
                    f"{m['kv_cache_bytes'] / 2**20:.2f}",
                    "-" if peak is None else f"{peak / 2**20:.1f}",
                )
            )
    lines = [format_table(title, SPEED_COLUMNS, rows)]
    if any(r.get("compiled") for r in results):
        lines.append(
            "compile time (apart from the timings): "
            + ", ".join(f"{r['model']} {r['compiled']['compile_s']:.1f} s" for r in results if r["compiled"])
        )
    return "\n".join(lines)
