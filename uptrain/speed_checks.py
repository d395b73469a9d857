"""What `uptrain speed` checks before it loads anything: the device, the counts, and each model's
shape (`ModelShape`: its geometry as the conversion reads it, the positions it takes, the cache
it would need), so that a context past a model's positions or a cache that would not fit in free
memory is refused in one line before anything big is allocated."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, architecture, block_positions, deepseek_v2, find_architecture
from uptrain.model_info import DTYPE_BYTES, AttentionGeometry, attention_geometry, read_config

DEFAULT_CONTEXT = 1024  # `uptrain speed --context`'s default: a decoder-only prompt's, a text source's length


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
    """What the refusals need from config.json, read before any weight is loaded.

    An encoder–decoder's `geometry` is its decoder self-attention's and `cross` its
    cross-attention's (the decoder's layers and query heads, the cross-attention's KV heads);
    `max_positions` is then the decoder's, `source_positions` the encoder's, and
    `fixed_source` says the encoder takes only that many (Whisper's 30 s of frames)."""

    label: str
    geometry: AttentionGeometry
    max_positions: int | None  # None: no position table (ALiBi, BLOOM; T5's relative positions)
    cross: AttentionGeometry | None = None  # None: a decoder-only model
    source_positions: int | None = None
    fixed_source: bool = False
    encoder: AttentionGeometry | None = None  # an encoder–decoder's encoder self-attention
    # T5's relative position bias: a [heads, q, k] table built from [q, k] int64 buckets, under
    # every attention implementation (`relative_attention_bias`, a query-head tensor).
    relative_bias: bool = False
    # What config.json asks of transformers (`attn_implementation`); None: its default, SDPA for
    # every family speed measures.
    attn_implementation: str | None = None
    # Multi-head latent attention (DeepSeek-V2): what each layer caches per token, the latent and
    # the shared rotary key (transformers caches those, not the expanded K/V); None: K/V heads.
    latent_elements_per_token: int | None = None

    def source_length(self, context: int | None) -> int:
        """The prompt (source) length to measure at, given the --context asked for (None: the default)."""
        if self.fixed_source:
            if context is not None and context != self.source_positions:
                raise UptrainError(
                    f"{self.label}: its encoder takes exactly {self.source_positions} positions (30 s of "
                    f"audio frames), not --context {context}; drop --context"
                )
            return self.source_positions
        return DEFAULT_CONTEXT if context is None else context

    def check(self, context: int, new_tokens: int, batch: int, dtype: str, device) -> None:
        self.check_positions(context, new_tokens)
        self.check_cache_fits(batch, context, new_tokens, dtype, device, self.attn_implementation)

    def check_positions(self, context: int, new_tokens: int) -> None:
        """Refuse a context the model's position tables do not reach."""
        if self.cross is None and self.max_positions is not None and context + new_tokens > self.max_positions:
            raise UptrainError(
                f"{self.label}: context {context} + new tokens {new_tokens} = {context + new_tokens} "
                f"is beyond the model's {self.max_positions} positions"
            )
        if self.cross is not None:
            if self.source_positions is not None and context > self.source_positions:
                raise UptrainError(
                    f"{self.label}: a source of {context} tokens is beyond the encoder's "
                    f"{self.source_positions} positions"
                )
            if self.max_positions is not None and new_tokens > self.max_positions:
                raise UptrainError(
                    f"{self.label}: {new_tokens} new tokens are beyond the decoder's {self.max_positions} positions"
                )

    def cache_bytes(self, batch: int, context: int, new_tokens: int, dtype: str) -> int:
        """The KV cache a sample fills: decoder-only, N + M positions; an encoder–decoder, M
        self-attention positions and N cross-attention ones (an upper bound by one position)."""
        size = DTYPE_BYTES[dtype]
        if self.latent_elements_per_token is not None:
            per_token = self.geometry.num_layers * self.latent_elements_per_token * size
            return per_token * batch * (context + new_tokens)
        if self.cross is None:
            return self.geometry.kv_cache_bytes_per_token(size) * batch * (context + new_tokens)
        decoder = self.geometry.kv_cache_bytes_per_token(size) * new_tokens
        return batch * (decoder + self.cross.kv_cache_bytes_per_token(size) * context)

    def attention_bytes(self, batch: int, context: int, dtype: str, implementation: str | None) -> int:
        """The most one attention layer holds at once while the prompt (an encoder–decoder's
        source) is read, all N queries against N keys; the decode steps' one query is small beside
        it. Eager attention materialises the scores and their softmax, batch × heads × N × N
        each, and a decoder-only model's additive mask, batch × N × N; the fused kernels (SDPA,
        flash) keep none of them. T5's relative position bias is heads × N × N whatever the
        kernel, built from N × N int64 tables (positions, distances, buckets: four at a time).
        Measured on the shipped reference T5 at N = 4096: a peak of 1.05 GiB, this 0.98 GiB."""
        size = DTYPE_BYTES[dtype]
        heads = (self.encoder or self.geometry).num_heads
        square = context * context
        need = 0
        if implementation == "eager":
            need += batch * square * size * (2 * heads + (1 if self.cross is None else 0))
        if self.relative_bias:
            need += heads * square * size + 4 * square * 8
        return need

    def check_cache_fits(
        self, batch: int, context: int, new_tokens: int, dtype: str, device, implementation: str | None = None
    ) -> None:
        """Refuse a run whose KV cache, with attention's working memory while the prompt is read
        (`attention_bytes`, for the attention `implementation` in use), cannot fit: both follow
        from the geometry, so they are known before a byte is allocated (and an out-of-memory
        kill mid-run tells the user nothing)."""
        cache = self.cache_bytes(batch, context, new_tokens, dtype)
        attention = self.attention_bytes(batch, context, dtype, implementation)
        free = free_memory_bytes(device)
        if free is None or cache + attention <= free:
            return
        if attention > cache:
            raise UptrainError(
                f"{self.label}: attention over a prompt of {context} tokens (batch {batch}) needs "
                f"{attention / 2**30:.2f} GiB, which grows with the square of --context, and the KV cache "
                f"{cache / 2**30:.2f} GiB more: more than the {free / 2**30:.2f} GiB free on {device}; lower --context"
            )
        raise UptrainError(
            f"{self.label}: the KV cache of batch {batch} × {context + new_tokens} positions needs "
            f"{cache / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free on {device}; "
            f"lower --batch or --context"
        )


def model_shape(folder: Path, label: str) -> ModelShape:
    """The attention geometry of a checkpoint (as the conversion reads it: the architecture
    registry's keys) and its position limits. An encoder–decoder's `geometry` is its decoder
    self-attention's (KV heads: a converted checkpoint's `decoder_num_key_value_heads`, else its
    query heads) and `cross` its cross-attention's."""
    config = read_config(folder)
    arch = find_architecture(config.get("model_type"))
    if arch is None and config.get("is_encoder_decoder"):
        arch = architecture(config.get("model_type"))  # one line: the encoder–decoders uptrain reads
    stacks = {} if arch is None else arch.stacks(config)  # every attention's geometry, read once
    implementation = config.get("attn_implementation") or config.get("_attn_implementation")
    implementation = implementation if isinstance(implementation, str) else None
    if "cross" not in stacks:
        # No record: transformers' standard names, as `config_geometry` reads them.
        geometry = attention_geometry(config) if arch is None else stacks[DECODER_SELF].geometry
        latent = None
        if config.get("model_type") == deepseek_v2.MODEL_TYPE:
            latent = deepseek_v2.latent_elements_per_token(config["kv_lora_rank"], config["qk_rope_head_dim"])
        return ModelShape(
            label,
            geometry,
            block_positions(config, label)[0],
            attn_implementation=implementation,
            latent_elements_per_token=latent,
        )
    # Positions as the record names them (GPT-2's n_positions, Whisper's max_target_positions).
    return ModelShape(
        label,
        stacks[DECODER_SELF].geometry,
        arch.target_positions(config, label),
        cross=stacks["cross"].geometry,
        source_positions=arch.source_positions(config, label),
        # Whisper: input features of a fixed length, the positions each cross-attention caches whole.
        fixed_source=arch.source_positions_key is not None,
        encoder=stacks["encoder"].geometry,
        relative_bias=any(site.layout.query_head_tensors for site in arch.sites),
        attn_implementation=implementation,
    )


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
