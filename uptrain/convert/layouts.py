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

An encoder–decoder (T5, BART, mBART, Marian, Whisper: `ENCODER_DECODER_LAYOUTS`) has three
attentions per model, each an `AttentionSite`: the encoder's self-attention ("encoder"), the
decoder's self-attention ("decoder-self") and the decoder's cross-attention ("cross"), each with
its own `AttentionLayout` and the config keys that give its layers and heads. A decoder-only
model has one, "decoder-self" (`attention_stacks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from uptrain import UptrainError
from uptrain.model_info import AttentionGeometry, attention_geometry, stack_geometry
from uptrain.modeling_table import STACK_KV_HEADS

# The attentions of an encoder–decoder, as `uptrain convert --attention` names them.
ATTENTIONS: tuple[str, ...] = tuple(STACK_KV_HEADS)  # "encoder", "decoder-self", "cross"
DECODER_SELF = "decoder-self"


@dataclass(frozen=True)
class AttentionLayout:
    attn_prefix: str = "model.layers.{layer}.self_attn"
    # Query and output projections: rewritten only by whole-layer merges (calibrated, similarity).
    q_proj: str = "q_proj"
    o_proj: str = "o_proj"
    kv_modules: tuple[str, ...] = ("k_proj", "v_proj")
    # Row-pooled tensors inside each module ("weight", "bias" when present).
    kv_rows: tuple[str, ...] = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
    # The kv_rows every layer must have (the rest, biases and norms, are optional).
    kv_weights: tuple[str, ...] = ("k_proj.weight", "v_proj.weight")
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
    # Where the init std is a factor × width^-½ (T5: initializer_factor × d_model^-½ for K and V),
    # the config field holding the width.
    init_std_width_key: str | None = None
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
                return new + name[len(old) :]
        return name

    def init_std(self, config: dict) -> float:
        """The std `random` pooling draws fresh K/V weights with, as the architecture's own init does."""
        if self.init_std_width_key is not None:
            return config.get(self.init_std_key, 1.0) * config[self.init_std_width_key] ** -0.5
        return config.get(self.init_std_key, 0.02)

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
    "phi": AttentionLayout(
        o_proj="dense", notes="biases, partial rotary; k_layernorm (optional) is shared by all heads"
    ),
    "phi3": AttentionLayout(
        kv_modules=("qkv_proj",), kv_rows=(), fused_qkv="qkv_proj.weight", notes="fused qkv_proj = [Q | K | V]"
    ),
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
        attn_prefix="transformer.h.{layer}.attn",
        attn_prefix_alternatives=("h.{layer}.attn",),
        q_proj="c_attn",
        o_proj="c_proj",
        kv_modules=("c_attn",),
        kv_rows=(),
        fused_qkv="c_attn.weight",
        fused_qkv_bias="c_attn.bias",
        fused_axis=1,
        head_dim_key=None,
        notes="Conv1D c_attn, weight [in, out], columns [Q | K | V]",
    ),
    "gpt_neox": AttentionLayout(
        attn_prefix="gpt_neox.layers.{layer}.attention",
        q_proj="query_key_value",
        o_proj="dense",
        kv_modules=("query_key_value",),
        kv_rows=(),
        fused_qkv="query_key_value.weight",
        fused_qkv_bias="query_key_value.bias",
        fused_order="per_group",
        head_dim_key=None,
        renames=(("embed_out.", "lm_head."),),  # transformers renames it for GPTNeoXForCausalLM only
        notes="query_key_value rows [h, 3, d] interleaved per head; partial rotary",
    ),
    "opt": AttentionLayout(
        attn_prefix="model.decoder.layers.{layer}.self_attn",
        attn_prefix_alternatives=("decoder.layers.{layer}.self_attn",),
        o_proj="out_proj",
        head_dim_key=None,
        init_std_key="init_std",
        notes="separate projections with biases; no RoPE",
    ),
    "gptj": AttentionLayout(
        attn_prefix="transformer.h.{layer}.attn",
        o_proj="out_proj",
        head_dim_key=None,
        notes="separate projections, no biases; rotary on the first rotary_dim dims, adjacent pairs",
    ),
    "bloom": AttentionLayout(
        attn_prefix="transformer.h.{layer}.self_attention",
        attn_prefix_alternatives=("h.{layer}.self_attention",),
        q_proj="query_key_value",
        o_proj="dense",
        kv_modules=("query_key_value",),
        kv_rows=(),
        fused_qkv="query_key_value.weight",
        fused_qkv_bias="query_key_value.bias",
        fused_order="per_group",
        head_dim_key=None,
        notes="query_key_value rows [h, 3, d] interleaved per head; ALiBi slopes stay with the query heads",
    ),
    "gpt_neo": AttentionLayout(
        attn_prefix="transformer.h.{layer}.attn.attention",
        o_proj="out_proj",
        head_dim_key=None,
        notes="separate projections, no biases (out_proj has one); no RoPE, no 1/√d; global and local layers",
    ),
}
# A converted checkpoint (uptrain's modeling) keeps its source's layout with G KV heads.
LAYOUTS.update({f"{name}_gqa": LAYOUTS[name] for name in ("gpt2", "gpt_neox", "opt", "gptj", "bloom", "gpt_neo")})


@dataclass(frozen=True)
class AttentionSite:
    """One attention of an encoder–decoder: its tensors, and the config keys of its geometry."""

    attention: str  # one of ATTENTIONS
    layout: AttentionLayout  # attn_prefix with {layer}, relative to the checkpoint's root
    layers_key: str
    heads_key: str
    layers_fallback_key: str | None = None  # T5: num_decoder_layers, when absent, is num_layers


@dataclass(frozen=True)
class EncoderDecoderLayout:
    """The attentions of an encoder–decoder. Every site shares `head_dim_key` (None: d_model //
    its heads) and the init std; only the K/V of the attentions a conversion chooses change."""

    sites: tuple[AttentionSite, ...]
    head_dim_key: str | None = None
    hidden_key: str = "d_model"
    # The encoder's positions that each cross-attention layer caches whole (Whisper: 1500 audio
    # frames, 30 s); None where the source length is the input's (text).
    source_positions_key: str | None = None
    source_unit: str = "source token"
    pipeline_tag: str = "text2text-generation"  # the Hub task of the model card
    notes: str = ""

    def site(self, attention: str) -> AttentionSite:
        return next(s for s in self.sites if s.attention == attention)

    def output_name(self, name: str) -> str:
        return name

    def init_std(self, config: dict) -> float:
        return self.site(DECODER_SELF).layout.init_std(config)


def _t5_attention(prefix: str, what: str) -> AttentionLayout:
    return AttentionLayout(
        attn_prefix=prefix,
        q_proj="q",
        o_proj="o",
        kv_modules=("k", "v"),
        kv_rows=("k.weight", "v.weight"),
        kv_weights=("k.weight", "v.weight"),
        head_dim_key="d_kv",
        init_std_key="initializer_factor",
        init_std_width_key="d_model",
        notes=what,
    )


T5 = EncoderDecoderLayout(
    sites=(
        AttentionSite(
            "encoder",
            _t5_attention("encoder.block.{layer}.layer.0.SelfAttention", "encoder"),
            "num_layers",
            "num_heads",
        ),
        AttentionSite(
            DECODER_SELF,
            _t5_attention("decoder.block.{layer}.layer.0.SelfAttention", "decoder self-attention"),
            "num_decoder_layers",
            "num_heads",
            "num_layers",
        ),
        AttentionSite(
            "cross",
            _t5_attention("decoder.block.{layer}.layer.1.EncDecAttention", "cross-attention"),
            "num_decoder_layers",
            "num_heads",
            "num_layers",
        ),
    ),
    head_dim_key="d_kv",
    notes="no biases; d_kv independent of d_model / num_heads; the relative_attention_bias of block 0 "
    "(one column per query head) stays with the query heads",
)


def _bart_attention(prefix: str, what: str) -> AttentionLayout:
    return AttentionLayout(
        attn_prefix=prefix,
        # A base model (BartModel, WhisperModel) is saved without the "model." of the task model.
        attn_prefix_alternatives=(prefix.removeprefix("model."),),
        o_proj="out_proj",
        head_dim_key=None,
        init_std_key="init_std",
        notes=what,
    )


def _bart_family(**extra) -> EncoderDecoderLayout:
    return EncoderDecoderLayout(
        sites=(
            AttentionSite(
                "encoder",
                _bart_attention("model.encoder.layers.{layer}.self_attn", "encoder"),
                "encoder_layers",
                "encoder_attention_heads",
            ),
            AttentionSite(
                DECODER_SELF,
                _bart_attention("model.decoder.layers.{layer}.self_attn", "decoder self-attention"),
                "decoder_layers",
                "decoder_attention_heads",
            ),
            # Cross-attention has the decoder's heads; its K and V read the encoder's states.
            AttentionSite(
                "cross",
                _bart_attention("model.decoder.layers.{layer}.encoder_attn", "cross-attention"),
                "decoder_layers",
                "decoder_attention_heads",
            ),
        ),
        **extra,
    )


ENCODER_DECODER_LAYOUTS: dict[str, EncoderDecoderLayout] = {
    "t5": T5,  # also T5 v1.1 and Flan-T5 (gated-GELU feed-forward): the same attention
    "mt5": T5,
    "bart": _bart_family(notes="q/k/v biases; head_dim = d_model // heads"),
    "mbart": _bart_family(notes="q/k/v biases; head_dim = d_model // heads"),
    "marian": _bart_family(pipeline_tag="translation", notes="q/k/v biases; head_dim = d_model // heads"),
    "whisper": _bart_family(
        source_positions_key="max_source_positions",
        source_unit="audio frame",
        pipeline_tag="automatic-speech-recognition",
        notes="k_proj has no bias; the encoder sees max_source_positions (1500) audio frames",
    ),
}
# A converted checkpoint keeps its source's layout with fewer KV heads (mt5 becomes t5_gqa).
ENCODER_DECODER_LAYOUTS.update(
    {f"{name}_gqa": ENCODER_DECODER_LAYOUTS[name] for name in ("t5", "bart", "mbart", "marian", "whisper")}
)

Layout = AttentionLayout | EncoderDecoderLayout


def layout_for(model_type: str | None) -> Layout:
    """The layout of a model_type: one attention (decoder-only) or an encoder–decoder's three."""
    if model_type in LAYOUTS:
        return LAYOUTS[model_type]
    if model_type in ENCODER_DECODER_LAYOUTS:
        return ENCODER_DECODER_LAYOUTS[model_type]
    supported = ", ".join(sorted([*LAYOUTS, *ENCODER_DECODER_LAYOUTS]))
    raise UptrainError(f"unsupported model_type {model_type!r}; supported: {supported}")


def is_convertible(model_type: str | None) -> bool:
    return model_type in LAYOUTS or model_type in ENCODER_DECODER_LAYOUTS


@dataclass(frozen=True)
class AttentionStack:
    """One attention of a model (every layer of it): its tensors and its geometry."""

    attention: str  # one of ATTENTIONS
    layout: AttentionLayout
    geometry: AttentionGeometry


def attention_stacks(config: dict, layout: Layout) -> dict[str, AttentionStack]:
    """Every attention of the model, in ATTENTIONS order: a decoder-only model's one
    ("decoder-self"), an encoder–decoder's three, each with its geometry read from `config`."""
    if isinstance(layout, AttentionLayout):
        return {DECODER_SELF: AttentionStack(DECODER_SELF, layout, attention_geometry(config, layout.head_dim_key))}
    return {
        site.attention: AttentionStack(
            site.attention,
            site.layout,
            stack_geometry(
                config,
                layers_key=site.layers_key,
                heads_key=site.heads_key,
                kv_heads_key=STACK_KV_HEADS[site.attention],
                head_dim_key=layout.head_dim_key,
                hidden_key=layout.hidden_key,
                layers_fallback_key=site.layers_fallback_key,
            ),
        )
        for site in layout.sites
    }


def config_geometry(config: dict) -> AttentionGeometry:
    """The attention geometry of a config, with its layout's `head_dim_key` (transformers' own
    reading of `head_dim` for a model_type uptrain has no layout for). For an encoder–decoder,
    its decoder self-attention's: the cache that grows with each generated token."""
    model_type = config.get("model_type")
    if model_type in ENCODER_DECODER_LAYOUTS:
        return attention_stacks(config, ENCODER_DECODER_LAYOUTS[model_type])[DECODER_SELF].geometry
    return attention_geometry(config, LAYOUTS.get(model_type, STANDARD).head_dim_key)
