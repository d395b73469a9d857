"""`uptrain convert --target mla`: a Llama-family checkpoint as multi-head latent attention in the
DeepSeek-V2 layout (`uptrain.architecture.deepseek_v2`), initialised by the weight-space joint SVD
of the non-rotary keys and the values (MHA2MLA's ablation, `--mla-init svd`, below) or from their
activations on calibration data (`--mla-init calibrated`, `mla_calibrated`). docs/concepts/mla.md
has the math.

Per layer, with n = x / g the input RMSNorm's output before its gain g (rms 1 per token):
- rotary: the source's frequencies 0, S, …, S (D/2 − 1) stay rotary, the first D/2 by default
  (`--rope-stride S`; Llama rotates column i with i + d/2 at θ^(−2i/d); DeepSeek-V2 rotates
  (2j, 2j+1) at θ'^(−2j/D), θ' = θ^(S·D/d): one geometric sequence from the highest frequency is all
  the layout can state, in transformers and vLLM alike). DeepSeek-V2 has one
  rotary key for all heads: per frequency the best complex rank-1 fit of the heads' rotary keys,
  each query head's rotary rows rescaled and turned to read it (`principal_rope_key`; exact when
  the heads' keys of a frequency are complex multiples of one, as with one KV head), the mean
  of the KV heads' rotary rows (`mean_rope_key`, the ablation), or the same fit under the
  calibration's moments (`mla_calibrated.solve_rope_key`, `--rotary-key calibrated`);
- the other d − D columns of every head's query and key lose their rotation (partial RoPE);
- what the shared key misses of each head's rotary key is dropped, or for the lowest N kept
  frequencies (`--rope-residual N`) kept in the latent unrotated (`rotary_residual`): 2N more
  non-rotary columns per head, no more cache; measured much better on the reference (docs);
- latent: the stacked non-rotary keys and values, per query head, W = [K_nope; V] · diag(g) =
  U S Vᵀ; the latent is c = V_Rᵀ n (`kv_a_proj_with_mqa` = V_Rᵀ diag(1/g)), `kv_b_proj` = U_R S_R.
  V_R has orthonormal columns, so at R = hidden c is n rotated and its rms is n's, 1: the latent
  RMSNorm (weight 1) then divides by ~1 and keys and values are the source's. Below, it divides each
  token's latent by its own rms, which the weights cannot undo (measured in the docs).

Streams: one layer's attention in memory at a time; everything else copied tensor by tensor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.architecture import deepseek_v2, source_model_type
from uptrain.checkpoint.atomic import atomic_directory, check_apart, check_output_path
from uptrain.checkpoint.card import card_metadata, front_matter
from uptrain.checkpoint.hashing import BackgroundHasher
from uptrain.checkpoint.reader import SourceCheckpoint, tensor_bytes
from uptrain.checkpoint.source import resolve_source
from uptrain.checkpoint.writer import OutputEntry, ShardedWriter
from uptrain.convert.mla_calibrated import LatentSolution, LatentSolutions, layer_solver, turned_queries
from uptrain.convert.outputs import copy_side_files, set_dtype, source_record
from uptrain.convert.plan import DTYPES
from uptrain.convert.spec import CalibrationSettings, ConversionSpec, parse_size
from uptrain.model_info import read_config

FAMILIES = ("llama",)  # rotary decoders whose attention is q/k/v/o_proj without bias
# Why each other family uptrain converts to GQA is not converted to MLA. DeepSeek-V2's block is
# Llama's (RMSNorm of weight w, rotary positions, separate q/k/v/o without bias, SwiGLU MLP, plain
# residuals), so a source converts when its function is that block's; each reason names what it
# has that the layout cannot state (tests/convert/test_mla.py checks every family has one).
NO_LATENT_LAYOUT = "learned absolute positions, LayerNorm and a GELU MLP"
ENCODER_DECODER = "an encoder and a decoder: DeepSeek-V2 is decoder-only, and uptrain has no latent modeling of its own"
FAMILY_REFUSALS = {
    "mistral": "sliding-window attention (sliding_window), which DeepSeek-V2 has no field for",
    "qwen2": "q/k/v biases, which DeepSeek-V2's q_proj and kv_b_proj do not have",
    "qwen3": "an RMSNorm on each head's query and key (q_norm, k_norm) before the rotary",
    "gemma": "RMSNorm of weight 1 + w, a GELU MLP and embeddings scaled by √hidden",
    "gemma2": "RMSNorm of weight 1 + w, norms after attention and MLP, logit soft-capping and sliding windows",
    "phi": "partial rotary, LayerNorm, biases and attention parallel to a GELU MLP",
    "phi3": "fused qkv_proj and gate_up_proj projections (not split for MLA yet)",
    "stablelm": "LayerNorm and partial rotary",
    "olmo": "LayerNorm without weights and optional q/k/v clipping",
    "olmo2": "an RMSNorm on the queries and keys and norms after attention and MLP",
    "starcoder2": "LayerNorm, biases, a GELU MLP and sliding windows",
    "granite": "embedding, residual, attention and logit multipliers",
    "gpt2": NO_LATENT_LAYOUT,
    "opt": NO_LATENT_LAYOUT,
    "gpt_neo": NO_LATENT_LAYOUT + ", and local attention layers",
    "bloom": "ALiBi position biases (no rotary), LayerNorm and a GELU MLP",
    "mpt": "ALiBi position biases (no rotary), LayerNorm and a GELU MLP",
    "falcon": "attention parallel to a GELU MLP, LayerNorm, and ALiBi or rotary by configuration",
    "gpt_neox": "partial rotary, LayerNorm and attention parallel to a GELU MLP",
    "gptj": "rotary on interleaved pairs of part of each head, LayerNorm and attention parallel to a GELU MLP",
    **dict.fromkeys(("t5", "mt5", "umt5", "bart", "mbart", "marian", "m2m_100", "pegasus", "whisper"), ENCODER_DECODER),
}
LAYER = "model.layers.{}.self_attn."
INPUT_NORM = "model.layers.{}.input_layernorm.weight"
EMBEDDINGS, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class MLAGeometry:
    """The source's attention and the latent it becomes."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    kv_rank: int
    rope_dims: int
    rope_theta: float
    rotary_key: str = "principal"  # a name of ROTARY_KEY_TEXT
    rope_stride: int = 1  # the kept frequencies are the source's 0, s, 2s, … (`rope_frequencies`)
    rope_residual: int = 0  # of the kept frequencies, the lowest this many keep the shared key's residual unrotated

    @property
    def rope_frequencies(self) -> list[int]:
        """The source's frequencies that stay rotary, highest first: every `rope_stride`-th from the
        first, the geometric sequence DeepSeek-V2's θ'^(−2j/D) can turn at (`deepseek_v2.rope_theta_for`)."""
        return [self.rope_stride * j for j in range(self.rope_dims // 2)]

    @property
    def residual_frequencies(self) -> list[int]:
        """The kept frequencies whose part of each head's key the shared rotary key misses goes into
        the latent, unrotated (`rotary_residual`): the lowest `rope_residual` of them."""
        kept = self.rope_frequencies
        return kept[len(kept) - self.rope_residual :]

    @property
    def nope_dims(self) -> int:
        """qk_nope_head_dim: the columns that lose their rotation, then the residuals' (2 per frequency)."""
        return self.head_dim - self.rope_dims + 2 * self.rope_residual

    @property
    def query_scale(self) -> float:
        """DeepSeek-V2's softmax scale is (qk_nope_head_dim + qk_rope_head_dim)^−½; the source's d^−½:
        the queries are multiplied by the ratio (1 without residual columns)."""
        return math.sqrt((self.nope_dims + self.rope_dims) / self.head_dim)

    @property
    def max_rank(self) -> int:
        """The latent holds at most what the stacked K_nope/V rows span, and never more than the hidden size."""
        return min(self.hidden, self.num_heads * (self.nope_dims + self.head_dim))

    def query_heads(self, weight: torch.Tensor) -> torch.Tensor:
        """q_proj's rows per query head, float64: [heads, head_dim, hidden]."""
        return weight.double().reshape(self.num_heads, self.head_dim, -1)

    def kv_heads(self, weight: torch.Tensor) -> torch.Tensor:
        """k_proj's or v_proj's rows per KV head, float64: [KV heads, head_dim, hidden]."""
        return weight.double().reshape(self.num_kv_heads, self.head_dim, -1)


def default_rope_dims(head_dim: int) -> int:
    """Half of each head's frequencies stay rotary unless told (DeepSeek-V2's own split is 64 of 192)."""
    return max(2, head_dim // 2 // 2 * 2)


def rank_for_budget(kv_budget: float, source_elements: int, rope_dims: int) -> int:
    """`--kv-budget F`: the rank whose latent and rotary key cache F of the source's K/V elements
    per token and layer, which must be a whole number of them: within the GQA budgets' tolerance
    (`kv_heads.BUDGET_TOLERANCE`), so that a typed 0.333333 gives a third here as it does a third of
    the KV heads there, and `uptrain compare` spends the same budgets on both targets."""
    from uptrain.convert.kv_heads import BUDGET_TOLERANCE

    elements = kv_budget * source_elements
    whole = math.isclose(elements, round(elements), rel_tol=BUDGET_TOLERANCE)
    if not whole or round(elements) <= rope_dims:
        raise UptrainError(
            f"--kv-budget {kv_budget}: {kv_budget} of the source's {source_elements} K/V elements per token and "
            f"layer is {elements:g}, which must be a whole number above --rope-dims {rope_dims} (latent + rotary key)"
        )
    return round(elements) - rope_dims


def mla_geometry(
    config: dict,
    kv_rank: int | None,
    rope_dims: int | None,
    kv_budget: float | None = None,
    rotary_key: str = "principal",
    rope_stride: int = 1,
    rope_residual: int = 0,
) -> MLAGeometry:
    """The geometry, or one line saying what of the source or the flags this layout cannot take;
    the rank is `kv_rank`, or what `kv_budget` leaves after the rotary key."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        why = FAMILY_REFUSALS.get(source_model_type(model_type), "an architecture uptrain does not know")
        raise UptrainError(
            f"--target mla converts the Llama family (model_type {', '.join(FAMILIES)}) into DeepSeek-V2's "
            f"layout; {model_type!r} has {why} (use --target gqa)"
        )
    if config.get("attention_bias"):
        raise UptrainError(
            "--target mla: this model has q/k/v biases (attention_bias); DeepSeek-V2's q_proj and kv_b_proj have none"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UptrainError(
            f"--target mla keeps the source's rotary frequencies by rescaling rope_theta; rope_type {rope_type!r} "
            "(scaled rotary) is not converted yet"
        )
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    rope_dims = default_rope_dims(head_dim) if rope_dims is None else rope_dims
    if rope_dims % 2 or not 2 <= rope_dims <= head_dim:
        raise UptrainError(f"--rope-dims {rope_dims}: give an even number from 2 to the head dimension {head_dim}")
    if rope_stride * (rope_dims // 2 - 1) >= head_dim // 2:
        raise UptrainError(
            f"--rope-stride {rope_stride} with --rope-dims {rope_dims}: the {rope_dims // 2}th kept frequency would be "
            f"the source's {rope_stride * (rope_dims // 2 - 1)}, past its last ({head_dim // 2 - 1})"
        )
    if not 0 <= rope_residual <= rope_dims // 2:
        raise UptrainError(f"--rope-residual {rope_residual}: give 0 to the {rope_dims // 2} kept frequencies")
    kv_heads = config.get("num_key_value_heads") or heads
    if kv_rank is None:
        kv_rank = rank_for_budget(kv_budget, 2 * kv_heads * head_dim, rope_dims)
    geometry = MLAGeometry(
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        kv_rank=kv_rank,
        rope_dims=rope_dims,
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rotary_key=rotary_key,
        rope_stride=rope_stride,
        rope_residual=rope_residual,
    )
    if not 1 <= kv_rank <= geometry.max_rank:
        raise UptrainError(
            f"latent rank {kv_rank} (--kv-rank, or what --kv-budget leaves after the rotary key): give 1 to "
            f"{geometry.max_rank} (the hidden size, or the stacked non-rotary key and value columns if fewer)"
        )
    return geometry


def rope_rows(head_dim: int, rope_dims: int, stride: int = 1) -> list[int]:
    """A head's columns that stay rotary, in DeepSeek-V2's interleaved order: the frequencies
    0, s, …, s (D/2 − 1), Llama's pair (i, i + d/2) of the j-th kept frequency i becoming (2j, 2j + 1)."""
    half = head_dim // 2
    return [row for j in range(rope_dims // 2) for row in (stride * j, stride * j + half)]


def nope_rows(head_dim: int, rope_dims: int, stride: int = 1) -> list[int]:
    """A head's columns that lose their rotation, in the source's order."""
    kept = set(rope_rows(head_dim, rope_dims, stride))
    return [row for row in range(head_dim) if row not in kept]


def mean_rope_key(q: torch.Tensor, k: torch.Tensor, geo: MLAGeometry):
    """`--rotary-key mean`: the one rotary key is the mean of the KV heads' rotary rows, each query
    head keeps its own (the GQA paper's mean pooling, to one head; in weight space, so the input
    norm's gain plays no part). Returns each query head's rotary rows (heads × D × hidden) and the
    key's (D × hidden), float64."""
    rows = rope_rows(geo.head_dim, geo.rope_dims, geo.rope_stride)
    return geo.query_heads(q)[:, rows], geo.kv_heads(k)[:, rows].mean(dim=0)


def principal_rope_key(q: torch.Tensor, k: torch.Tensor, gain: torch.Tensor, geo: MLAGeometry):
    """`--rotary-key principal`: per kept frequency, the shared key that best carries every head's
    rotary score. A pair's rotation is a complex multiplication, so head h's score is
    Re(conj(α_h·x) (β_h·y) e^{iθΔ}) with α_h, β_h ∈ ℂ^hidden its query's and key's rows (a + ib).
    A shared key β·y and queries c_h α_h reproduce it exactly when every β_h = λ_h β; otherwise
    the best β (in n = x / g, weighting each head by its query's norm ‖α_h g‖) is the top right
    singular vector of the matrix whose rows are ‖α_h g‖ β_h g (Eckart–Young), and c_h = conj(λ_h).
    Returns as `mean_rope_key`."""
    half, group = geo.head_dim // 2, geo.num_heads // geo.num_kv_heads
    gain = gain.double()
    q_heads, k_heads = geo.query_heads(q), geo.kv_heads(k)
    q_rope = torch.empty(geo.num_heads, geo.rope_dims, q.shape[-1], dtype=torch.float64)
    k_rope = torch.empty(geo.rope_dims, k.shape[-1], dtype=torch.float64)
    for j, i in enumerate(geo.rope_frequencies):
        alpha = torch.complex(q_heads[:, i], q_heads[:, i + half])
        beta = torch.complex(k_heads[:, i], k_heads[:, i + half]).repeat_interleave(group, dim=0) * gain
        weight = (alpha * gain).abs().pow(2).sum(-1).sqrt()
        u, s, vh = torch.linalg.svd(weight[:, None] * beta, full_matrices=False)
        scale = s[0] * u[:, 0] / weight.clamp_min(torch.finfo(torch.float64).tiny)  # β_h ≈ scale_h · vh[0]
        query = scale.conj()[:, None] * alpha
        key = vh[0] / gain
        q_rope[:, 2 * j], q_rope[:, 2 * j + 1] = query.real, query.imag
        k_rope[2 * j], k_rope[2 * j + 1] = key.real, key.imag
    return q_rope, k_rope


ROTARY_KEYS = ("principal", "mean")  # the weight-space keys; `calibrated` needs calibration's moments
ROTARY_KEY_TEXT = {
    "principal": "per frequency, the best rank-1 (complex) fit of the heads' rotary keys in weight space",
    "mean": "the mean of the source's KV heads' rotary rows",
    "calibrated": "per frequency, the best rank-1 (complex) fit of the KV heads' rotary keys on calibration data, "
    "weighted by the queries' energy",
}


def stacked_kv(
    k: torch.Tensor, v: torch.Tensor, geo: MLAGeometry, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows `kv_b_proj` must produce, as the source computes them: per query head its KV head's
    non-rotary key rows, its rotary residual's (`rotary_residual`, when given), then its value rows
    (float64)."""
    group = geo.num_heads // geo.num_kv_heads
    nope = nope_rows(geo.head_dim, geo.rope_dims, geo.rope_stride)
    k_nope = geo.kv_heads(k)[:, nope].repeat_interleave(group, dim=0)
    v = geo.kv_heads(v).repeat_interleave(group, dim=0)
    parts = [k_nope] if residual is None else [k_nope, residual]
    return torch.cat([*parts, v], dim=1).reshape(-1, k.shape[-1])


def rotary_residual(q: torch.Tensor, k: torch.Tensor, q_rope: torch.Tensor, k_rope: torch.Tensor, geo: MLAGeometry):
    """For the kept frequencies in `geo.residual_frequencies`, what the shared key misses of each
    head's rotary score, as non-rotary columns: per query head h and frequency i, the written score
    Re(conj(c̄_h α_h·x) (β·y) e^{iθΔ}) is the source's with key c_h β, so the residual key is
    r_h = β_h − c_h β (c̄_h read back from the turned query, c̄_h = α_hᴴ q'_h / α_hᴴ α_h), read by the
    source's own query α_h without rotation. Returns the query's and the key's rows, (real,
    imaginary) per frequency, [heads, 2·residual, hidden] each (float64)."""
    half, group = geo.head_dim // 2, geo.num_heads // geo.num_kv_heads
    q_heads, k_heads = geo.query_heads(q), geo.kv_heads(k).repeat_interleave(group, dim=0)
    queries, keys = [], []
    start = geo.rope_dims // 2 - geo.rope_residual
    for j, i in enumerate(geo.residual_frequencies, start):
        alpha = torch.complex(q_heads[:, i], q_heads[:, i + half])
        beta = torch.complex(k_heads[:, i], k_heads[:, i + half])
        turned = torch.complex(q_rope[:, 2 * j], q_rope[:, 2 * j + 1])
        norm = (alpha.abs() ** 2).sum(-1)
        turn = (alpha.conj() * turned).sum(-1) / norm.clamp_min(torch.finfo(torch.float64).tiny)  # c̄_h
        residual = beta - turn.conj()[:, None] * torch.complex(k_rope[2 * j], k_rope[2 * j + 1])
        queries += [alpha.real, alpha.imag]
        keys += [residual.real, residual.imag]
    return torch.stack(queries, dim=1), torch.stack(keys, dim=1)


def reader_rows(tensors: dict[str, torch.Tensor], geo: MLAGeometry):
    """What `--mla-init calibrated` weighs the latent's error by, per query head (float64): its KV
    head's non-rotary key rows [h, d − D, hidden] and value rows [h, d, hidden], its own non-rotary
    query rows [h, d − D, hidden] and o_proj columns [h, hidden, d]."""
    group, nope = geo.num_heads // geo.num_kv_heads, nope_rows(geo.head_dim, geo.rope_dims, geo.rope_stride)
    k = geo.kv_heads(tensors["k"]).repeat_interleave(group, dim=0)
    v = geo.kv_heads(tensors["v"]).repeat_interleave(group, dim=0)
    q = geo.query_heads(tensors["q"])
    o = tensors["o"].double().reshape(-1, geo.num_heads, geo.head_dim).transpose(0, 1)
    return k[:, nope], v, q[:, nope], o


def joint_svd(kv: torch.Tensor, gain: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent's down- and up-projection (float64): the truncated SVD of `kv · diag(gain)`, the
    map from the normalised hidden state n, as V_Rᵀ diag(1/gain) (so the latent is V_Rᵀ n, of rms
    ≈ 1 when the rank is full) and U_R S_R."""
    u, s, vh = torch.linalg.svd(kv * gain.double(), full_matrices=False)
    return vh[:rank] / gain.double(), u[:, :rank] * s[:rank]


def layer_attention(
    tensors: dict[str, torch.Tensor], gain: torch.Tensor, geo: MLAGeometry, solution: LatentSolution | None = None
) -> dict[str, torch.Tensor]:
    """One layer's source q/k/v_proj weights as the DeepSeek-V2 attention's (`o_proj` is unchanged):
    the latent by the joint SVD, or by `solution` (`--mla-init calibrated`, `mla_calibrated`)."""
    dtype = tensors["q"].dtype
    if geo.rotary_key == "calibrated":  # solved from the calibration's moments (`mla_calibrated`)
        q_rope, k_rope = turned_queries(tensors["q"], solution.rope_turns, geo), solution.rope_key
    elif geo.rotary_key == "principal":
        q_rope, k_rope = principal_rope_key(tensors["q"], tensors["k"], gain, geo)
    else:
        q_rope, k_rope = mean_rope_key(tensors["q"], tensors["k"], geo)
    q_nope = geo.query_heads(tensors["q"])[:, nope_rows(geo.head_dim, geo.rope_dims, geo.rope_stride)]
    k_residual = None
    if geo.rope_residual:
        q_residual, k_residual = rotary_residual(tensors["q"], tensors["k"], q_rope, k_rope, geo)
        q_nope = torch.cat([q_nope, q_residual], dim=1)
    kv = stacked_kv(tensors["k"], tensors["v"], geo, k_residual)
    if solution is None:
        (down, up), rms = joint_svd(kv, gain, geo.kv_rank), 1.0
    else:
        down, up, rms = solution.down, kv @ solution.fit, solution.rms
    query = torch.cat([q_nope, q_rope], dim=1).reshape(-1, tensors["q"].shape[-1]) * geo.query_scale
    kv_a = torch.cat([down, k_rope])
    return {
        deepseek_v2.Q_PROJ: query.to(dtype),
        deepseek_v2.KV_A_PROJ: kv_a.to(dtype),
        deepseek_v2.KV_A_NORM: torch.full((geo.kv_rank,), rms, dtype=dtype),
        deepseek_v2.KV_B_PROJ: up.to(dtype),
    }


def check_gains(checkpoint: SourceCheckpoint, geo: MLAGeometry) -> None:
    """The latent is written from n = x / g (`joint_svd`): every input RMSNorm gain must be nonzero.
    Read before anything is written (a hidden size of numbers per layer)."""
    for layer in range(geo.num_layers):
        if (checkpoint.read_tensor(INPUT_NORM.format(layer)) == 0).any():
            raise UptrainError(
                f"--target mla: layer {layer}'s input_layernorm has a weight of 0, so its latent cannot be written "
                "as a rotation of the normalised hidden state"
            )


def _output_names(checkpoint: SourceCheckpoint, geo: MLAGeometry, tied: bool) -> list[tuple[str, str | None]]:
    """(output name, source name or None for a computed tensor), in the source's file order with
    each layer's attention in place of its q/k/v_proj; with `tied` embeddings, the head written
    too, as a copy of them (`tied_head`)."""
    replaced = {LAYER.format(i) + f"{p}_proj.weight": i for i in range(geo.num_layers) for p in "qkv"}
    missing = sorted(name for name in replaced if name not in checkpoint.tensors)
    if missing:
        raise UptrainError(f"--target mla: the checkpoint has no {missing[0]} (not a Llama checkpoint)")
    names: list[tuple[str, str | None]] = []
    for info in checkpoint.order():
        layer = replaced.get(info.name)
        if layer is None:
            names.append((info.name, info.name))
        elif info.name.endswith("q_proj.weight"):
            prefix = LAYER.format(layer)
            names += [(prefix + part, None) for part in deepseek_v2.LAYER_TENSORS]
    if tied and HEAD not in checkpoint.tensors and EMBEDDINGS in checkpoint.tensors:
        names.append((HEAD, EMBEDDINGS))
    return names


def tied_head(config: dict) -> bool:
    """Whether the output writes `lm_head.weight` as a copy of the embeddings: when the source ties
    them (config `tie_word_embeddings`, Llama's default False). The config keeps the tie, so
    transformers (which ties on load) runs the same model and trains one matrix; vLLM 0.32's
    `DeepseekV2ForCausalLM` never ties, and without the copy its head stays zeros: every logit 0,
    token 0 each step, silently. The copy costs vocabulary × hidden elements on disk only."""
    return bool(config.get("tie_word_embeddings", False))


def _entries(names, checkpoint: SourceCheckpoint, geo: MLAGeometry, cast) -> list[OutputEntry]:
    attention_dtype = checkpoint.tensors[LAYER.format(0) + "q_proj.weight"].dtype
    shapes = {
        deepseek_v2.Q_PROJ: (geo.num_heads * (geo.nope_dims + geo.rope_dims), geo.hidden),
        deepseek_v2.KV_A_PROJ: (geo.kv_rank + geo.rope_dims, geo.hidden),
        deepseek_v2.KV_A_NORM: (geo.kv_rank,),
        deepseek_v2.KV_B_PROJ: (geo.num_heads * (geo.nope_dims + geo.head_dim), geo.kv_rank),
    }
    entries = []
    for name, source in names:
        if source is None:
            entries.append(OutputEntry(name, cast or attention_dtype, shapes[name.rsplit("self_attn.", 1)[1]]))
        else:
            info = checkpoint.tensors[source]
            floating = isinstance(info.dtype, torch.dtype) and info.dtype.is_floating_point
            entries.append(OutputEntry(name, cast if cast and floating else info.dtype, info.shape))
    return entries


def _tensors(names, checkpoint: SourceCheckpoint, geo: MLAGeometry, cast, solutions: LatentSolutions | None):
    """Each output tensor in order; a layer's attention computed when its first tensor is due
    (its latent solved by calibration where `solutions` holds it)."""
    done: dict[str, torch.Tensor] = {}
    for name, source in names:
        if source is not None:
            tensor = checkpoint.read_tensor(source)
            yield tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor
            continue
        prefix, part = name.rsplit("self_attn.", 1)
        if part == deepseek_v2.Q_PROJ:
            layer = int(prefix.split(".")[2])
            read = {p: checkpoint.read_tensor(LAYER.format(layer) + f"{p}_proj.weight") for p in "qkv"}
            gain = checkpoint.read_tensor(INPUT_NORM.format(layer))
            done = layer_attention(read, gain, geo, None if solutions is None else solutions[layer])
        tensor = done.pop(part)
        yield tensor.to(cast) if cast is not None else tensor


def kv_elements_per_token(geo: MLAGeometry) -> dict[str, int]:
    """KV-cache elements per token per layer: the latent and shared rotary key, against the source's K/V."""
    return {
        "mla": deepseek_v2.latent_elements_per_token(geo.kv_rank, geo.rope_dims),
        "source": 2 * geo.num_kv_heads * geo.head_dim,
        "mha": 2 * geo.num_heads * geo.head_dim,
    }


MLA_INITS = {
    "svd": "joint SVD of the non-rotary keys and values in weight space (MHA2MLA's ablation)",
    "calibrated": "PCA of the non-rotary keys' and values' activations on calibration data, weighted by what the "
    "queries and o_proj read (in the spirit of CARE and TransMLA), the latent norm's weight the latent's measured rms",
}


def mla_record(source, source_files: dict, geo: MLAGeometry, dtype: str | None, init: str = "svd") -> dict:
    """The `uptrain.json` of an MLA conversion."""
    return {
        **source_record(source, source_files),
        "model_type": "llama",
        "target": "mla",
        "initialisation": init,
        "initialisation_reference": MLA_INITS[init],
        "dtype": dtype,
        "num_attention_heads": geo.num_heads,
        "source_num_key_value_heads": geo.num_kv_heads,
        "kv_lora_rank": geo.kv_rank,
        "qk_rope_head_dim": geo.rope_dims,
        "rotary_frequencies_kept": geo.rope_frequencies,
        "rotary_residual_frequencies": geo.residual_frequencies,
        "rotary_key": geo.rotary_key,
        "kv_elements_per_token_per_layer": kv_elements_per_token(geo),
    }


def residual_text(residual: list[int] | None) -> str:
    """The card's sentence on `--rope-residual`."""
    if not residual:
        return "what it misses of each head's rotary key is dropped."
    return f"what it misses of each head's rotary key at frequencies {residual} is kept in the latent, unrotated."


# kv_lora_rank + qk_rope_head_dim that vLLM 0.32's MLA backends take: its GPU ones
# (`MLACommonBackend.get_supported_head_sizes`), and the CPU ones (`CPU_MLA`, `AMX_MLA`: DeepSeek's 512 + 64).
VLLM_LATENT_SIZES = (320, 512, 576)
VLLM_CPU_LATENT_SIZE = 576


def vllm_serving(p: dict) -> str:
    """The card's line on serving in vLLM, from the latent's size (docs/concepts/mla.md, "Serving")."""
    size = p["kv_lora_rank"] + p["qk_rope_head_dim"]
    if size == VLLM_CPU_LATENT_SIZE:
        return "vLLM serves it as `DeepseekV2ForCausalLM` on GPU and on CPU (bfloat16 or float16 there)."
    if size in VLLM_LATENT_SIZES:
        return (
            f"vLLM serves it as `DeepseekV2ForCausalLM` on GPU; not on CPU, whose MLA kernels take a latent and "
            f"rotary key of {VLLM_CPU_LATENT_SIZE} elements only (this one has {size})."
        )
    sizes = ", ".join(map(str, VLLM_LATENT_SIZES))
    return (
        f"vLLM does not serve it: its MLA kernels take a latent and rotary key of {sizes} elements only "
        f"(this one has {size}); convert with `--kv-rank R --rope-dims D` giving one of those to serve it there."
    )


def mla_card(p: dict, source_card: dict) -> str:
    """README.md of an MLA conversion."""
    elements = p["kv_elements_per_token_per_layer"]
    body = f"""# llama as multi-head latent attention (DeepSeek-V2 layout, converted by uptrain)

Converted from `{p["source"]}` ({p["num_attention_heads"]} query heads, {p["source_num_key_value_heads"]} KV heads) \
to multi-head latent attention: a latent of rank {p["kv_lora_rank"]} and one rotary key of \
{p["qk_rope_head_dim"]} columns shared by every head, {elements["mla"]} cached elements per token and layer \
against the source's {elements["source"]} ({elements["mla"] / elements["mha"]:.4g} of multi-head attention's).

Initialisation: {p["initialisation_reference"]} (`{p["initialisation"]}`). \
Rotary frequencies kept (the source's, 0 the highest): {p["rotary_frequencies_kept"]}; \
the shared rotary key: {ROTARY_KEY_TEXT[p["rotary_key"]]} (`{p["rotary_key"]}`); \
{residual_text(p.get("rotary_residual_frequencies"))} \
Loads with transformers' own `DeepseekV2ForCausalLM` (4.57 and 5). {vllm_serving(p)}

The weights have not been trained since conversion: uptrain them before use.
`uptrain.json` records the source files' digests and the uptrain version ({p["uptrain_version"]}).
"""
    return front_matter(p["base_model"], source_card, ["llama"], attention="mla") + "\n" + body


def _read_layer(checkpoint: SourceCheckpoint, layer: int, geo: MLAGeometry):
    """A layer's q/k/v/o_proj weights, input norm gain and `reader_rows`, for `--mla-init
    calibrated`'s solver."""
    tensors = {p: checkpoint.read_tensor(LAYER.format(layer) + f"{p}_proj.weight") for p in "qkvo"}
    return tensors, checkpoint.read_tensor(INPUT_NORM.format(layer)), reader_rows(tensors, geo)


def _check_calibration_inputs(spec: ConversionSpec, folder: Path) -> None:
    """What `--mla-init calibrated` will read, checked before any of it runs (as the GQA route's)."""
    from uptrain.convert.calibration import calibration_device, load_calibration_tokenizer
    from uptrain.data.text import resolve_data

    resolve_data(spec.calibration_data, "calibration_data")
    load_calibration_tokenizer(folder)
    calibration_device(spec.calibration_device, spec.calibration_dtype)


def calibrate_latents(
    spec: ConversionSpec, folder: Path, checkpoint: SourceCheckpoint, geo: MLAGeometry, progress: bool | None
) -> tuple[LatentSolutions, dict]:
    """Every layer's latent solved from the calibrated GQA merge's moments, each as soon as its
    layer is calibrated (`collect_attention_moments(per_layer=…)`); the calibration's description."""
    from uptrain.convert.calibration import collect_attention_moments

    solutions = LatentSolutions()
    solve = layer_solver(lambda layer: _read_layer(checkpoint, layer, geo), geo, solutions)
    _, info = collect_attention_moments(
        folder, spec.calibration_data, CalibrationSettings.of(spec), progress=progress, per_layer=solve
    )
    return solutions, info


def checked_latent(spec: ConversionSpec):
    """The resolved source once its layout takes the latent `spec` asks for (one line otherwise:
    another family, biases, scaled rotary, a rank or budget it cannot give), reading only its
    config: what `convert_mla` refuses, checked before anything is written elsewhere."""
    source = resolve_source(spec.source)
    mla_geometry(
        read_config(source.folder),
        spec.kv_rank,
        spec.rope_dims,
        spec.kv_budget,
        spec.rotary_key,
        spec.rope_stride,
        spec.rope_residual,
    )
    return source


def convert_mla(spec: ConversionSpec, out: str | Path, overwrite: bool = False, progress: bool | None = None) -> Path:
    """Every check first (nothing written on a refusal), then calibrate when asked, then stream the
    conversion into `out`."""
    max_shard_bytes = parse_size(spec.max_shard_size)
    out = Path(out).absolute()
    check_output_path(out, overwrite)
    source = resolve_source(spec.source)
    check_apart(out, [("source checkpoint", source.folder)])
    config = read_config(source.folder)
    geo = mla_geometry(
        config, spec.kv_rank, spec.rope_dims, spec.kv_budget, spec.rotary_key, spec.rope_stride, spec.rope_residual
    )
    cast = DTYPES[spec.dtype] if spec.dtype is not None else None
    checkpoint = SourceCheckpoint(source.folder, allow_pickle=spec.allow_pickle)
    try:
        names = _output_names(checkpoint, geo, tied_head(config))
        check_gains(checkpoint, geo)
        entries = _entries(names, checkpoint, geo, cast)
        solutions, calibration = None, None
        if spec.mla_init == "calibrated":
            _check_calibration_inputs(spec, source.folder)
            solutions, calibration = calibrate_latents(spec, source.folder, checkpoint, geo, progress)
        with (
            atomic_directory(out, overwrite) as tmp,
            BackgroundHasher(checkpoint.files, spec.source_hash) as hasher,
        ):
            with ShardedWriter(tmp, entries, max_shard_bytes) as writer:
                for (name, _), tensor in zip(names, _tensors(names, checkpoint, geo, cast, solutions), strict=True):
                    writer.begin(name)
                    writer.write(tensor_bytes(tensor.contiguous()))
            written = deepseek_v2.mla_config(
                config, geo.kv_rank, geo.rope_dims, geo.head_dim, geo.rope_theta, geo.rope_stride, geo.nope_dims
            )
            set_dtype(written, spec.dtype)
            (tmp / "config.json").write_text(json.dumps(written, indent=2) + "\n")
            copy_side_files(source.folder, tmp, written)
            record = mla_record(source, hasher.result(), geo, spec.dtype, spec.mla_init)
            if calibration is not None:
                record["calibration"] = calibration
            if spec.kv_budget is not None:
                record["kv_budget"] = spec.kv_budget
            (tmp / "uptrain.json").write_text(json.dumps(record, indent=2) + "\n")
            (tmp / "README.md").write_text(mla_card(record, card_metadata(source.folder)))
    finally:
        checkpoint.close()
    return out
