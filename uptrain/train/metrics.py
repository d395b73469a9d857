"""Metric arithmetic (FLOPs per token, MFU, memory) and the metrics.jsonl log.

Metric names are fixed (configs, docs and dashboards rely on them):
train/loss, train/lr, train/grad_norm, train/tokens_seen, eval/loss, eval/perplexity,
perf/tokens_per_second (speech runs: perf/clips_per_second too), perf/step_time_s, perf/mfu,
perf/peak_memory_bytes, model/num_kv_heads, model/kv_cache_bytes_per_token, for encoder–decoders
model/cross_kv_cache_bytes_per_source_token, and for multi-head latent attention model/kv_lora_rank and
model/qk_rope_head_dim.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, config_geometry, deepseek_v2, find_architecture
from uptrain.objectives import Objective

# Dense bf16 tensor-core peaks per device, FLOP/s, from the vendors' datasheets. Longer names
# first, so "H100 PCIe" is not read as "H100" and "L40S" not as "L4".
PEAK_FLOPS = {
    "GH200": 989e12,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def default_peak_flops(device: torch.device) -> float | None:
    """The known peak of the current GPU, or None (CPUs and unknown GPUs: no perf/mfu)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return PEAK_FLOPS[key]
    return None


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters that cost FLOPs per token: all but the input embedding lookup (a tied
    embedding is also the output projection, so it stays)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is embed
    return total if tied else total - embed.numel()


def train_flops_per_token(num_params: int, num_layers: int, attn_width: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token of a causal decoder: 6·N + 6·L·(H·Q)·T.

    6·N is the matmuls (N non-embedding parameters, 2 FLOPs per multiply-add, backward twice
    the forward). Attention's scores (Q·Kᵀ) and values (A·V) cost 2·2·H·Q·T per token per layer
    forward against T keys, hence PaLM's 6N + 12·L·H·Q·T (Appendix B), which counts every key.
    A causal mask leaves each token only the keys up to its own position, (T + 1)/2 on average,
    and causal kernels (FlashAttention, SDPA's is_causal) skip the rest, so the attention term
    is halved: 6·L·H·Q·T, as FlashAttention's benchmarks and Megatron-LM count it. Counting
    the full term would overstate MFU (~8% at hidden 2048 × 22 layers, seq 2048). GQA does not
    change the attention term: every query head still attends over the same keys.
    """
    return 6.0 * num_params + 6.0 * num_layers * attn_width * seq_len


def forward_flops_per_token(num_params: int, num_layers: int, attn_width: int, seq_len: int) -> float:
    """Forward-only FLOPs per token (a frozen teacher): a third of the training cost."""
    return train_flops_per_token(num_params, num_layers, attn_width, seq_len) / 3.0


# Where an encoder–decoder's encoder parameters live: the task model's (T5, `model.` of BART,
# Marian, Whisper) and the base model's names.
ENCODER_PREFIXES = ("encoder.", "model.encoder.")


@dataclass(frozen=True)
class EncoderDecoderCost:
    """What an encoder–decoder's FLOPs per example depend on: the non-embedding parameters of
    each stack and the width (query heads × head_dim) of each attention.

    `decoder_params` includes the output projection (it acts on decoder positions only, tied or
    not) and excludes the cross-attention's K and V projections, `cross_kv_params`, which act on
    the encoder's outputs. Every lookup table (token and position embeddings, T5's relative
    attention bias) is left out: a lookup costs no multiply-add.
    """

    encoder_params: int
    decoder_params: int
    cross_kv_params: int
    encoder_layers: int
    encoder_width: int
    decoder_layers: int
    decoder_width: int
    cross_width: int

    def train_flops(self, source_len: int, target_len: int) -> float:
        """Forward + backward FLOPs of one example: `source_len` (S) encoder positions, `target_len`
        (T) decoder positions. With N_e, N_d, N_x the three parameter counts, L_e, L_d the layers
        and W_e, W_d, W_x the widths of the encoder, decoder self- and cross-attention:

            S · (6·(N_e + N_x) + 12·L_e·W_e·S)  +  T · (6·N_d + 6·L_d·W_d·T + 12·L_d·W_x·S)

        Derivation, as `train_flops_per_token` counts a decoder (2 FLOPs per multiply-add, the
        backward pass twice the forward, so 6 per parameter per position it acts on):
        - the encoder's matmuls act on each of the S positions: 6·N_e·S; the cross-attention's K
          and V projections act on the encoder's S outputs, once per example, not per decoder
          position: 6·N_x·S;
        - encoder self-attention is bidirectional: each of the S queries scores all S keys and
          mixes their values, 2·2·W_e·S FLOPs forward per layer, 12·L_e·W_e·S trained;
        - the rest of the decoder acts on each of the T positions: 6·N_d·T;
        - decoder self-attention is causal: T/2 keys per query on average, 6·L_d·W_d·T per
          position (what causal kernels compute; see `train_flops_per_token`);
        - cross-attention has no mask: each of the T queries reads all S encoder positions,
          12·L_d·W_x·S per position.
        GQA changes only N (fewer K/V rows); the attention terms count query heads.
        """
        s, t = source_len, target_len
        encoder = s * (
            6.0 * (self.encoder_params + self.cross_kv_params) + 12.0 * self.encoder_layers * self.encoder_width * s
        )
        decoder = t * (
            6.0 * self.decoder_params
            + 6.0 * self.decoder_layers * self.decoder_width * t
            + 12.0 * self.decoder_layers * self.cross_width * s
        )
        return encoder + decoder

    def forward_flops(self, source_len: int, target_len: int) -> float:
        """Forward-only FLOPs of one example (a frozen teacher): a third of `train_flops`."""
        return self.train_flops(source_len, target_len) / 3.0


def encoder_decoder_cost(model: torch.nn.Module, model_config: dict) -> EncoderDecoderCost:
    """The parameter counts of `model` (counted before accelerate wraps or shards it) and the
    attention widths of its config.json, `model_config` (any encoder–decoder of the architecture
    registry, source or converted `_gqa`)."""
    model_type = model_config.get("model_type")
    arch = find_architecture(model_type)
    if arch is None or not arch.encoder_decoder:
        raise UptrainError(f"model_type {model_type!r} is not an encoder–decoder uptrain knows")
    stacks = arch.stacks(model_config)
    cross = stacks["cross"]
    cross_kv = tuple(
        f"{prefix.format(layer=i)}.{module}."
        for prefix in (cross.layout.attn_prefix, *cross.layout.attn_prefix_alternatives)
        for i in range(cross.geometry.num_layers)
        for module in cross.layout.kv_modules
    )
    lookups = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    output = model.get_output_embeddings()
    counts = {"encoder": 0, "decoder": 0, "cross_kv": 0}
    for name, param in model.named_parameters():  # each shared tensor once, under its first name
        if id(param) in lookups and not (output is not None and param is output.weight):
            continue
        part = (
            "encoder" if name.startswith(ENCODER_PREFIXES) else "cross_kv" if name.startswith(cross_kv) else "decoder"
        )
        counts[part] += param.numel()

    def width(name: str) -> int:
        return stacks[name].geometry.num_heads * stacks[name].geometry.head_dim

    return EncoderDecoderCost(
        encoder_params=counts["encoder"],
        decoder_params=counts["decoder"],
        cross_kv_params=counts["cross_kv"],
        encoder_layers=stacks["encoder"].geometry.num_layers,
        encoder_width=width("encoder"),
        decoder_layers=stacks[DECODER_SELF].geometry.num_layers,
        decoder_width=width(DECODER_SELF),
        cross_width=width("cross"),
    )


def encoder_decoder_flops_per_token(
    model, model_config: dict, objective: Objective, seq_len: int, target_len: int
) -> float:
    """Forward + backward FLOPs of an encoder–decoder per counted token (seq_len per example):
    `EncoderDecoderCost` for the objective's S source positions (seq_len; an audio
    encoder: its positions) and T target positions (`Objective.target_length`)."""
    s = model_config.get("max_source_positions") if objective.encoder_reads == "audio" else seq_len
    t = objective.target_length(seq_len, target_len)
    return encoder_decoder_cost(model, model_config).train_flops(s, t) / seq_len


def kv_cache_metrics(model_config: dict, dtype_bytes: int) -> dict[str, int]:
    """The KV cache of generation, in bytes, from config.json: `model/kv_cache_bytes_per_token`,
    K and V of every layer for each generated token (a decoder-only model's only cache; an
    encoder–decoder's decoder self-attention), and for an encoder–decoder
    `model/cross_kv_cache_bytes_per_source_token`: the cross-attention's K and V of every decoder
    layer for each encoder position, computed once per input and held while generating. A batch
    generating T tokens from S source positions holds T·(first) + S·(second) bytes per input.
    A multi-head latent attention model (DeepSeek-V2) caches each layer's normalised latent and
    shared rotary key, as transformers does (`uptrain speed` measures the same)."""
    if model_config.get("model_type") == deepseek_v2.MODEL_TYPE:  # latent attention: no K/V heads cached
        return {"model/kv_cache_bytes_per_token": deepseek_v2.cache_elements_per_token(model_config) * dtype_bytes}
    arch = find_architecture(model_config.get("model_type"))
    per_token = {"model/kv_cache_bytes_per_token": config_geometry(model_config).kv_cache_bytes_per_token(dtype_bytes)}
    if arch is None or "cross" not in arch.attentions:
        return per_token
    cross = arch.site("cross").geometry.read(model_config)
    return {**per_token, "model/cross_kv_cache_bytes_per_source_token": cross.kv_cache_bytes_per_token(dtype_bytes)}


def attention_metrics(model_config: dict) -> dict[str, int]:
    """What the model caches, by heads: `model/num_kv_heads`, the KV heads (per-layer models: the
    largest layer's). A multi-head latent attention model (DeepSeek-V2) caches one vector per token
    and layer that every query head reads, the latent and the shared rotary key: one head, as vLLM
    counts it (its config's `num_key_value_heads` is the query heads, which transformers expands
    it into), with `model/kv_lora_rank` and `model/qk_rope_head_dim` its two parts."""
    if model_config.get("model_type") == deepseek_v2.MODEL_TYPE:
        return {
            "model/num_kv_heads": 1,
            "model/kv_lora_rank": model_config["kv_lora_rank"],
            "model/qk_rope_head_dim": model_config["qk_rope_head_dim"],
        }
    return {"model/num_kv_heads": config_geometry(model_config).num_kv_heads}


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float, num_processes: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_second * flops_per_token / (peak_flops * num_processes)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def perplexity(loss: float) -> float:
    """exp(loss), inf instead of an overflow."""
    return math.exp(loss) if loss < 700 else math.inf


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl, oldest first; the one reader of that file.

    A kill can cut the last line short (each record is appended by one write): a last line
    that is not JSON is left out, and `MetricsLog.truncate_after` rewrites the file without
    it. Any other damage is one UptrainError.
    """
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as err:
        raise UptrainError(f"cannot read {path}: {type(err).__name__}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if number == len(lines):  # no newline after it: the torn end of a killed write
                break
            raise UptrainError(f"{path}, line {number}: not a JSON record; the file is damaged") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UptrainError(f"{path}, line {number}: not a metrics record (no step); the file is damaged")
        records.append(record)
    return records


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, flushed at once so a killed run keeps them."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, record: dict) -> None:
        """Add one record (must hold `step`)."""
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")

    def records(self) -> list[dict]:
        """All records, oldest first."""
        return read_metrics(self.path)

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (written by a run that died after its last checkpoint): the
        resumed run logs those steps again with the same values."""
        keep = [r for r in self.records() if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in keep))
        tmp.replace(self.path)
