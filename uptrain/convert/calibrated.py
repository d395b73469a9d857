"""Whole-layer K/V merges: the `calibrated` strategy and `similarity` grouping.

Unlike the per-tensor strategies in pooling.py these see one layer's Q, K, V and O at once,
because every per-head correction is folded into that head's `q_proj` rows or `o_proj`
columns: the output keeps exactly the shapes of plain GQA.

Notation: x is the attention input (after the layer's input norm) augmented with a constant
1, so biases are columns of the weights; C = E[x xᵀ] over calibration tokens, (D+1)×(D+1).
Query head q reads source KV head s(q) = q // n_rep; the group of target KV head j holds the
source KV heads j·r … (j+1)·r − 1 (contiguous, after any similarity permutation).

Values. Head q's output is O_q · Σ_t a_qt · W_s v-inputs; with a shared W and a per-source-head
map M_s folded into O_q, the error Σ_q ‖O_q (M_s W − W_s) x‖² is minimised by
M_s = W_s C Wᵀ (given W C Wᵀ = I) and W = the top-d principal directions of
Σ_s W_sᵀ G_s W_s under C, G_s = Σ_{q→s} O_qᵀ O_q — a closed-form PCA.

Keys. The score of query head q is q_qᵀ k_s: a per-source-head map M_s on the shared key can
be folded into the queries (q' = M_sᵀ q), as long as it commutes with whatever acts between
the projection and the score.
- Dims no rotary embedding touches (every dim of GPT-2, OPT, BLOOM, T5, …; the pass-through
  dims of partial rotary): any d×d map. Keys are then merged as values are, by the same PCA,
  with the queries' second moment Q_s = Σ_{q→s} E[q_q q_qᵀ] in place of G_s: the logit error
  E[(qᵀ (M_s W − W_s) x)²] = tr(Q_s (M_s W − W_s) C (M_s W − W_s)ᵀ). Position terms added to
  the scores (ALiBi, T5's relative bias) belong to the query heads and are untouched.
- Rotary dims: RoPE rotates each frequency pair (dims i and i + rot/2 in transformers'
  rotate_half layout; 2i and 2i + 1 in GPT-J's) as a complex number, so the only per-head maps
  that commute with it are complex scales per pair. Each source head's key pair u_s is
  approximated by σ_s · v (shared v, complex scale σ_s), weighted by its queries' energy
  E|q|²; the best v is a rank-1 Hermitian eigenproblem, and conj(σ_s) is folded into the query
  pair rows.
Biases ride along as the constant input: the shared key's bias is shared, and M_sᵀ acts on
each query head's bias as on its weight rows, so the scores stay exact.

Each merge is two steps: `solve_calibrated` decides, from C and the layer's weights, the few
numbers the merge needs (per group the eigenvectors that make the shared V, per source head its
d×d map and its key scales: O(kv·d²), not O(D²)); `apply_calibrated` computes the merged weights
from the source weights and those numbers. Solving is the expensive part (O(D²·h·d) per layer,
in float64) and runs as soon as a layer's C is complete, on the device C is on; C is then no
longer needed, so no layer's C outlives its calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class CrossMoments:
    """A layer's moments where one C does not serve the whole merge: what the keys' and values'
    error is weighted by (`keys_values`), what the queries read (`queries`), and, where the values'
    error has a weighting of its own, `values`. Cross-attention: keys and values read the
    encoder's output, the queries the decoder's states (each augmented with a constant 1).
    `calibration_weighting: attention`: the keys' error weighted by the attention each position
    receives, the values' by the moment of the attention-pooled inputs (what the output reads)."""

    keys_values: torch.Tensor
    queries: torch.Tensor
    values: torch.Tensor | None = None  # None: `keys_values`

    def to(self, *args, **kwargs) -> CrossMoments:
        moved = [None if t is None else t.to(*args, **kwargs) for t in (self.keys_values, self.queries, self.values)]
        return CrossMoments(*moved)

    @property
    def device(self) -> torch.device:
        return self.keys_values.device


def input_moment(moment: torch.Tensor | CrossMoments) -> torch.Tensor:
    """The moment of what the keys and values read (a cross-attention's: the encoder output's)."""
    return moment.keys_values if isinstance(moment, CrossMoments) else moment


@dataclass
class LayerAttention:
    """One layer's attention projections in float64; biases None when absent."""

    q_w: torch.Tensor  # [h·d, D]
    k_w: torch.Tensor  # [kv·d, D]
    v_w: torch.Tensor  # [kv·d, D]
    o_w: torch.Tensor  # [D, h·d]
    q_b: torch.Tensor | None
    k_b: torch.Tensor | None
    v_b: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # dims [0, rotary_dim) rotate in pairs; the rest pass through
    rotary_pairs: str = "half"  # "half": (i, i + rotary_dim / 2); "adjacent": (2i, 2i + 1)

    @property
    def n_rep(self) -> int:
        return self.num_heads // self.num_kv_heads


def _augment(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    ones_col = b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    return torch.cat([w, ones_col[:, None]], dim=1)


def augmented_inputs(x: torch.Tensor) -> torch.Tensor:
    """x̃ = [x, 1] in float64 ([..., D] → [..., D+1]): the inputs with a constant 1, so that a
    moment of x̃ carries what `_augment`'s bias column reads."""
    x = x.to(torch.float64)
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)], dim=-1)


def _split(w_aug: torch.Tensor, had_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return w_aug[:, :-1].contiguous(), (w_aug[:, -1].contiguous() if had_bias else None)


def _psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh((m + m.mT) / 2)
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.mT


def regularised(c: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """C plus a small ridge so directions the calibration text never visited stay invertible."""
    scale = c.diagonal().mean().clamp(min=1e-12)
    return c + ridge * scale * torch.eye(c.shape[0], dtype=c.dtype, device=c.device)


def regularised_moments(
    c: torch.Tensor, c_query: torch.Tensor | None, c_values: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys' moment C, the queries' and the values' (each C where not given), every one
    `regularised`: what the merge is solved under and what its loss, and a pooling's, is counted under."""
    c = regularised(c)
    return c, c if c_query is None else regularised(c_query), c if c_values is None else regularised(c_values)


@dataclass
class RankOne:
    """One `_solve_rank_one`: query energies α [P, r], the top eigenvector e [P, r] and value λ [P]
    of the weighted Gram, and the per-head scales σ [P, r] folded into the query rows."""

    alpha: torch.Tensor
    e: torch.Tensor
    lam: torch.Tensor
    sigma: torch.Tensor


@dataclass
class FullMaps:
    """A merge of a group's heads that allows any map per head: the shared head is
    Σ_s combine[s] · W_s, and source head s is approximated by maps[s] · (shared head)."""

    combine: torch.Tensor  # [kv, d', d'] for the source heads of every group, in order
    maps: torch.Tensor  # [kv, d', d']

    def to(self, device) -> FullMaps:
        return FullMaps(self.combine.to(device), self.maps.to(device))


@dataclass
class CalibratedSolution:
    """What the calibrated merge of one layer takes from C (see the module docstring)."""

    value_mix: list[torch.Tensor]  # per group: [r·d, d]; the shared V is value_mixᵀ · a (a: `_value_inputs`)
    # per source KV head s: M_s [d, d], folded into its queries' o_proj columns; or, one per query head
    # (`value_refit`: each query head's own map), M_q folded into its own
    value_maps: list[torch.Tensor]
    key_rotary: list[RankOne | None]  # per group: the rotary pairs' complex scales (None without rotary dims)
    key_plain: FullMaps | None  # the dims RoPE leaves alone: any map per head (None if all rotate)

    def to(self, device) -> CalibratedSolution:
        def move(x):
            return None if x is None else RankOne(*(t.to(device) for t in (x.alpha, x.e, x.lam, x.sigma)))

        return CalibratedSolution(
            [t.to(device) for t in self.value_mix],
            [t.to(device) for t in self.value_maps],
            [move(x) for x in self.key_rotary],
            None if self.key_plain is None else self.key_plain.to(device),
        )


def _value_inputs(layer: LayerAttention, v_aug: torch.Tensor, j: int, r: int) -> torch.Tensor:
    """a: group j's source V heads, each weighted by the square root of its queries' o_proj Gram, [r·d, D+1]."""
    d = layer.head_dim
    return torch.cat(
        [_psd_sqrt(_output_gram(layer, s)) @ v_aug[s * d : (s + 1) * d] for s in range(j * r, (j + 1) * r)]
    )


def _output_gram(layer: LayerAttention, s: int) -> torch.Tensor:
    """G_s = Σ_{q→s} O_qᵀ O_q, [d, d]: how source V head s's error reaches the residual stream."""
    d = layer.head_dim
    o_cols = [layer.o_w[:, q * d : (q + 1) * d] for q in range(s * layer.n_rep, (s + 1) * layer.n_rep)]
    return sum(o.mT @ o for o in o_cols)


def solve_values(layer: LayerAttention, groups: int, c: torch.Tensor) -> tuple[list, list]:
    """Per group the mix that makes its shared V; per source head its map M_s: (value_mix, value_maps)."""
    d, kv = layer.head_dim, layer.num_kv_heads
    r = kv // groups
    v_aug = _augment(layer.v_w, layer.v_b)
    mix, maps = [], []
    for j in range(groups):
        a = _value_inputs(layer, v_aug, j, r)
        vals, vecs = torch.linalg.eigh(a @ c @ a.mT)
        top_vals, top_vecs = vals[-d:].flip(0), vecs[:, -d:].flip(1)
        mix.append(top_vecs / top_vals.clamp(min=1e-30).sqrt())
        w = mix[-1].mT @ a  # [d, D+1], w C wᵀ = I
        for s in range(j * r, (j + 1) * r):
            maps.append(v_aug[s * d : (s + 1) * d] @ c @ w.mT)  # [d, d]
    return mix, maps


def apply_values(
    layer: LayerAttention, groups: int, solution: CalibratedSolution
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Shared V per group and o_proj with each head's map folded in: (v_w, v_b, o_w)."""
    d, kv = layer.head_dim, layer.num_kv_heads
    r = kv // groups
    v_aug = _augment(layer.v_w, layer.v_b)
    o_w = layer.o_w.clone()
    per_query = len(solution.value_maps) == layer.num_heads  # (equal to per source head where kv = h)
    new_v = []
    for j in range(groups):
        new_v.append(solution.value_mix[j].mT @ _value_inputs(layer, v_aug, j, r))
        for s in range(j * r, (j + 1) * r):
            for q in range(s * layer.n_rep, (s + 1) * layer.n_rep):
                head_map = solution.value_maps[q if per_query else s]
                o_w[:, q * d : (q + 1) * d] = layer.o_w[:, q * d : (q + 1) * d] @ head_map
    v_w, v_b = _split(torch.cat(new_v), layer.v_b is not None)
    return v_w, v_b, o_w


def _solve_rank_one(u: torch.Tensor, alpha: torch.Tensor, c: torch.Tensor) -> RankOne:
    """Best shared v and scales σ with u_s ≈ σ_s v under Σ_s α_s ‖·‖²_C (v itself: `_shared_vector`).

    u: [P, r, D+1] (complex for rotary pairs, real otherwise), alpha: [P, r].
    """
    a = u * alpha.sqrt()[..., None]  # [P, r, D+1]
    cc = c.to(a.dtype)
    gram = a.conj() @ cc @ a.mT  # [P, r, r], gram[p, s, t] = a_s^H C a_t
    vals, vecs = torch.linalg.eigh(gram)
    lam, e = vals[:, -1].clamp(min=1e-30), vecs[:, :, -1]  # [P], [P, r]
    s_prime = (e.conj()[:, None, :] @ gram)[:, 0] / lam.sqrt()[:, None].to(a.dtype)  # [P, r]
    # Heads whose queries carry no energy have α = 0: any scale is as good; keep theirs finite.
    sigma = torch.where(alpha > 0, s_prime / alpha.clamp(min=1e-30).sqrt().to(a.dtype), torch.zeros_like(s_prime))
    return RankOne(alpha, e, lam, sigma)


def _shared_vector(u: torch.Tensor, solved: RankOne) -> torch.Tensor:
    """v = Σ_s e_s a_s / √λ, [P, D+1]."""
    a = u * solved.alpha.sqrt()[..., None]
    return (solved.e[:, None, :] @ a)[:, 0] / solved.lam.sqrt()[:, None].to(a.dtype)


def _key_heads(layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
    d = layer.head_dim
    return (
        _augment(layer.k_w, layer.k_b).view(layer.num_kv_heads, d, -1),
        _augment(layer.q_w, layer.q_b).view(layer.num_heads, d, -1),
    )


def _dims(layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each rotary pair's real and imaginary dims, and the dims no rotation touches."""
    rot, device = layer.rotary_dim, layer.k_w.device
    if layer.rotary_pairs == "adjacent":
        real, imag = torch.arange(0, rot, 2, device=device), torch.arange(1, rot, 2, device=device)
    else:
        real, imag = torch.arange(rot // 2, device=device), torch.arange(rot // 2, rot, device=device)
    return real, imag, torch.arange(rot, layer.head_dim, device=device)


def _rotary_pairs(ks: torch.Tensor, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
    return torch.complex(ks[:, real], ks[:, imag]).transpose(0, 1)  # [pairs, r, D+1]


def solve_full_maps(w: torch.Tensor, gram: torch.Tensor, groups: int, c: torch.Tensor) -> FullMaps:
    """The PCA merge of heads `w` ([kv, d', D+1]) into `groups` shared heads with any map per
    head, each head's error weighted by `gram` ([kv, d', d'], its readers' second moment)."""
    kv, dp = w.shape[:2]
    r = kv // groups
    roots = torch.stack([_psd_sqrt(g) for g in gram])
    combine, maps = [], []
    for j in range(groups):
        sources = range(j * r, (j + 1) * r)
        a = torch.cat([roots[s] @ w[s] for s in sources])  # [r·d', D+1]
        vals, vecs = torch.linalg.eigh(a @ c @ a.mT)
        mix = vecs[:, -dp:].flip(1) / vals[-dp:].flip(0).clamp(min=1e-30).sqrt()  # shared C-orthonormal
        shared = mix.mT @ a
        for i, s in enumerate(sources):
            combine.append(mix[i * dp : (i + 1) * dp].mT @ roots[s])
            maps.append(w[s] @ c @ shared.mT)
    return FullMaps(torch.stack(combine), torch.stack(maps))


def shared_heads(w: torch.Tensor, solved: FullMaps, groups: int) -> torch.Tensor:
    """The `groups` shared heads of a `solve_full_maps` merge, [groups, d', D+1]."""
    mixed = solved.combine @ w  # [kv, d', D+1]
    return mixed.view(groups, -1, *mixed.shape[1:]).sum(1)


def solve_keys(layer: LayerAttention, groups: int, c: torch.Tensor, c_query: torch.Tensor) -> tuple[list, Any]:
    """The key merge: per group the complex scales of the rotary pairs, and the full maps of the
    other dims (key_rotary, key_plain). `c_query`: the moment of the queries' input."""
    kv, r = layer.num_kv_heads, layer.num_kv_heads // groups
    real, imag, plain = _dims(layer)
    k_aug, q_aug = _key_heads(layer)
    by_source = q_aug.view(kv, layer.n_rep, layer.head_dim, -1)
    # Query energy per source KV head and dim: α[s, i] = Σ_{q→s} E[(q_i)²].
    q_energy = torch.einsum("srdx,xy,srdy->sd", by_source, c_query, by_source)
    rotary = []
    for j in range(groups):
        sources = list(range(j * r, (j + 1) * r))
        rotary.append(
            _solve_rank_one(
                _rotary_pairs(k_aug[sources], real, imag),
                (q_energy[sources][:, real] + q_energy[sources][:, imag]).mT,
                c,
            )
            if len(real)
            else None
        )
    full = None
    if len(plain):
        q_plain = by_source[:, :, plain]  # [kv, n_rep, d', D+1]
        gram = torch.einsum("srdx,xy,srey->sde", q_plain, c_query, q_plain)  # Q_s
        full = solve_full_maps(k_aug[:, plain], gram, groups, c)
    return rotary, full


def apply_keys(
    layer: LayerAttention, groups: int, solution: CalibratedSolution
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Shared K per group; each query head's rows absorb its map (conj(σ) on rotary pairs, M_sᵀ
    on the other dims): (k_w, k_b, q_w, q_b)."""
    d, kv = layer.head_dim, layer.num_kv_heads
    r = kv // groups
    real, imag, plain = _dims(layer)
    k_aug, q_aug = _key_heads(layer)
    new_k = torch.zeros(groups, d, k_aug.shape[-1], dtype=k_aug.dtype, device=k_aug.device)
    new_q = q_aug.clone()
    for j in range(groups):
        sources = list(range(j * r, (j + 1) * r))
        if len(real):
            solved = solution.key_rotary[j]
            v, sigma = _shared_vector(_rotary_pairs(k_aug[sources], real, imag), solved), solved.sigma
            new_k[j, real], new_k[j, imag] = v.real, v.imag
            for i, s in enumerate(sources):
                for q in range(s * layer.n_rep, (s + 1) * layer.n_rep):
                    pair = torch.complex(q_aug[q, real], q_aug[q, imag]) * sigma[:, i, None].conj()
                    new_q[q, real], new_q[q, imag] = pair.real, pair.imag
    if len(plain):  # dims RoPE leaves alone: a full map per source head
        solved = solution.key_plain
        new_k[:, plain] = shared_heads(k_aug[:, plain], solved, groups)
        for s in range(kv):
            for q in range(s * layer.n_rep, (s + 1) * layer.n_rep):
                new_q[q, plain] = solved.maps[s].mT @ q_aug[q, plain]
    k_w, k_b = _split(new_k.reshape(groups * d, -1), layer.k_b is not None)
    q_w, q_b = _split(new_q.reshape(layer.num_heads * d, -1), layer.q_b is not None)
    return k_w, k_b, q_w, q_b


def solve_calibrated(
    layer: LayerAttention,
    groups: int,
    c: torch.Tensor,
    c_query: torch.Tensor | None = None,
    c_values: torch.Tensor | None = None,
) -> CalibratedSolution:
    """Everything the calibrated merge of `layer` to `groups` KV heads takes from C, the moment
    of the keys' and values' input; `c_query`: that of the queries' input where it differs
    (cross-attention reads the encoder's states, its queries the decoder's), else C; `c_values`:
    the moment the values' error is weighted by where it differs from the keys' (else C)."""
    c, c_query, c_values = regularised_moments(c, c_query, c_values)
    return CalibratedSolution(*solve_values(layer, groups, c_values), *solve_keys(layer, groups, c, c_query))


@dataclass(frozen=True)
class MergeLoss:
    """What the calibrated merge of one layer to G KV heads leaves unexplained, in the terms it
    minimises, beside the whole of each (the same at every G): `values`, the output error
    Σ_q E‖O_q (M_s W − W_s) x̃‖² (the residual stream's units: what o_proj adds to it);
    `keys`, the logit error Σ_q E[(q_qᵀ (k_s − k̂_s))²] (rotary pairs and plain dims together)."""

    values: float
    values_energy: float
    keys: float
    keys_energy: float


def _unexplained(vals: torch.Tensor, kept: int) -> tuple[float, float]:
    """(the sum of all but the `kept` largest eigenvalues, the sum of all): the residual of the
    best rank-`kept` approximation, and the energy it is out of (eigenvalues below 0 are round-off)."""
    vals = vals.clamp(min=0)
    return float(vals[..., :-kept].sum()), float(vals.sum())


def merge_loss(
    layer: LayerAttention,
    groups: int,
    c: torch.Tensor,
    c_query: torch.Tensor | None = None,
    c_values: torch.Tensor | None = None,
) -> MergeLoss:
    """The error `solve_calibrated` (same arguments) leaves at its optimum, in closed form: each of
    its merges is a best low-rank fit under C, whose residual is the sum of the eigenvalues it
    drops. Only eigenvalues are computed, no maps. At G = kv every group is one head: exactly 0."""
    c, c_query, c_values = regularised_moments(c, c_query, c_values)
    d, kv = layer.head_dim, layer.num_kv_heads
    r = kv // groups
    values = values_energy = keys = keys_energy = 0.0
    v_aug = _augment(layer.v_w, layer.v_b)
    for j in range(groups):
        a = _value_inputs(layer, v_aug, j, r)
        lost, whole = _unexplained(torch.linalg.eigvalsh(a @ c_values @ a.mT), d)
        values, values_energy = values + lost, values_energy + whole
    real, imag, plain = _dims(layer)
    k_aug = _key_heads(layer)[0]
    pair_energy, plain_gram = _key_weights(layer, c_query)
    for j in range(groups):
        sources = list(range(j * r, (j + 1) * r))
        if len(real):  # each rotary pair: a rank-1 fit of the group's heads (`_solve_rank_one`)
            alpha = pair_energy[sources].mT
            weighted = _rotary_pairs(k_aug[sources], real, imag) * alpha.sqrt()[..., None]
            gram = weighted.conj() @ c.to(weighted.dtype) @ weighted.mT
            lost, whole = _unexplained(torch.linalg.eigvalsh(gram), 1)
            keys, keys_energy = keys + lost, keys_energy + whole
    if len(plain):  # the dims RoPE leaves alone: a PCA as the values' (`solve_full_maps`)
        roots = [_psd_sqrt(g) for g in plain_gram]
        for j in range(groups):
            a = torch.cat([roots[s] @ k_aug[s, plain] for s in range(j * r, (j + 1) * r)])
            lost, whole = _unexplained(torch.linalg.eigvalsh(a @ c @ a.mT), len(plain))
            keys, keys_energy = keys + lost, keys_energy + whole
    return MergeLoss(values, values_energy, keys, keys_energy)


def _key_weights(layer: LayerAttention, c_query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """How a source K head's error reaches the scores, from the queries' input moment: per source
    head and rotary pair, its queries' energy α = Σ_{q→s} E|q_pair|² ([kv, pairs]); per source
    head, the plain dims' query second moment Q_s = Σ_{q→s} E[q qᵀ] ([kv, d', d'], None without
    plain dims)."""
    kv, d = layer.num_kv_heads, layer.head_dim
    real, imag, plain = _dims(layer)
    by_source = _key_heads(layer)[1].view(kv, layer.n_rep, d, -1)
    q_energy = torch.einsum("srdx,xy,srdy->sd", by_source, c_query, by_source)
    q_plain = by_source[:, :, plain]
    gram = torch.einsum("srdx,xy,srey->sde", q_plain, c_query, q_plain) if len(plain) else None
    return q_energy[:, real] + q_energy[:, imag], gram


def pooled_loss(
    layer: LayerAttention,
    pooled: LayerAttention,
    c: torch.Tensor,
    c_query: torch.Tensor | None = None,
    c_values: torch.Tensor | None = None,
) -> MergeLoss:
    """What a row pooling leaves (`pooled`: `layer` with its K and V rows pooled to G heads, its
    Q and O untouched), in exactly `merge_loss`'s terms and weighting (same arguments), so that a
    pooling's cost and the calibrated merge's compare: every source head s is approximated by its
    group's pooled head with no map (M_s = I, σ_s = 1). Values: Σ_s tr(G_s ΔV_s C ΔV_sᵀ); keys, per
    rotary pair Σ_s α_s ‖Δu_s‖²_C, on the plain dims Σ_s tr(Q_s ΔK_s C ΔK_sᵀ). The calibrated merge
    minimises these over a family that holds every such pooling, so its loss is never larger."""
    c, c_query, c_values = regularised_moments(c, c_query, c_values)
    d, kv = layer.head_dim, layer.num_kv_heads
    r = kv // pooled.num_kv_heads
    v_src, v_new = (_augment(a.v_w, a.v_b).view(-1, d, layer.v_w.shape[1] + 1) for a in (layer, pooled))
    k_src, k_new = (_augment(a.k_w, a.k_b).view(-1, d, layer.k_w.shape[1] + 1) for a in (layer, pooled))
    real, imag, plain = _dims(layer)
    pair_energy, plain_gram = _key_weights(layer, c_query)

    def weighted(gram: torch.Tensor, w: torch.Tensor, moment: torch.Tensor) -> float:
        """tr(gram · w · moment · wᵀ): w's error under its readers' `gram` and its input's `moment`."""
        return float(torch.trace(gram @ w @ moment @ w.mT))

    def rotary(s: int, w: torch.Tensor) -> float:
        """Σ_pairs α_s,pair ‖w_pair‖²_C, w's rotary pairs as complex rows."""
        pairs = torch.complex(w[real], w[imag])
        return float((pair_energy[s] * torch.einsum("px,xy,py->p", pairs.conj(), c.to(pairs.dtype), pairs).real).sum())

    values = values_energy = keys = keys_energy = 0.0
    for s in range(kv):
        j = s // r  # source head s's group: its pooled head
        gram = _output_gram(layer, s)
        values += weighted(gram, v_new[j] - v_src[s], c_values)
        values_energy += weighted(gram, v_src[s], c_values)
        if len(real):
            keys += rotary(s, k_new[j] - k_src[s])
            keys_energy += rotary(s, k_src[s])
        if len(plain):
            keys += weighted(plain_gram[s], (k_new[j] - k_src[s])[plain], c)
            keys_energy += weighted(plain_gram[s], k_src[s, plain], c)
    return MergeLoss(values, values_energy, keys, keys_energy)


def apply_calibrated(layer: LayerAttention, groups: int, solution: CalibratedSolution) -> LayerAttention:
    """Pool a layer to `groups` KV heads with a solved calibrated merge (weights only, no C)."""
    v_w, v_b, o_w = apply_values(layer, groups, solution)
    k_w, k_b, q_w, q_b = apply_keys(layer, groups, solution)
    return replace(layer, q_w=q_w, q_b=q_b, k_w=k_w, k_b=k_b, v_w=v_w, v_b=v_b, o_w=o_w, num_kv_heads=groups)


def head_similarity(layer: LayerAttention, c: torch.Tensor) -> torch.Tensor:
    """[kv, kv] similarity of source KV heads: how much their K and V read the same input
    directions under C (1 for heads spanning the same subspace, 0 for orthogonal ones)."""
    d, kv = layer.head_dim, layer.num_kv_heads
    sim = torch.zeros(kv, kv, dtype=torch.float64, device=c.device)
    for w in (_augment(layer.k_w, layer.k_b), _augment(layer.v_w, layer.v_b)):
        heads = w.view(kv, d, -1)
        cross = torch.einsum("sdx,xy,tey->stde", heads, c, heads).pow(2).sum((2, 3))  # ‖W_s C W_tᵀ‖²_F
        norms = cross.diagonal().sqrt()
        sim += cross / (norms[:, None] * norms[None, :]).clamp(min=1e-30)
    return sim


def similarity_order(sim: torch.Tensor, groups: int) -> list[int]:
    """Order source KV heads so that contiguous groups gather similar heads.

    Greedy and index-free (ties aside): seed each group with the most similar free pair, grow
    it with the free head closest to the group. Renumbering the heads of a model therefore
    yields the same groups.
    """
    kv = sim.shape[0]
    r = kv // groups
    if r == 1:
        return list(range(kv))
    free = set(range(kv))
    chosen: list[list[int]] = []
    while free:
        pairs = [(sim[s, t].item(), s, t) for s in free for t in free if s < t]
        _, s, t = max(pairs)
        group = [s, t]
        while len(group) < r:
            rest = free - set(group)
            group.append(max(rest, key=lambda u: sum(sim[u, g].item() for g in group)))
        free -= set(group)
        chosen.append(sorted(group))
    chosen.sort()
    return [s for group in chosen for s in group]


def query_order(order: list[int], n_rep: int) -> list[int]:
    """The query heads in their new order when the KV heads are renumbered to `order`: each KV
    head's n_rep query heads move with it."""
    return [s * n_rep + k for s in order for k in range(n_rep)]


def permute_kv_heads(layer: LayerAttention, order: list[int]) -> LayerAttention:
    """Renumber KV heads (and the query heads that read them) — exact: Q rows, K/V rows and
    O columns move together, so the layer computes the same function."""
    d, n_rep = layer.head_dim, layer.n_rep
    kv_rows = torch.tensor([s * d + i for s in order for i in range(d)], device=layer.k_w.device)
    q_rows = torch.tensor([q * d + i for q in query_order(order, n_rep) for i in range(d)], device=layer.q_w.device)

    def rows(t, index):
        return None if t is None else t[index]

    return replace(
        layer,
        q_w=layer.q_w[q_rows],
        q_b=rows(layer.q_b, q_rows),
        k_w=layer.k_w[kv_rows],
        k_b=rows(layer.k_b, kv_rows),
        v_w=layer.v_w[kv_rows],
        v_b=rows(layer.v_b, kv_rows),
        o_w=layer.o_w[:, q_rows],
    )
