"""Grouped-query attention shared by every GQA modeling file uptrain ships.

This file is copied beside converted weights and loaded by `trust_remote_code=True` without
uptrain installed: it imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F



class GroupedAttentionOnly:
    """Mixin for the GQA model classes: SDPA and eager attention only. Flash/flex kernels and
    pluggable attention backends would bypass `grouped_query_attention`."""
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False

def _bottom_right_causal(t: int, s: int, device: torch.device) -> torch.Tensor:
    """Query i (of the last t positions) sees keys 0 … s − t + i: aligned to the end, as with a cache."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                            attention_mask: torch.Tensor | None = None, scale: float | None = None,
                            alibi: torch.Tensor | None = None, dropout: float = 0.0,
                            eager: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of h query heads over G shared K/V heads; returns (`[B, h, T, d]`, weights or None).

    q `[B, h, T, d]`; k, v `[B, G, S, d]` with G dividing h; query head i reads KV head
    i // (h / G). `attention_mask` is boolean (True = attend) or additive, broadcastable to
    `[B, h, T, S]`; when it is given it already holds the causal pattern (transformers builds it
    so), otherwise `causal` masks keys after each query, aligned to the end of the keys (the
    last T of S positions are the queries, as after a cache). `alibi` `[B or 1, h, 1 or T, S]`
    is added to the scores before the mask. The default path is `scaled_dot_product_attention`
    with `enable_gqa` (K/V are not repeated); `eager=True` computes the softmax explicitly per
    group and also returns the weights `[B, h, T, S]`.
    """
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    if h % g:
        raise ValueError(f"{h} query heads cannot be grouped over {g} KV heads")
    scale = d ** -0.5 if scale is None else scale
    if attention_mask is None and causal and 1 < t < s:
        attention_mask = _bottom_right_causal(t, s, q.device)
    is_causal = attention_mask is None and causal and t > 1
    if not eager:
        if alibi is not None:
            # A float mask is the only way to add a bias inside SDPA; fold causality into it.
            if is_causal:
                attention_mask = _bottom_right_causal(t, s, q.device)
                is_causal = False
            bias = alibi.to(q.dtype)
            attention_mask = bias if attention_mask is None else bias + _as_additive(attention_mask, q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scale,
                                             is_causal=is_causal, enable_gqa=g != h)
        return out, None
    if is_causal:
        attention_mask = _bottom_right_causal(t, s, q.device)
    r = h // g
    if r == 1 and alibi is not None:
        # BLOOM's own fused alibi + scale · q kᵀ, so G = h is bit-identical to it.
        bias = alibi.expand(b, h, alibi.shape[2], s).reshape(b * h, alibi.shape[2], s)
        scores = bias.baddbmm(q.reshape(b * h, t, d), k.reshape(b * h, s, d).transpose(1, 2), alpha=scale)
        scores = scores.view(b, h, t, s)
    elif r == 1:
        # The same operations as transformers' eager attention, so G = h is bit-identical to it.
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    else:
        # [B, G, r, T, d] @ [B, G, 1, d, S]: each group's r query heads read its one K head.
        scores = torch.matmul(q.view(b, g, r, t, d), k.unsqueeze(2).transpose(-1, -2)).view(b, h, t, s) * scale
        if alibi is not None:
            scores = scores + alibi
    if attention_mask is not None:
        scores = scores + _as_additive(attention_mask, scores.dtype)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # softmax in fp32 under half precision
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    if r == 1:
        out = torch.matmul(weights, v)
    else:
        out = torch.matmul(weights.view(b, g, r, t, s), v.unsqueeze(2)).view(b, h, t, d)
    return out, weights
