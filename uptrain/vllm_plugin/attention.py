"""The attention the plugin's GPT-2, BLOOM, MPT and GPT-Neo share: vLLM's attention layer over G
KV heads behind one fused QKV projection of h query and G KV heads and an output projection,
both tensor-parallel (fewer KV heads than ranks: each rank holds a replica of one, vLLM's rule
for GQA). Each family names its projections as its checkpoint does and gives its score scale,
its ALiBi slopes, its window or its clip. Beside it, what BLOOM and Falcon share: BLOOM's ALiBi
slopes and the repacking of their fused QKV, grouped per KV head, to vLLM's `[Q | K | V]`; and
what every family reads its layers' KV heads with (`layer_kv_heads`: config.json's per-layer
lists, #32, else the one count)."""

from __future__ import annotations

import math

import torch
from torch import nn
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.models.utils import extract_layer_index

from uptrain import model_info


def alibi_slopes(heads: int) -> torch.Tensor:
    """BLOOM's ALiBi slope of each query head (float32, as transformers computes them): powers
    of 2^(-8/n) for the n = largest power of two ≤ heads, then odd powers of 2^(-4/n) for the rest."""
    closest = 2 ** math.floor(math.log2(heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        odd = torch.arange(1, 1 + 2 * (heads - closest), 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra, odd)])
    return slopes


def layer_kv_heads(config, prefix: str, key: str = "num_key_value_heads", *, layers: int, heads: int) -> int:
    """The KV heads of the layer a module's `prefix` (or a weight's name) names, of the attention
    whose config key is `key`: uptrain's one reader of config.json's per-layer lists
    (`model_info.layer_kv_heads`, which checks them), else the one count for every layer.
    `layers` and `heads`: that attention's layers and query heads."""
    per_layer = model_info.layer_kv_heads(config.to_dict(), key, layers, heads)
    return per_layer[extract_layer_index(prefix)]


def qkv_of_grouped_rows(weights, config, *, layers: int, heads: int):
    """The checkpoint's tensors, each `query_key_value` (weight or bias) whose rows are grouped
    per KV head, `[G, r + 2, d]` (its r = h / G query heads, its K, its V: BLOOM's and Falcon's
    GQA layout), repacked to the `[Q | K | V]` vLLM's fused-QKV loader splits. G is that of the
    layer the tensor's name is in (layers may differ), read once from `config` as `layer_kv_heads`
    reads it."""
    per_layer = model_info.layer_kv_heads(config.to_dict(), "num_key_value_heads", layers, heads)
    for name, w in weights:
        if "query_key_value" in name:
            g = per_layer[extract_layer_index(name)]
            r = heads // g
            grouped = w.view(g, r + 2, -1, *w.shape[1:])
            q, k, v = (part.reshape(-1, *w.shape[1:]) for part in (grouped[:, :r], grouped[:, r], grouped[:, r + 1]))
            w = torch.cat([q, k, v])
        yield name, w


class FusedQKVAttention(nn.Module):
    """`names`: the (fused QKV, output) projections' names. `slopes`: every query head's ALiBi
    slope (this rank's are taken); `window`: a sliding window (keys up to the query, counted);
    `clip`: the fused projection's output clamped to ±clip."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        *,
        names: tuple[str, str],
        biases: tuple[bool, bool],
        scale: float | None = None,
        slopes: torch.Tensor | None = None,
        window: int | None = None,
        clip: float | None = None,
        cache_config=None,
        quant_config=None,
        prefix: str = "",
    ):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        head_dim = hidden // heads
        local_heads, local_kv = heads // tp, max(1, kv_heads // tp)
        self.qkv_name, self.out_name = names
        qkv = QKVParallelLinear(
            hidden, head_dim, heads, kv_heads, bias=biases[0], quant_config=quant_config, prefix=f"{prefix}.{names[0]}"
        )
        out = RowParallelLinear(
            hidden, hidden, bias=biases[1], quant_config=quant_config, prefix=f"{prefix}.{names[1]}"
        )
        self.add_module(self.qkv_name, qkv)
        self.add_module(self.out_name, out)
        self.q_size, self.kv_size = local_heads * head_dim, local_kv * head_dim
        self.clip = clip
        first = get_tensor_model_parallel_rank() * local_heads
        self.attn = Attention(
            local_heads,
            head_dim,
            head_dim**-0.5 if scale is None else scale,
            num_kv_heads=local_kv,
            alibi_slopes=None if slopes is None else slopes[first : first + local_heads].tolist(),
            per_layer_sliding_window=window,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = getattr(self, self.qkv_name)(hidden_states)
        if self.clip:
            qkv = qkv.clamp(min=-self.clip, max=self.clip)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out, _ = getattr(self, self.out_name)(self.attn(q, k, v))
        return out
