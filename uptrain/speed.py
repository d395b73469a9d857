"""`uptrain speed`: what a checkpoint's number of KV heads buys at inference, measured.

The GQA paper's speed metric is time per sample: the prompt, then greedy new tokens with the
KV cache (Table 1, Fig. 3 and 6). Decoding reads the whole cache at every step, so the gain of
fewer KV heads appears once the cache, not the weights, dominates the bytes read per step:
long contexts and large batches (docs/DOMAIN.md §2). Prefill alone costs MHA and GQA the same
attention FLOPs, so it is timed apart.

Every figure is measured on the real run: the cache's bytes are summed from its tensors after
the run, memory is the process's (CPU) or the allocator's (GPU) peak. Several checkpoints are
measured in alternation (one sample of each in turn), so a noisy moment on a shared machine
hits them all alike. What cannot run is refused with one line before anything big is
allocated: a context past the model's positions, a cache that would not fit in free memory.
"""

from __future__ import annotations

import inspect
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError
from uptrain.checkpoint.source import resolve_source
from uptrain.convert.layouts import config_geometry
from uptrain.model_info import DTYPE_BYTES, AttentionGeometry, read_config
from uptrain.options import Schema, option

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class SpeedOptions(Schema):
    """`uptrain speed`: the options of `measure_speed`, as flags."""

    models: list[str] = option(
        positional=True,
        metavar="MODEL",
        help="checkpoint folders or Hub ids, converted or not; measured in alternation, one sample of each in turn",
    )
    context: int = option(
        1024, at_least=1, help="prompt length N in tokens (random token ids: speed does not depend on them)"
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
        False, help="GPU only: also time a static cache with torch.compile'd decode steps (compile time reported apart)"
    )
    json: bool = option(False, help="one JSON object per model, for scripts")


TIMINGS = ("prefill_s", "decode_s_per_token", "time_per_sample_s", "decode_tokens_per_s")
PROMPT_SEED = 0


def measure_speed(
    models: list[str | Path],
    *,
    context: int = 1024,
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
                   depend on them) (default: 1024)
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

    Each result holds: model, num_kv_heads, context, new_tokens, batch, dtype, device, repeats;
    prefill_s (the N-token prompt's pass), decode_s_per_token (one decode step for all B
    sequences), time_per_sample_s (prompt + M tokens), decode_tokens_per_s (B / decode step);
    spread (min and max over the repeats of each of those four); kv_cache_bytes (summed from
    the cache's tensors after a sample: N + M - 1 positions); peak_memory_bytes (the warm-up
    sample's peak over the memory held before it: process RSS on CPU, allocated CUDA memory on
    GPU); compiled (None, or the same timings, kv_cache_bytes and compile_s with --compile).
    """
    torch_device = parse_device(device, compile)
    dtype = dtype or ("float32" if torch_device.type == "cpu" else "bfloat16")
    if dtype not in DTYPES:
        raise UptrainError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_counts(context=context, new_tokens=new_tokens, batch=batch, repeats=repeats)
    if not models:
        raise UptrainError("give at least one checkpoint to measure")
    sources = [resolve_source(m) for m in models]
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):
        twice = next(label for label in labels if labels.count(label) > 1)
        raise UptrainError(f"{twice} is given twice: measure each checkpoint once (--repeats samples it again)")
    shapes = [model_shape(s.folder, s.label) for s in sources]
    for shape in shapes:  # cheap refusals first: nothing is loaded yet
        shape.check(context, new_tokens, batch, dtype, torch_device)
    loaded = {s.label: load_model(s.folder, dtype, torch_device) for s in sources}
    for shape in shapes:  # again, now that the weights hold their share of the memory
        shape.check_cache_fits(batch, context + new_tokens, dtype, torch_device)
    measured = measure_models(
        loaded,
        context=context,
        new_tokens=new_tokens,
        batch=batch,
        repeats=repeats,
        device=torch_device,
        compile=compile,
    )
    return [
        {
            "model": shape.label,
            "num_kv_heads": shape.geometry.num_kv_heads,
            "context": context,
            "new_tokens": new_tokens,
            "batch": batch,
            "dtype": dtype,
            "device": str(torch_device),
            "repeats": repeats,
            **measured[shape.label],
        }
        for shape in shapes
    ]


def parse_device(device: str, compile: bool = False):
    import torch

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UptrainError(f"--device {device!r}: use cpu, cuda or cuda:N")
    if compile and device == "cpu":
        raise UptrainError(
            "--compile needs a CUDA device (static cache + torch.compile is the GPU serving path); "
            "drop --compile or pass --device cuda"
        )
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            raise UptrainError(f"--device {device}: torch sees no CUDA GPU here")
        if (torch_device.index or 0) >= torch.cuda.device_count():
            raise UptrainError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch_device


def check_counts(**counts: int) -> None:
    least = {"new_tokens": 2}  # the prompt's pass gives the first token; a decode step needs a second
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < least.get(name, 1):
            raise UptrainError(
                f"--{name.replace('_', '-')} must be a whole number ≥ {least.get(name, 1)} (got {value!r})"
            )


@dataclass(frozen=True)
class ModelShape:
    """What the refusals need from config.json, read before any weight is loaded."""

    label: str
    geometry: AttentionGeometry
    max_positions: int | None  # None: no position table (ALiBi, BLOOM)

    def check(self, context: int, new_tokens: int, batch: int, dtype: str, device) -> None:
        if self.max_positions is not None and context + new_tokens > self.max_positions:
            raise UptrainError(
                f"{self.label}: context {context} + new tokens {new_tokens} = {context + new_tokens} "
                f"is beyond the model's {self.max_positions} positions"
            )
        self.check_cache_fits(batch, context + new_tokens, dtype, device)

    def check_cache_fits(self, batch: int, positions: int, dtype: str, device) -> None:
        """Refuse a cache that cannot fit: its size follows from the geometry, so it is known
        before a byte is allocated (and an out-of-memory kill mid-run tells the user nothing)."""
        need = self.geometry.kv_cache_bytes_per_token(DTYPE_BYTES[dtype]) * batch * positions
        free = free_memory_bytes(device)
        if free is not None and need > free:
            raise UptrainError(
                f"{self.label}: the KV cache of batch {batch} × {positions} positions needs "
                f"{need / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free on {device}; "
                f"lower --batch or --context"
            )


def model_shape(folder: Path, label: str) -> ModelShape:
    config = read_config(folder)
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise UptrainError(f"{label}: config.json's number of positions is {limit!r}, not a whole number")
    return ModelShape(label, config_geometry(config), limit)


def free_memory_bytes(device) -> int | None:
    """Memory a new allocation can take now: CUDA's free memory, or MemAvailable on Linux
    (None elsewhere: the check is skipped rather than guessed)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def load_model(folder: str | Path, dtype: str, device):
    """A checkpoint as transformers loads it, on `device`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    import uptrain.modeling  # noqa: F401  registers the *_gqa architectures with the Auto classes

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), device_map=str(device))
    return model.eval()


def measure_models(
    models: dict, *, context: int, new_tokens: int, batch: int, repeats: int, device, compile: bool = False
) -> dict[str, dict]:
    """Time loaded models on the same random prompt: one warm-up sample each (which also gives
    the peak memory), then `repeats` samples taken in turn, model after model. Returns, per
    name, the measurement keys of `measure_speed`'s results."""
    import torch

    check_counts(context=context, new_tokens=new_tokens, batch=batch, repeats=repeats)
    device = torch.device(device)
    samples: dict[str, list[Sample]] = {name: [] for name in models}
    peaks: dict[str, int | None] = {}
    with torch.inference_mode():
        prompts = {name: random_prompt(model, batch, context, device) for name, model in models.items()}
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
    import torch

    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, model.config.vocab_size, (batch, context), generator=generator).to(device)


@dataclass
class Sample:
    prefill_s: float
    decode_step_s: list[float]
    tokens: object  # [batch, new_tokens] generated ids
    kv_cache_bytes: int

    @property
    def time_per_sample_s(self) -> float:
        return self.prefill_s + sum(self.decode_step_s)


def greedy_sample(model, prompt, new_tokens: int, device, cache=None, decode=None) -> Sample:
    """The prompt's pass, then `new_tokens - 1` greedy decode steps with the cache (transformers'
    DynamicCache unless `cache` is given), each timed on its own and synchronised on a GPU.
    `decode` replaces the model's forward for the decode steps (the compiled path)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    cache_kw = cache_argument(model)
    decode = decode or model
    synchronize(device)
    start = time.perf_counter()
    # logits_to_keep=1: the prompt's full [batch, context, vocab] logits would cost more memory than the cache.
    logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_kw: cache}).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    prefill_s = time.perf_counter() - start
    tokens, steps = [token], []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        if decode is not model:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are consumed
        logits = decode(input_ids=token, use_cache=True, **{cache_kw: cache}).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        steps.append(time.perf_counter() - start)
        tokens.append(token)
    return Sample(prefill_s, steps, torch.cat(tokens, dim=1), kv_cache_bytes(cache))


def cache_argument(model) -> str:
    """The forward's cache keyword: `cache` in recent transformers 5.x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(output):
    """The cache a forward returned: `output.cache` in recent transformers 5.x, `past_key_values` before."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def kv_cache_bytes(cache) -> int:
    """Bytes the cache's tensors hold, K and V of every layer: measured, not computed."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


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


def format_speed_table(results: list[dict]) -> str:
    """The results of `measure_speed` as a table for people."""
    if not results:
        return ""
    first = results[0]
    title = (
        f"greedy decoding: context {first['context']}, {first['new_tokens']} new tokens, batch {first['batch']}, "
        f"{first['device']} {first['dtype']}, median of {first['repeats']} (min–max)"
    )
    header = (
        f"{'model':<32} {'G':>3} {'prefill s':>9} {'decode ms/token':>21} {'tokens/s':>9} "
        f"{'time/sample s':>22} {'KV cache MiB':>12} {'peak MiB':>9}"
    )
    lines = [title, header, "-" * len(header)]
    for r in results:
        rows = [(r["model"], r)] + ([(r["model"] + " (compiled)", r["compiled"])] if r.get("compiled") else [])
        for name, m in rows:
            spread = m["spread"]
            decode = (
                f"{m['decode_s_per_token'] * 1e3:.2f} ({spread['decode_s_per_token']['min'] * 1e3:.2f}–"
                f"{spread['decode_s_per_token']['max'] * 1e3:.2f})"
            )
            total = (
                f"{m['time_per_sample_s']:.3f} ({spread['time_per_sample_s']['min']:.3f}–"
                f"{spread['time_per_sample_s']['max']:.3f})"
            )
            peak = r["peak_memory_bytes"] if m is r else None
            lines.append(
                f"{name[-32:]:<32} {r['num_kv_heads']:>3} {m['prefill_s']:>9.3f} {decode:>21} "
                f"{m['decode_tokens_per_s']:>9.1f} {total:>22} {m['kv_cache_bytes'] / 2**20:>12.2f} "
                f"{'-' if peak is None else f'{peak / 2**20:.1f}':>9}"
            )
    if any(r.get("compiled") for r in results):
        lines.append(
            "compile time (apart from the timings): "
            + ", ".join(f"{r['model']} {r['compiled']['compile_s']:.1f} s" for r in results if r["compiled"])
        )
    return "\n".join(lines)
