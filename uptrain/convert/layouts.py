"""Where each architecture keeps its K/V projections, as data looked up by `model_type`.

Every name below is relative to one layer's attention module, `attn_prefix` with the layer
index filled in. A K/V tensor is one of:
- `kv_rows`: rows are `[num_kv_heads * head_dim]` (K/V weight or bias, OLMo-2's k_norm).
- `fused_qkv`: one Linear whose rows are `[Q | K | V]` (Phi-3).
- `per_head_kv`: one module per KV head, `{head}` filled in (StableLM's per-head k LayerNorm).
"""

from __future__ import annotations

from dataclasses import dataclass

from uptrain import UptrainError


@dataclass(frozen=True)
class AttentionLayout:
    attn_prefix: str = "model.layers.{layer}.self_attn"
    # Query and output projections: rewritten only by whole-layer merges (calibrated, similarity).
    q_proj: str = "q_proj"
    o_proj: str = "o_proj"
    kv_modules: tuple[str, ...] = ("k_proj", "v_proj")
    # Row-pooled tensors inside each module ("weight", "bias" when present).
    kv_rows: tuple[str, ...] = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
    fused_qkv: str | None = None
    per_head_kv: tuple[str, ...] = ()
    # Config field that overrides hidden_size // heads; None where the modeling code ignores it.
    head_dim_key: str | None = "head_dim"
    notes: str = ""


STANDARD = AttentionLayout()

LAYOUTS: dict[str, AttentionLayout] = {
    "llama": STANDARD,
    "mistral": STANDARD,
    "qwen2": AttentionLayout(notes="q/k/v biases"),
    "qwen3": AttentionLayout(notes="k_norm acts on head_dim only and is shared by all heads"),
    "gemma": AttentionLayout(notes="explicit head_dim"),
    "gemma2": AttentionLayout(notes="explicit head_dim"),
    "phi": AttentionLayout(o_proj="dense", notes="biases, partial rotary; k_layernorm (optional) is shared by all heads"),
    "phi3": AttentionLayout(kv_modules=("qkv_proj",), kv_rows=(), fused_qkv="qkv_proj.weight",
                            notes="fused qkv_proj = [Q | K | V]"),
    "stablelm": AttentionLayout(
        kv_modules=("k_proj", "v_proj", "k_layernorm"),
        per_head_kv=("k_layernorm.norms.{head}.weight", "k_layernorm.norms.{head}.bias"),
        head_dim_key=None,
        notes="optional per-head k LayerNorm; head_dim is always hidden_size // heads",
    ),
    "olmo": STANDARD,
    "olmo2": AttentionLayout(
        kv_modules=("k_proj", "v_proj", "k_norm"),
        kv_rows=STANDARD.kv_rows + ("k_norm.weight",),
        notes="k_norm normalises the whole [num_kv_heads * head_dim] key vector",
    ),
    "starcoder2": AttentionLayout(notes="biases (use_bias)"),
    "granite": STANDARD,
}


def layout_for(model_type: str | None) -> AttentionLayout:
    try:
        return LAYOUTS[model_type]
    except KeyError:
        supported = ", ".join(sorted(LAYOUTS))
        raise UptrainError(f"unsupported model_type {model_type!r}; supported: {supported}") from None
