"""Where each architecture keeps its K/V projections, as data looked up by `model_type`.

Every name below is relative to one layer's attention module, `attn_prefix` with the layer
index filled in. A K/V tensor is one of:
- `kv_rows`: rows are `[num_kv_heads * head_dim]` (K/V weight or bias, OLMo-2's k_norm).
- `fused_qkv` (+ `fused_qkv_bias`): one projection holding Q, K and V, ordered by
  `fused_order` along `fused_axis`:
  - "blocks": `[Q (h·d) | K (G·d) | V (G·d)]` (Phi-3 rows; GPT-2's Conv1D columns, axis 1 of
    its `[in, out]` weight);
  - "per_group": `[G, r + 2, d]` with r = h / G: each KV head's r query heads, then its K,
    then its V. At G = h this is `[h, 3, d]`, the per-head interleaving of GPT-NeoX and BLOOM.
- `per_head_kv`: one module per KV head, `{head}` filled in (StableLM's per-head k LayerNorm).

Architectures without native GQA in transformers (gpt2, gpt_neox, opt, gptj, bloom) convert to
uptrain's own modeling (`uptrain.modeling`), which reads the same layouts with G heads; their
converted model_types (gpt2_gqa, …) are listed too, so a converted checkpoint can be pooled further.
"""

from __future__ import annotations

from dataclasses import dataclass

from uptrain import UptrainError
from uptrain.model_info import AttentionGeometry, attention_geometry


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
    fused_qkv_bias: str | None = None
    fused_order: str = "blocks"  # or "per_group"
    fused_axis: int = 0  # 1 for a Conv1D weight, stored [in, out]
    per_head_kv: tuple[str, ...] = ()
    # Config field that overrides hidden_size // heads; None where the modeling code ignores it.
    head_dim_key: str | None = "head_dim"
    # Config field holding the std of the architecture's weight init, which `random` pooling draws
    # fresh K/V weights with (transformers' default 0.02 when the config lacks it).
    init_std_key: str = "initializer_range"
    # Other spellings of `attn_prefix` found in published checkpoints (GPT-2 and BLOOM were
    # saved without the base model's "transformer." prefix); the one the checkpoint uses is read.
    attn_prefix_alternatives: tuple[str, ...] = ()
    # (old, new) name prefixes renamed in the output, where transformers renames a key on
    # loading by the source's class name, which uptrain's modeling classes do not share.
    renames: tuple[tuple[str, str], ...] = ()
    notes: str = ""

    def output_name(self, name: str) -> str:
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def attn_prefix_in(self, names) -> str:
        """The `attn_prefix` template the checkpoint with these tensor names uses."""
        for template in (self.attn_prefix, *self.attn_prefix_alternatives):
            first = template.format(layer=0) + "."
            if any(n.startswith(first) for n in names):
                return template
        return self.attn_prefix


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
    "gpt2": AttentionLayout(
        attn_prefix="transformer.h.{layer}.attn", attn_prefix_alternatives=("h.{layer}.attn",), q_proj="c_attn",
        o_proj="c_proj", kv_modules=("c_attn",), kv_rows=(), fused_qkv="c_attn.weight", fused_qkv_bias="c_attn.bias",
        fused_axis=1, head_dim_key=None, notes="Conv1D c_attn, weight [in, out], columns [Q | K | V]"),
    "gpt_neox": AttentionLayout(
        attn_prefix="gpt_neox.layers.{layer}.attention", q_proj="query_key_value", o_proj="dense",
        kv_modules=("query_key_value",), kv_rows=(), fused_qkv="query_key_value.weight",
        fused_qkv_bias="query_key_value.bias", fused_order="per_group", head_dim_key=None,
        renames=(("embed_out.", "lm_head."),),  # transformers renames it for GPTNeoXForCausalLM only
        notes="query_key_value rows [h, 3, d] interleaved per head; partial rotary"),
    "opt": AttentionLayout(
        attn_prefix="model.decoder.layers.{layer}.self_attn",
        attn_prefix_alternatives=("decoder.layers.{layer}.self_attn",), o_proj="out_proj", head_dim_key=None,
        init_std_key="init_std", notes="separate projections with biases; no RoPE"),
    "gptj": AttentionLayout(
        attn_prefix="transformer.h.{layer}.attn", o_proj="out_proj", head_dim_key=None,
        notes="separate projections, no biases; rotary on the first rotary_dim dims, adjacent pairs"),
    "bloom": AttentionLayout(
        attn_prefix="transformer.h.{layer}.self_attention", attn_prefix_alternatives=("h.{layer}.self_attention",),
        q_proj="query_key_value", o_proj="dense", kv_modules=("query_key_value",), kv_rows=(),
        fused_qkv="query_key_value.weight", fused_qkv_bias="query_key_value.bias", fused_order="per_group",
        head_dim_key=None,
        notes="query_key_value rows [h, 3, d] interleaved per head; ALiBi slopes stay with the query heads"),
}
# A converted checkpoint (uptrain's modeling) keeps its source's layout with G KV heads.
LAYOUTS.update({f"{name}_gqa": LAYOUTS[name] for name in ("gpt2", "gpt_neox", "opt", "gptj", "bloom")})


def layout_for(model_type: str | None) -> AttentionLayout:
    try:
        return LAYOUTS[model_type]
    except KeyError:
        supported = ", ".join(sorted(LAYOUTS))
        raise UptrainError(f"unsupported model_type {model_type!r}; supported: {supported}") from None


def config_geometry(config: dict) -> AttentionGeometry:
    """The attention geometry of a config, with its layout's `head_dim_key` (transformers' own
    reading of `head_dim` for a model_type uptrain has no layout for)."""
    return attention_geometry(config, LAYOUTS.get(config.get("model_type"), STANDARD).head_dim_key)
