"""`grouped_query_attention` against a naive implementation written independently: every
query head looped over, its KV head picked by `i // (h / G)`, masks applied as -inf."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from uptrain.modeling.attention import alibi_as_mask, grouped_query_attention


def naive(q, k, v, *, causal=True, keep=None, scale=None, alibi=None):
    """Per query head and position: softmax over the keys it may see. `keep` [B, T, S] bool."""
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    weights = torch.zeros(b, h, t, s, dtype=torch.float64)
    for bi in range(b):
        for i in range(h):
            kv = i // (h // g)
            for ti in range(t):
                pos = s - t + ti  # the queries are the last t of the s positions
                scores = [float(q[bi, i, ti].double() @ k[bi, kv, si].double()) * scale for si in range(s)]
                if alibi is not None:
                    scores = [sc + float(alibi[0, i, 0, si]) for si, sc in enumerate(scores)]
                visible = [(not causal or si <= pos) and (keep is None or bool(keep[bi, ti, si])) for si in range(s)]
                top = max(sc for sc, ok in zip(scores, visible) if ok)
                e = [math.exp(sc - top) if ok else 0.0 for sc, ok in zip(scores, visible)]
                for si in range(s):
                    weights[bi, i, ti, si] = e[si] / sum(e)
                out[bi, i, ti] = sum(weights[bi, i, ti, si] * v[bi, kv, si].double() for si in range(s))
    return out, weights


def inputs(h, g, t, s, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, h, t, 8, generator=gen),
        torch.randn(2, g, s, 8, generator=gen),
        torch.randn(2, g, s, 8, generator=gen),
    )


@pytest.mark.parametrize("g", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("t,s", [(6, 6), (1, 6), (3, 7)])  # prefill, one decode step, a chunk after a cache
def test_causal_matches_naive(g, eager, t, s):
    q, k, v = inputs(4, g, t, s)
    out, weights = grouped_query_attention(q, k, v, eager=eager)
    expected, expected_weights = naive(q, k, v)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if eager:
        torch.testing.assert_close(weights.double(), expected_weights, rtol=1e-5, atol=1e-6)
    else:
        assert weights is None


@pytest.mark.parametrize("g", [4, 1])
@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("additive", [False, True])
def test_padding_mask_matches_naive(g, eager, additive):
    """A left-padded batch row: masks as transformers passes them (causal pattern included),
    boolean for SDPA or additive (0 / dtype min) for eager."""
    q, k, v = inputs(4, g, 5, 5)
    keep = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    keep[0, :, :2] = False
    keep[0, :2, :2] = torch.eye(2, dtype=torch.bool)  # padded queries see themselves: no empty row
    mask = keep[:, None]
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out, _ = grouped_query_attention(q, k, v, attention_mask=mask, eager=eager)
    expected, _ = naive(q, k, v, causal=False, keep=keep)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g", [4, 2])
@pytest.mark.parametrize("eager", [False, True])
def test_non_causal_scale_and_alibi(g, eager):
    q, k, v = inputs(4, g, 3, 5)
    out, _ = grouped_query_attention(q, k, v, causal=False, scale=0.3, eager=eager)
    torch.testing.assert_close(out.double(), naive(q, k, v, causal=False, scale=0.3)[0], rtol=1e-5, atol=1e-5)
    alibi = torch.randn(1, 4, 1, 5)
    out, _ = grouped_query_attention(q, k, v, alibi=alibi, eager=eager)
    torch.testing.assert_close(out.double(), naive(q, k, v, alibi=alibi)[0], rtol=1e-5, atol=1e-5)


def test_groups_are_contiguous():
    """KV head j only ever feeds query heads j·r … (j+1)·r − 1: change V of KV head 1 and
    only query heads 2 and 3 (of 4, G = 2) move."""
    q, k, v = inputs(4, 2, 4, 4)
    before, _ = grouped_query_attention(q, k, v)
    v2 = v.clone()
    v2[:, 1] += 1.0
    after, _ = grouped_query_attention(q, k, v2)
    assert torch.equal(after[:, :2], before[:, :2])
    assert not torch.allclose(after[:, 2:], before[:, 2:])


def test_heads_must_divide():
    q, k, v = inputs(4, 3, 2, 2)
    with pytest.raises(ValueError, match="cannot be grouped"):
        grouped_query_attention(q, k, v)


@pytest.mark.parametrize("g", [4, 2])
@pytest.mark.parametrize("t,s", [(5, 5), (1, 5), (2, 5)])
def test_alibi_as_mask_is_what_sdpa_needs(g, t, s):
    """BLOOM on SDPA: ALiBi folded with the causal (None) or padding mask into one additive
    mask, which SDPA adds to the scores, gives the naive ALiBi attention."""
    q, k, v = inputs(4, g, t, s)
    alibi = torch.randn(2, 4, 1, s)
    keep = torch.ones(2, t, s, dtype=torch.bool).tril(diagonal=s - t)
    keep[0, :, 0] = False  # a padded first key in one row …
    keep[0, :, 0] |= ~keep[0, :, 1:].any(-1)  # … that a query with nothing else to see still sees
    for mask, expected_keep in ((None, None), (keep[:, None], keep)):
        additive = alibi_as_mask(alibi, mask, t, s, torch.float32)
        assert additive.shape == (2, 4, t, s)
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(4 // g, 1), v.repeat_interleave(4 // g, 1), attn_mask=additive
        )
        expected = torch.stack(
            [
                naive(
                    q[i : i + 1],
                    k[i : i + 1],
                    v[i : i + 1],
                    alibi=alibi[i : i + 1],
                    keep=None if expected_keep is None else expected_keep[i : i + 1],
                )[0][0]
                for i in range(2)
            ]
        )
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
