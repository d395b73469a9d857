"""One layer's Q, K, V and O as its layout stores them, read into and written from `LayerAttention`.

Whole-layer merges work on `[heads · d, D]` projections (`nn.Linear`'s `[out, in]`) and an
output projection `[D, h · d]`. Layouts store them as:
- separate projections: `q_proj`, the K and V modules of `kv_weights` (`k_proj`, T5's `k`),
  `o_proj`, each with an optional bias;
- one fused projection (`fused_qkv`, `fused_qkv_bias`) holding Q, K and V in `fused_order`
  along `fused_axis` (`split_qkv` / `join_qkv`, which row pooling uses too);
- an output projection stored `[in, out]` (`o_proj_transposed`: GPT-2's Conv1D `c_proj`).
Nothing here depends on the model_type: the layout says everything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from uptrain import UptrainError
from uptrain.architecture import AttentionLayout
from uptrain.model_info import AttentionGeometry

# LayerAttention's tensor fields.
FIELDS = ("q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w")


def split_qkv(
    t: torch.Tensor, heads: int, kv_heads: int, d: int, order: str, axis: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q `[h·d, *rest]`, K and V `[kv·d, *rest]` of a fused tensor (`AttentionLayout.fused_order`
    along `axis`), rows first."""
    x = t.movedim(axis, 0)
    rest = x.shape[1:]
    if order == "blocks":
        q, k, v = x.split([heads * d, kv_heads * d, kv_heads * d])
        return q, k, v
    grouped = x.reshape(kv_heads, heads // kv_heads + 2, d, *rest)
    return tuple(part.reshape(-1, *rest) for part in (grouped[:, :-2], grouped[:, -2], grouped[:, -1]))


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: int, order: str, axis: int) -> torch.Tensor:
    """The fused tensor of Q, K and V rows (`split_qkv`'s inverse), with K and V's heads."""
    rest = q.shape[1:]
    heads, kv_heads = q.shape[0] // d, k.shape[0] // d
    if order == "blocks":
        out = torch.cat([q, k, v])
    else:
        out = torch.cat(
            [
                q.reshape(kv_heads, heads // kv_heads, d, *rest),
                k.reshape(kv_heads, 1, d, *rest),
                v.reshape(kv_heads, 1, d, *rest),
            ],
            dim=1,
        )
    return out.reshape((heads + 2 * kv_heads) * d, *rest).movedim(0, axis)


def _separate_modules(layout: AttentionLayout) -> dict[str, str]:
    k_module, v_module = (w.rsplit(".", 1)[0] for w in layout.kv_weights)
    return {"q": layout.q_proj, "k": k_module, "v": v_module}


def _o_weight(layout: AttentionLayout) -> str:
    return f"{layout.o_proj}.weight"


def merge_tensor_names(layout: AttentionLayout) -> tuple[str, ...]:
    """The tensors of one layer (relative to its attention module) a whole-layer merge reads and
    rewrites; biases among them are optional. The output projection's bias is left as it is."""
    if layout.fused_qkv is not None:
        fused = (layout.fused_qkv,) + ((layout.fused_qkv_bias,) if layout.fused_qkv_bias else ())
        return (*fused, _o_weight(layout))
    modules = _separate_modules(layout)
    return (*(f"{modules[p]}.{kind}" for p in "qkv" for kind in ("weight", "bias")), _o_weight(layout))


def required_tensors(layout: AttentionLayout) -> tuple[str, ...]:
    """The `merge_tensor_names` every layer must have (the rest are biases)."""
    return tuple(n for n in merge_tensor_names(layout) if n.endswith(".weight"))


def kv_field_name(layout: AttentionLayout, field: str) -> str:
    """The name a K/V field ('k_w', 'v_b', …) is known by when its rows are pooled (what seeds
    `random`): its tensor, or for a fused one the tensor and the part, as `pool_fused` names it."""
    part, kind = field.split("_")
    if layout.fused_qkv is not None:
        return f"{layout.fused_qkv if kind == 'w' else layout.fused_qkv_bias}:{part}"
    return f"{_separate_modules(layout)[part]}.{'weight' if kind == 'w' else 'bias'}"


def read_fields(
    read: Callable[[str], torch.Tensor | None], layout: AttentionLayout, geometry: AttentionGeometry
) -> dict[str, torch.Tensor | None]:
    """LayerAttention's tensor fields from `read(relative name)` (None: the tensor is absent)."""
    h, kv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
    o_w = read(_o_weight(layout))
    fields: dict[str, torch.Tensor | None] = {"o_w": o_w.mT if layout.o_proj_transposed else o_w}
    if layout.fused_qkv is not None:
        weight = split_qkv(read(layout.fused_qkv), h, kv, d, layout.fused_order, layout.fused_axis)
        bias = read(layout.fused_qkv_bias) if layout.fused_qkv_bias else None
        biases = (None,) * 3 if bias is None else split_qkv(bias, h, kv, d, layout.fused_order, 0)
        for p, w, b in zip("qkv", weight, biases):
            fields[f"{p}_w"], fields[f"{p}_b"] = w, b
        return fields
    for p, module in _separate_modules(layout).items():
        fields[f"{p}_w"], fields[f"{p}_b"] = read(f"{module}.weight"), read(f"{module}.bias")
    return fields


def written_tensors(fields: dict[str, torch.Tensor | None], layout: AttentionLayout, d: int) -> dict[str, torch.Tensor]:
    """The stored tensors (relative names) of a merged layer's fields (`read_fields`' inverse)."""
    o_w = fields["o_w"]
    out = {_o_weight(layout): o_w.mT if layout.o_proj_transposed else o_w}
    if layout.fused_qkv is not None:
        out[layout.fused_qkv] = join_qkv(
            fields["q_w"], fields["k_w"], fields["v_w"], d, layout.fused_order, layout.fused_axis
        )
        if fields["q_b"] is not None:
            out[layout.fused_qkv_bias] = join_qkv(fields["q_b"], fields["k_b"], fields["v_b"], d, layout.fused_order, 0)
        return out
    for p, module in _separate_modules(layout).items():
        out[f"{module}.weight"] = fields[f"{p}_w"]
        if fields[f"{p}_b"] is not None:
            out[f"{module}.bias"] = fields[f"{p}_b"]
    return out


def merged_shapes(
    shapes: dict[str, tuple[int, ...]], layout: AttentionLayout, geometry: AttentionGeometry, g: int, prefix: str
) -> dict[str, tuple[int, ...]]:
    """The output shape of each of one layer's `merge_tensor_names` present in `shapes`
    (relative name → source shape), checked against the geometry; `prefix` names them in messages."""
    h, kv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
    for rel in required_tensors(layout):
        if rel not in shapes:
            raise UptrainError(f"{prefix}{rel} is missing: checkpoint does not match the {geometry.model_type} layout")
    out = {}
    for rel in merge_tensor_names(layout):
        if rel not in shapes:
            continue
        shape = list(shapes[rel])
        if rel == _o_weight(layout):
            axis, heads, new_heads = (0 if layout.o_proj_transposed else 1), h, h
        elif layout.fused_qkv is not None:
            axis = layout.fused_axis if rel == layout.fused_qkv else 0
            heads, new_heads = h + 2 * kv, h + 2 * g
        else:
            axis = 0
            heads, new_heads = (h, h) if rel.startswith(f"{layout.q_proj}.") else (kv, g)
        if len(shape) <= axis or shape[axis] != heads * d:
            raise UptrainError(
                f"{prefix}{rel} has shape {tuple(shape)}, expected {heads} heads × {d} = {heads * d} along dim {axis}"
            )
        shape[axis] = new_heads * d
        out[rel] = tuple(shape)
    return out
