"""GPT-Neo with grouped-query attention (`model_type` "gpt_neo_gqa"), built on transformers' GPT-Neo.

Stored form: separate `q_proj`, `k_proj`, `v_proj` (no biases) and `out_proj` (with a bias) as in
GPT-Neo, with `k_proj` and `v_proj` of G·d rows. No rotary embedding (positions are learned and
added to the input), and GPT-Neo does not scale the scores by 1/√d. Layers alternate global and
local attention (`attention_layers`); a local layer's query sees only the `window_size` keys up
to itself. transformers' GPT-Neo makes that window from the key and query lengths (its `bias`
buffer), not from the positions, and so does every backend here (`GPTNeoGQAAttention`).
Everything else is transformers' GPT-Neo unchanged. Copied beside converted weights under this
name: imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPTNeoConfig
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoForCausalLM, GPTNeoModel, GPTNeoSelfAttention

from .attention import (
    TRANSFORMERS_4,
    AttentionBackends,
    GroupedHeadsConfig,
    causal_lm_gqa,
    eager_attention_forward,
    kv_heads_of_layer,
    pop_cache,
    update_cache,
)

# Flex attention under transformers 5 only: 4.x's takes no per-head bias (for the window), and
# 4.x's GPT-Neo gives it no mask at all without padding, which it takes for no mask (every key).
FLEX = not TRANSFORMERS_4


def check_backend(implementation: str | None, cache=None) -> None:
    """Refuse, in one line, what the local layers' window cannot reach: continuous batching
    (`generate_batch`: its paged cache lays every request's keys side by side and takes windows
    only from `sliding_window` configs; `paged|eager` names its attention), and 4.x's flex
    attention (see FLEX)."""
    implementation = implementation or "eager"
    if isinstance(cache, PagedAttentionCache) or "paged" in implementation:
        raise ValueError(
            "gpt_neo_gqa cannot run continuous batching (a paged KV cache): its local layers' window "
            "does not reach it; use generate()"
        )
    if implementation == "flex_attention" and not FLEX:
        raise ValueError(
            "gpt_neo_gqa cannot use attn_implementation='flex_attention' under transformers 4: "
            "use eager or sdpa attention"
        )


class GPTNeoGQAConfig(GroupedHeadsConfig, GPTNeoConfig):
    model_type = "gpt_neo_gqa"

    num_key_value_heads: int | None = None


class GPTNeoGQAAttention(GPTNeoSelfAttention):
    """GPT-Neo attention (global or local) over its layer's K/V heads (`kv_heads_of_layer`); the
    cache holds them, for every position (as transformers' GPT-Neo: the window is a mask, not a shorter cache)."""

    def __init__(self, config, attention_type, layer_id=None):
        super().__init__(config, attention_type, layer_id)
        self.layer_idx = layer_id  # the name transformers' attention functions read
        self.num_key_value_heads = kv_heads_of_layer(config, layer_id)
        self.num_key_value_groups = config.num_attention_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.k_proj = nn.Linear(self.embed_dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, kv_dim, bias=False)
        self.window = config.window_size if attention_type == "local" else None

    def _allowed(self, t: int, s: int) -> torch.Tensor:
        """`[1, 1, T, S]` boolean, True where query i (the last T of S positions) may see key j:
        causal, and within the window in a local layer. The rows of transformers' own `bias`,
        computed rather than sliced from it: packed documents laid out as one row (flash, flex)
        run longer than `max_position_embeddings`."""
        device = self.q_proj.weight.device
        query = torch.arange(s - t, s, device=device)[:, None]
        key = torch.arange(s, device=device)[None, :]
        allowed = key <= query
        if self.window is not None:
            allowed &= key > query - self.window
        return allowed[None, None]

    def _layer_mask(self, attention_mask, implementation: str, q: torch.Tensor, s: int, kwargs: dict):
        """The mask this layer attends with on `implementation`: the model's (causal, padding,
        documents) with the layer's own pattern on it, in the form that backend takes."""
        if "flash" in implementation:  # a 2D padding mask; the kernel applies the window itself
            return attention_mask
        b, h, t = q.shape[:3]
        allowed = self._allowed(t, s)
        if implementation == "flex_attention":
            # A BlockMask (causal, padding, documents), with the window as a per-head bias on the
            # scores: torch 2.13's CPU flex kernel fails to compile a window inside the BlockMask.
            if self.window is not None:
                bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
                kwargs["position_bias"] = bias.masked_fill(~allowed, torch.finfo(q.dtype).min).expand(b, h, t, s)
            return attention_mask
        if isinstance(attention_mask, torch.Tensor):
            attention_mask = attention_mask[..., :s]  # 4.x's may cover the whole cache length
        if implementation == "eager":
            # transformers' own order: scores outside the layer's pattern set to the minimum,
            # then the model's additive mask added; as one additive mask, bit for bit the same.
            blocked = torch.finfo(torch.float32).min
            own = torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, blocked)
            return own if attention_mask is None else own + attention_mask
        if self.window is None:  # SDPA and the like: the model's causal mask (or None: causal) serves
            return attention_mask
        if attention_mask is None:
            return allowed
        if attention_mask.dtype == torch.bool:
            return attention_mask & allowed
        return attention_mask.masked_fill(~allowed, torch.finfo(attention_mask.dtype).min)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        for unused in ("use_cache", "output_attentions"):
            kwargs.pop(unused, None)
        # 4.57 passes a per-head mask (None unless the caller gives one; 5.x has none).
        if kwargs.pop("head_mask", None) is not None:
            raise ValueError("gpt_neo_gqa does not support head masks")
        implementation = self.config._attn_implementation or "eager"
        check_backend(implementation, cache)
        input_shape = hidden_states.shape[:-1]
        heads = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(heads).transpose(1, 2)
        k = self.k_proj(hidden_states).view(heads).transpose(1, 2)
        v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        k, v = update_cache(cache, k, v, self.layer_idx, kwargs)
        if implementation == "eager":
            # GPT-Neo computes the scores in float32 whatever the model's dtype (they are not
            # scaled by 1/√d, so half precision would overflow); the weights return to V's dtype.
            q, k = q.to(torch.float32), k.to(torch.float32)
        mask = self._layer_mask(attention_mask, implementation, q, k.shape[2], kwargs)
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            mask,
            scaling=1.0,
            dropout=float(self.config.attention_dropout) if self.training else 0.0,
            sliding_window=self.window,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.resid_dropout(self.out_proj(out)), weights


def check_engine(config) -> None:
    """Refuse, in one line, vLLM's transformers backend (its attention function, "vllm") for a
    model with local layers: vLLM's attention takes no mask, so the window would not apply."""
    if config._attn_implementation == "vllm" and "local" in config.attention_layers:
        raise ValueError(
            f"gpt_neo_gqa with local attention layers (window_size {config.window_size}) cannot serve in "
            "vLLM's transformers backend: its attention takes no window"
        )


def _use_gqa_attention(model: GPTNeoModel, config: GPTNeoGQAConfig) -> None:
    check_engine(config)
    for i, block in enumerate(model.h):
        block.attn.attention = GPTNeoGQAAttention(config, block.attn.attention_type, i)


class GPTNeoBackends(AttentionBackends):
    """Eager, SDPA, flash attention (the window as the kernel's `sliding_window`) and, under
    transformers 5, flex attention (the window as a per-head bias) apply the local layers' window;
    registered kernels get the window in the mask, as SDPA does, and `sliding_window`."""

    _supports_flex_attn = FLEX


GPTNeoGQAModel, GPTNeoGQAForCausalLM = causal_lm_gqa(
    __name__,
    GPTNeoGQAConfig,
    GPTNeoModel,
    GPTNeoForCausalLM,
    _use_gqa_attention,
    mixins=(GPTNeoBackends,),
    check_backend=check_backend,
)
