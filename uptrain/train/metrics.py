"""Metric arithmetic (FLOPs per token, MFU, memory) and the metrics.jsonl log.

Metric names are fixed (configs, docs and dashboards rely on them):
train/loss, train/lr, train/grad_norm, train/tokens_seen, eval/loss, eval/perplexity,
perf/tokens_per_second, perf/step_time_s, perf/mfu, perf/peak_memory_bytes,
model/num_kv_heads, model/kv_cache_bytes_per_token.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

from uptrain import UptrainError

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
