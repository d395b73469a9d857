"""`--mla-init calibrated`: the latent of `--target mla` from the K/V activations on calibration data.

The moments are the calibrated GQA merge's (`calibration.collect_attention_moments`: per layer
C = E[x xᵀ] of the attention input x = g ⊙ n, one layer at a time); each layer's latent is solved
as soon as its C is complete and C dropped, so no C outlives its layer.

Per layer, W = [K_nope; V] is the stacked non-rotary key and value rows per query head (as
`mla.stacked_kv`); the latent is c = A x (R × hidden) and `kv_b_proj` B. The error is weighted by
what reads each row: a key's by its query head's second moment Q_h = E[q_h q_hᵀ] (nope rows: the
logit error E[(q_hᵀ Δk_h)²] under the usual independence of q and x), a value's by o_proj's Gram
O_hᵀ O_h (the output error). Keys' and values' errors are in different units (logits, residual
stream), so each is divided by its whole, G = G_K / tr(G_K C) + G_V / tr(G_V C) with
G_K = Σ_h K_hᵀ Q_h K_h, G_V = Σ_h V_hᵀ O_hᵀ O_h V_h: the two relative errors count alike.

- For a fixed A the best B is the regression of W x on c under C, B = W C Aᵀ (A C Aᵀ)⁻¹, whatever
  the weighting (each row is fitted on its own); the best A then spans the top R eigenvectors of
  Lᵀ G L (C = L Lᵀ): A = Pᵀ L⁻¹ (CARE's / TransMLA's PCA of the activations, weighted).
- Any basis of that row space gives the same B A. The one written is orthonormal in n = x / g
  (A = Qᵀ diag(1/g), Qᵀ Q = I): the latent is the coordinates of n's projection on the subspace,
  so when n lies in it ‖c‖ = ‖n‖ = √hidden for every token (n has rms 1) and the latent RMSNorm
  only rescales by a constant, which its weight ρ undoes exactly.
- ρ (every entry of `kv_a_layernorm`'s weight) is the latent's measured rms, √(tr(A C Aᵀ) / R),
  from the same C: where n leaves the subspace the norm still divides each token by its own rms,
  but no longer by one that is wrong on average (the SVD init's weight 1 is the rms at R = hidden).

Exact when every calibration (and later) attention input lies in an R-dimensional subspace: then
B A x = W x for those x and the norm is the identity (tests/convert/test_mla.py).

`--rotary-key calibrated` fits the shared rotary key on the same C (`solve_rope_key`): the
calibrated GQA merge's rank-1 fit of the KV heads' complex key rows, per frequency.
With `--rope-residual N` the rows B reconstructs include the rotary residual's (`mla.rotary_residual`,
which depends on the key solved here): B is their regression on c like any row's, but G, which
picks A, weighs only the non-rotary key and value rows (exact at full rank; D = 24, N = 6 on the reference:
117.94 at full rank, 118.11 at R = 40, measured in docs/concepts/mla.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from uptrain.convert.calibrated import _shared_vector, _solve_rank_one, regularised
from uptrain.convert.calibration import SpilledMoments


@dataclass(frozen=True)
class LatentSolution:
    """One layer's solved latent: `down` A (R × hidden, float64), `fit` F = C Aᵀ (A C Aᵀ)⁻¹
    (hidden × R: `kv_b_proj` is W F, computed from the weights when written), `rms` ρ."""

    down: torch.Tensor
    fit: torch.Tensor
    rms: float
    rope_key: torch.Tensor | None = None  # `--rotary-key calibrated`: the shared key's rows (D × hidden)
    rope_turns: torch.Tensor | None = None  # … and each KV head's complex scale per frequency [D/2, kv]


def reader_weighted_gram(
    k_nope: torch.Tensor, v: torch.Tensor, q_nope: torch.Tensor, o: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """G (hidden × hidden): the keys' and values' errors, each weighted by what reads it and
    divided by its whole under C. Per query head h: `k_nope` [h, nope, hidden] (its KV head's rows),
    `v` [h, d, hidden], `q_nope` [h, nope, hidden], `o` [h, hidden_out, d] (its o_proj columns)."""
    queries = torch.einsum("hix,xy,hjy->hij", q_nope, c, q_nope)  # Q_h
    g_keys = torch.einsum("hix,hij,hjy->xy", k_nope, queries, k_nope)
    g_values = torch.einsum("hix,hij,hjy->xy", v, o.mT @ o, v)
    total = torch.zeros_like(c)
    for part in (g_keys, g_values):
        whole = torch.trace(part @ c)
        if whole > 0:  # no nope rows (every column rotary): the keys take no part
            total += part / whole
    return total


def solve_latent(g: torch.Tensor, c: torch.Tensor, gain: torch.Tensor, rank: int) -> LatentSolution:
    """The rank-`rank` latent minimising tr(G (W − B A) C (W − B A)ᵀ), in the basis orthonormal
    in n = x / gain (module docstring). `c`: the attention input's moment (hidden × hidden)."""
    c_reg = regularised(c)
    lower = torch.linalg.cholesky(c_reg)
    vals, vecs = torch.linalg.eigh(lower.mT @ g @ lower)
    top = vecs[:, -rank:].flip(1)  # P: hidden × R
    # A = Pᵀ L⁻¹ (Lᵀ Aᵀ = P)
    a = torch.linalg.solve_triangular(lower.mT, top, upper=True).mT  # A C Aᵀ = I
    fit = lower @ top  # C Aᵀ (A C Aᵀ)⁻¹
    # n's best reconstruction from the latent is n̂ = diag(1/g) F c; QR of diag(1/g) F = Q T makes
    # the latent T c = Qᵀ n̂, the coordinates of n̂ in an orthonormal basis: ‖T c‖ = ‖n̂‖.
    _, turn = torch.linalg.qr(fit / gain[:, None])
    down = turn @ a
    fit = torch.linalg.solve_triangular(turn, fit, upper=True, left=False)  # F T⁻¹
    rms = (torch.trace(down @ c @ down.mT).clamp(min=0) / rank).sqrt().item()
    return LatentSolution(down, fit, rms)


def solve_rope_key(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, geo) -> tuple[torch.Tensor, torch.Tensor]:
    """`--rotary-key calibrated`: per kept frequency, the calibrated GQA merge's rank-1 fit of the
    KV heads' complex key rows to one (`calibrated._solve_rank_one`: Σ_s α_s ‖β_s − σ_s β‖²_C, α_s
    the pair's query energy E|q|² summed over the heads reading s). Returns the shared key's rows in
    DeepSeek-V2's interleaved order (D × hidden) and σ [D/2, kv], conj(σ_s) folded into the queries."""
    half, group = geo.head_dim // 2, geo.num_heads // geo.num_kv_heads
    q_heads, k_heads = geo.query_heads(q), geo.kv_heads(k)
    pairs = geo.rope_frequencies
    keys = torch.stack([torch.complex(k_heads[:, i], k_heads[:, i + half]) for i in pairs])  # [D/2, kv, hidden]
    energy = torch.einsum("hdx,xy,hdy->hd", q_heads, c, q_heads)  # E[q_d²] per query head
    alpha = torch.stack([(energy[:, i] + energy[:, i + half]).reshape(-1, group).sum(1) for i in pairs])
    solved = _solve_rank_one(keys, alpha, regularised(c))
    shared = _shared_vector(keys, solved)  # [D/2, hidden]
    rows = torch.stack([shared.real, shared.imag], dim=1).reshape(geo.rope_dims, -1)
    return rows, solved.sigma


def turned_queries(q: torch.Tensor, turns: torch.Tensor, geo) -> torch.Tensor:
    """Each query head's rotary rows (interleaved, heads × D × hidden) times conj(σ) of its KV head."""
    half, group = geo.head_dim // 2, geo.num_heads // geo.num_kv_heads
    q_heads = geo.query_heads(q)
    out = torch.empty(geo.num_heads, geo.rope_dims, q_heads.shape[-1], dtype=torch.float64)
    for j, i in enumerate(geo.rope_frequencies):
        pair = torch.complex(q_heads[:, i], q_heads[:, i + half]) * turns[j].repeat_interleave(group).conj()[:, None]
        out[:, 2 * j], out[:, 2 * j + 1] = pair.real, pair.imag
    return out


class LatentSolutions:
    """{layer: LatentSolution}, the matrices spilled to a temporary file as calibration's moments
    are (`SpilledMoments`): a 7B model's at R = 1024 are 2 GB in float64, held one layer at a time."""

    def __init__(self) -> None:
        self._matrices = SpilledMoments()
        self._small: dict[int, tuple[float, torch.Tensor | None]] = {}  # rms, rope_turns

    def add(self, layer: int, solution: LatentSolution) -> None:
        rope = [] if solution.rope_key is None else [solution.rope_key]
        self._matrices.add(layer, torch.cat([solution.down, solution.fit.mT, *rope]))
        self._small[layer] = (solution.rms, solution.rope_turns)

    def __getitem__(self, layer: int) -> LatentSolution:
        rms, turns = self._small[layer]
        matrices = self._matrices[layer]
        rank = (len(matrices) - (0 if turns is None else 2 * turns.shape[0])) // 2
        down, fit_t, rope = matrices[:rank], matrices[rank : 2 * rank], matrices[2 * rank :]
        return LatentSolution(down, fit_t.mT, rms, None if turns is None else rope, turns)


def layer_solver(
    read_layer: Callable[[int], tuple[dict, torch.Tensor, tuple]], geo, solutions: LatentSolutions
) -> Callable[[int, torch.Tensor], None]:
    """`collect_attention_moments`'s `per_layer`: solve layer i's latent from its moment (the
    constant input's row and column dropped: Llama has no biases) and keep only the solution.
    `read_layer(i)`: the layer's q/k/v/o_proj weights, its input norm's gain and the rows its
    latent's error is weighed by (`mla.reader_rows`)."""

    def solve(layer: int, moment: torch.Tensor) -> None:
        c = moment[:-1, :-1].to("cpu", torch.float64)
        tensors, gain, rows = read_layer(layer)
        g = reader_weighted_gram(*rows, c)
        solution = solve_latent(g, c, gain.double(), geo.kv_rank)
        if geo.rotary_key == "calibrated":
            rope_key, rope_turns = solve_rope_key(tensors["q"], tensors["k"], c, geo)
            solution = LatentSolution(solution.down, solution.fit, solution.rms, rope_key, rope_turns)
        solutions.add(layer, solution)

    return solve
