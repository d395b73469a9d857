"""`--value-fit output`: the calibrated merge's values refit to each head's attention output under
the merged keys (encoder–decoders; calibrated.py's notation).

The calibrated merge weighs each value error by C = E[x̃ x̃ᵀ] over every position the values read.
What the next layer reads is the head's output O_q V_s z_q, z_q = Σ_t p_{q,t} x̃_t the inputs pooled
by the head's attention — and once the keys are merged that attention moves (p' for the source's p).
Given the merged queries and keys, this refit chooses per group the shared values V'_g (d × (D+1),
the bias its last column) and per query head q a map M_q folded into O_q minimising

    Σ_q E‖O_q (M_q V'_g z'_q − V_s z_q)‖²  +  λ Σ_q E‖O_q (M_q V'_g x̃ − V_s x̃)‖²,

z'_q pooled with the merged attention, z_q with the source's, over the calibration batches'
(non-padding) queries; the λ term is the calibrated merge's own value objective (`solve_values`):
the pooled inputs of a few dozen clips leave directions barely visited, where the fit alone puts
weights that held-out speech then reads; λ → ∞ is the calibrated merge's values.

V'_g is kept in the span of the group's source value heads, V'_g = Lᵀ a (a: `_value_inputs`, the
group's source V heads each weighted by √(O_sᵀ O_s), [r·d, D+1]): the merged values read only
what the source values read. L is the top-d generalized eigenvectors of Σ_q R_qᵀ R_q against
a C'_g aᵀ, R_q = √(O_qᵀ O_q) V_s X_q aᵀ, X_q = E[z_q z'_qᵀ] + λC, C'_q = E[z'_q z'_qᵀ] + λC and C'_g
the group's C'_q averaged over its heads (where every head's C'_q is that average this is the exact
optimum in the span; with p' = p and λ = 0 it is the calibrated merge's PCA); then
M_q = V_s X_q wᵀ (w C'_q wᵀ)⁻¹, w = Lᵀ a. So only projections are needed per head: a C'_q aᵀ
([r·d, r·d]) and V_s X_q aᵀ ([d, r·d]), folded as the second calibration pass runs (`fold_example`:
the merged attention pools a x̃, the source's pools V_s x̃), never the (D+1)² moments per head
(33 GB for Whisper large).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from uptrain.convert.calibrated import (
    CalibratedSolution,
    LayerAttention,
    _augment,
    _psd_sqrt,
    _value_inputs,
    augmented_inputs,
    regularised,
)
from uptrain.convert.spec import DEFAULT_VALUE_FIT_BLEND as DEFAULT_BLEND  # λ: `--value-fit-blend`


@dataclass
class RefitTarget:
    """One attention layer to refit: its source projections (`source`, float64, heads in the
    merge's order), its calibrated merge to `groups` KV heads (`merged`: the queries and keys that
    make p'), and each group's value inputs a ([r·d, D+1], `_value_inputs`)."""

    source: LayerAttention
    merged: LayerAttention
    groups: int

    def __post_init__(self):
        r = self.source.num_kv_heads // self.groups
        v_aug = _augment(self.source.v_w, self.source.v_b)
        self.value_inputs = [_value_inputs(self.source, v_aug, j, r) for j in range(self.groups)]

    def to(self, device) -> RefitTarget:
        def move(layer: LayerAttention) -> LayerAttention:
            tensors = {f: getattr(layer, f) for f in ("q_w", "k_w", "v_w", "o_w", "q_b", "k_b", "v_b")}
            return replace(layer, **{f: None if t is None else t.to(device) for f, t in tensors.items()})

        return RefitTarget(move(self.source), move(self.merged), self.groups)


@dataclass
class OutputMoments:
    """Sums over the kept queries, per query head q: `merged` Σ (a z'_q)(a z'_q)ᵀ [h, r·d, r·d] and
    `cross` Σ (V_s z_q)(a z'_q)ᵀ [h, d, r·d] (a: q's group's value inputs); `count` queries."""

    merged: torch.Tensor | float = 0.0
    cross: torch.Tensor | float = 0.0
    count: int = 0


def _probabilities(layer: LayerAttention, hidden: torch.Tensor, x: torch.Tensor, scaling: float, mask) -> torch.Tensor:
    """softmax(scaling · q kᵀ) per query head, [h, tq, tk] in float64: `hidden` [tq, D] what the
    queries read, `x` [tk, D+1] what the keys read (augmented), `mask` [tq, tk] the pairs allowed."""
    h, d = layer.num_heads, layer.head_dim
    q = (hidden @ layer.q_w.mT + (0.0 if layer.q_b is None else layer.q_b)) * scaling
    k = x @ _augment(layer.k_w, layer.k_b).mT  # [tk, kv·d]
    q = q.view(len(hidden), h, d).transpose(0, 1)
    k = k.view(len(x), layer.num_kv_heads, d).transpose(0, 1).repeat_interleave(layer.n_rep, 0)
    scores = q @ k.mT
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def fold_example(
    target: RefitTarget,
    found: OutputMoments,
    hidden: torch.Tensor,
    kv: torch.Tensor,
    scaling: float,
    queries: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
    causal: bool = False,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Fold one example into `found`: `hidden` [tq, D] the queries' input, `kv` [tk, D] the keys'
    and values'; `queries` [tq] the queries that count (None: all), `keys` [tk] the positions that
    may be attended (None: all), `causal` the decoder's self-attention. `reference`: (hidden, kv)
    the source attention reads where it differs from what the merged one reads (a model merged
    layer by layer in order, the merged attention reading the merged model's states; z the
    source model's); None: the same inputs."""
    source, g = target.source, target.groups
    h, d, kv_heads = source.num_heads, source.head_dim, source.num_kv_heads
    x = augmented_inputs(kv)
    hidden_source, x_source = (hidden, x) if reference is None else (reference[0], augmented_inputs(reference[1]))
    mask = None
    if causal:
        mask = torch.ones(len(hidden), len(x), dtype=torch.bool, device=x.device).tril()
    if keys is not None:
        mask = keys[None, :].expand(len(hidden), -1) if mask is None else mask & keys[None, :]
    p = _probabilities(source, hidden_source.to(torch.float64), x_source, scaling, mask)
    p_merged = _probabilities(target.merged, hidden.to(torch.float64), x, scaling, mask)
    if queries is not None:
        p, p_merged = p[:, queries], p_merged[:, queries]
    values = (x_source @ _augment(source.v_w, source.v_b).mT).view(len(x), kv_heads, d).transpose(0, 1)
    pooled_values = p @ values.repeat_interleave(source.n_rep, 0)  # V_s z_q, [h, n, d]
    projected = torch.stack([x @ a.mT for a in target.value_inputs])  # a x̃, [g, tk, r·d]
    pooled_merged = p_merged @ projected.repeat_interleave(h // g, 0)  # a z'_q, [h, n, r·d]
    found.merged = found.merged + pooled_merged.mT @ pooled_merged
    found.cross = found.cross + pooled_values.mT @ pooled_merged
    found.count += pooled_values.shape[1]


def refit_values(
    layer: LayerAttention, groups: int, found: OutputMoments, c_inputs: torch.Tensor, blend: float = DEFAULT_BLEND
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(value_mix, value_maps) of the refit (module docstring): per group L ([r·d, d], the shared
    V' = Lᵀ a, as `CalibratedSolution.value_mix`), per query head its map M_q ([d, d], folded into
    its o_proj columns). `layer`: the source projections in the merge's head order; `c_inputs`:
    C = E[x̃ x̃ᵀ] over every position the values read (the calibrated merge's value moment)."""
    h, d, kv = layer.num_heads, layer.head_dim, layer.num_kv_heads
    r, n_rep, per_group = kv // groups, layer.n_rep, h // groups
    count = max(found.count, 1)
    v_aug = _augment(layer.v_w, layer.v_b)
    mix, maps = [], []
    for j in range(groups):
        a = _value_inputs(layer, v_aug, j, r)  # [r·d, D+1]
        c_a = c_inputs @ a.mT
        heads = range(j * per_group, (j + 1) * per_group)
        # a C'_q aᵀ and V_s X_q aᵀ with the blend: the projections the pass folded, plus λ C's.
        c_merged = {q: found.merged[q] / count + blend * (a @ c_a) for q in heads}
        cross = {
            q: found.cross[q] / count + blend * (v_aug[(q // n_rep) * d : (q // n_rep + 1) * d] @ c_a) for q in heads
        }
        c_group = regularised(sum(c_merged.values()) / per_group)
        target = 0.0
        for q in heads:
            o = layer.o_w[:, q * d : (q + 1) * d]
            read = _psd_sqrt(o.mT @ o) @ cross[q]  # [d, r·d]
            target = target + read.mT @ read
        lower = torch.linalg.cholesky(c_group)
        whiten = torch.linalg.solve_triangular(
            lower, torch.eye(len(lower), dtype=lower.dtype, device=lower.device), upper=False
        )
        vecs = torch.linalg.eigh(whiten @ target @ whiten.mT)[1]
        mix.append(whiten.mT @ vecs[:, -d:].flip(1))  # L: w = Lᵀ a has w C'_g wᵀ = I
        for q in heads:
            own = regularised(mix[-1].mT @ c_merged[q] @ mix[-1])  # w C'_q wᵀ
            maps.append(torch.linalg.solve(own, (cross[q] @ mix[-1]).mT).mT)  # V_s X_q wᵀ (w C'_q wᵀ)⁻¹
    return mix, maps


def refit_solution(
    layer: LayerAttention,
    groups: int,
    solution: CalibratedSolution,
    found: OutputMoments,
    c_inputs: torch.Tensor,
    blend: float = DEFAULT_BLEND,
) -> CalibratedSolution:
    """`solution` (the calibrated merge of `layer`) with its values refit (`refit_values`); its
    keys as they are. `apply_calibrated` applies it (value maps per query head)."""
    mix, maps = refit_values(layer, groups, found, c_inputs, blend)
    return replace(solution, value_mix=mix, value_maps=maps)
