"""Decoder-only architectures: one attention each ("decoder-self"), read under transformers'
standard config names unless the record names its own (GPT-Neo's num_layers, num_heads). One
record per model_type; see the package docstring."""

from __future__ import annotations

from uptrain.architecture import decilm
from uptrain.architecture.schema import (
    DECODER_SELF,
    Architecture,
    AttentionLayout,
    AttentionSite,
    GeometryKeys,
    GQAModeling,
    RefusedSetting,
    Rotary,
    StackKeys,
    StandardKeys,
)

STANDARD = AttentionLayout()


def decoder_only(
    model_type: str,
    name: str,
    layout: AttentionLayout = STANDARD,
    *,
    head_dim_key: str | None = "head_dim",
    geometry: GeometryKeys | None = None,
    **fields,
) -> Architecture:
    """The record of a decoder-only architecture: its one attention's `layout`, read under the
    standard config names with `head_dim_key` the field that overrides hidden_size // heads (None
    where the modeling ignores it), or under names of its own (`geometry`: `StackKeys`, e.g.
    n_layers, n_heads, d_model)."""
    site = AttentionSite(DECODER_SELF, layout, geometry or StandardKeys(head_dim_key))
    return Architecture(model_type, name, (site,), **fields)


def gqa_modeling(model_type: str, prefix: str) -> GQAModeling:
    """uptrain's modeling of a causal LM: `<model_type>_gqa` with classes `<prefix>GQAConfig`,
    `<prefix>GQAModel` and `<prefix>GQAForCausalLM`."""
    return GQAModeling(f"{model_type}_gqa", f"{prefix}GQAConfig", f"{prefix}GQAModel", f"{prefix}GQAForCausalLM")


def uptrain_modeled(model_type: str, name: str, class_prefix: str, layout: AttentionLayout, **fields) -> Architecture:
    """The record of a decoder-only architecture whose transformers modeling has no
    num_key_value_heads, converted to uptrain's own (`gqa_modeling(model_type, class_prefix)`):
    its head_dim is hidden_size // heads (uptrain's modeling reads no head_dim)."""
    fields = {"head_dim_key": None, **fields}
    return decoder_only(model_type, name, layout, modeling=gqa_modeling(model_type, class_prefix), **fields)


# A fused `query_key_value` whose rows are [h, 3, d], Q, K and V interleaved per head (GPT-NeoX,
# BLOOM), with a `dense` output projection.
PER_HEAD_QKV = dict(
    q_proj="query_key_value",
    o_proj="dense",
    kv_modules=("query_key_value",),
    kv_rows=(),
    fused_qkv="query_key_value.weight",
    fused_qkv_bias="query_key_value.bias",
    fused_order="per_group",
)

# uptrain's modeling of a Llama whose layers have their own KV heads: the DeciLM / Nemotron-NAS
# layout vLLM and llama.cpp serve (`decilm.py`), in uptrain/modeling/modeling_decilm.py.
DECILM_MODELING = GQAModeling(
    decilm.MODEL_TYPE, "DeciLMConfig", "DeciLMModel", decilm.ARCHITECTURE, module_name="modeling_decilm"
)


# Separate K and V projections whose rows are pooled in place: transformers has native GQA.
NATIVE_GQA = (
    decoder_only("llama", "Llama", per_layer_modeling=DECILM_MODELING),
    decoder_only("mistral", "Mistral", per_layer_refusal=("sliding window")),
    decoder_only(
        "qwen2",
        "Qwen2",
        notes="q/k/v biases",
        per_layer_refusal=("q/k/v biases without an o_proj bias (transformers' Llama)"),
    ),
    decoder_only(
        "qwen3",
        "Qwen3",
        notes="k_norm acts on head_dim only and is shared by all heads",
        per_layer_refusal=("q_norm / k_norm"),
    ),
    decoder_only("gemma", "Gemma", notes="explicit head_dim", per_layer_refusal=("embedding scale or GELU MLP")),
    decoder_only(
        "gemma2",
        "Gemma 2",
        notes="explicit head_dim",
        per_layer_refusal=("sliding window, soft-capping or post-norms"),
    ),
    decoder_only(
        "phi",
        "Phi",
        AttentionLayout(o_proj="dense"),
        notes="biases, partial rotary; k_layernorm (optional) is shared by all heads",
        per_layer_refusal=("LayerNorm, parallel MLP or partial rotary"),
    ),
    decoder_only(
        "phi3",
        "Phi-3",
        AttentionLayout(kv_modules=("qkv_proj",), kv_rows=(), fused_qkv="qkv_proj.weight"),
        notes="fused qkv_proj = [Q | K | V]",
        per_layer_refusal=("fused qkv_proj or gate_up_proj (it reads separate projections)"),
    ),
    decoder_only(
        "stablelm",
        "StableLM",
        AttentionLayout(
            kv_modules=("k_proj", "v_proj", "k_layernorm"),
            per_head_kv=("k_layernorm.norms.{head}.weight", "k_layernorm.norms.{head}.bias"),
        ),
        head_dim_key=None,
        notes="optional per-head k LayerNorm; head_dim is always hidden_size // heads",
        per_layer_refusal=("LayerNorm or partial rotary"),
    ),
    decoder_only("olmo", "OLMo", per_layer_refusal=("parameter-free LayerNorm or q/k/v clamp")),
    decoder_only(
        "olmo2",
        "OLMo 2",
        AttentionLayout(kv_modules=("k_proj", "v_proj", "k_norm"), kv_rows=(*STANDARD.kv_rows, "k_norm.weight")),
        notes="k_norm normalises the whole [num_kv_heads * head_dim] key vector",
        per_layer_refusal=("q_norm / k_norm or post-norms"),
    ),
    decoder_only(
        "starcoder2",
        "StarCoder2",
        notes="biases (use_bias)",
        per_layer_refusal=("LayerNorm, biases or ungated MLP"),
    ),
    decoder_only(
        "granite",
        "Granite",
        per_layer_refusal=("embedding, attention, residual or logits multipliers"),
    ),
)

# Architectures whose transformers modeling has no num_key_value_heads: converted to uptrain's
# own (`uptrain_modeled`), which reads the same layout with G heads.
#
# transformers' attribute_map of GPT-2's and GPT-J's config classes (`Architecture.key_aliases`).
GPT2_ALIASES = (
    ("hidden_size", "n_embd"),
    ("max_position_embeddings", "n_positions"),
    ("num_attention_heads", "n_head"),
    ("num_hidden_layers", "n_layer"),
)

UPTRAIN_MODELING = (
    uptrain_modeled(
        "gpt2",
        "GPT-2",
        "GPT2",
        AttentionLayout(
            attn_prefix="transformer.h.{layer}.attn",
            attn_prefix_alternatives=("h.{layer}.attn",),
            q_proj="c_attn",
            o_proj="c_proj",
            kv_modules=("c_attn",),
            kv_rows=(),
            fused_qkv="c_attn.weight",
            fused_qkv_bias="c_attn.bias",
            fused_axis=1,
            o_proj_transposed=True,
        ),
        rotary=None,
        target_positions_key="n_positions",
        notes="Conv1D c_attn, weight [in, out], columns [Q | K | V]",
        key_aliases=GPT2_ALIASES,
    ),
    uptrain_modeled(
        "gpt_neox",
        "GPT-NeoX",
        "GPTNeoX",
        AttentionLayout(attn_prefix="gpt_neox.layers.{layer}.attention", **PER_HEAD_QKV),
        renames=(("embed_out.", "lm_head."),),  # transformers renames it for GPTNeoXForCausalLM only
        rotary=Rotary(factor_key="rotary_pct"),
        notes="query_key_value rows [h, 3, d] interleaved per head; partial rotary",
    ),
    uptrain_modeled(
        "opt",
        "OPT",
        "OPT",
        AttentionLayout(
            attn_prefix="model.decoder.layers.{layer}.self_attn",
            attn_prefix_alternatives=("decoder.layers.{layer}.self_attn",),
            o_proj="out_proj",
        ),
        init_std_key="init_std",
        mask_ignores_positions=True,
        rotary=None,
        notes="separate projections with biases; no RoPE",
    ),
    uptrain_modeled(
        "gptj",
        "GPT-J",
        "GPTJ",
        AttentionLayout(attn_prefix="transformer.h.{layer}.attn", o_proj="out_proj"),
        rotary=Rotary(pairs="adjacent", dims_key="rotary_dim"),
        target_positions_key="n_positions",
        notes="separate projections, no biases; rotary on the first rotary_dim dims, adjacent pairs",
        key_aliases=GPT2_ALIASES,
    ),
    uptrain_modeled(
        "bloom",
        "BLOOM",
        "Bloom",
        AttentionLayout(
            attn_prefix="transformer.h.{layer}.self_attention",
            attn_prefix_alternatives=("h.{layer}.self_attention",),
            **PER_HEAD_QKV,
        ),
        alibi=True,
        rotary=None,
        target_positions_key=None,  # ALiBi: no position table
        notes="query_key_value rows [h, 3, d] interleaved per head; ALiBi slopes stay with the query heads",
        key_aliases=(("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head")),
    ),
    uptrain_modeled(
        "gpt_neo",
        "GPT-Neo",
        "GPTNeo",
        AttentionLayout(attn_prefix="transformer.h.{layer}.attn.attention", o_proj="out_proj"),
        # GPTNeoConfig spells them num_layers and num_heads (transformers maps the standard names
        # onto them), and ignores any head_dim: hidden_size // num_heads.
        geometry=StackKeys(
            layers_key="num_layers",
            heads_key="num_heads",
            kv_heads_key="num_key_value_heads",
            hidden_key="hidden_size",
        ),
        attention_ignores_positions=True,
        rotary=None,
        notes="separate projections, no biases (out_proj has one); no RoPE, no 1/√d; global and local layers",
        key_aliases=(("num_attention_heads", "num_heads"), ("num_hidden_layers", "num_layers")),
    ),
    uptrain_modeled(
        "mpt",
        "MPT",
        "Mpt",
        AttentionLayout(
            attn_prefix="transformer.blocks.{layer}.attn",
            q_proj="Wqkv",
            o_proj="out_proj",
            kv_modules=("Wqkv",),
            kv_rows=(),
            fused_qkv="Wqkv.weight",
        ),
        geometry=StackKeys("n_layers", "n_heads", "num_key_value_heads", hidden_key="d_model"),
        # transformers' MPT reads none of these settings: a checkpoint with another value is
        # another model than the one it (and mpt_gqa) computes.
        refused_settings=(
            RefusedSetting("attn_config.attn_type", "multihead_attention", "multihead_attention", "MHA only"),
            RefusedSetting("attn_config.qk_ln", False, False, "transformers' MPT has no q/k LayerNorm"),
            RefusedSetting("attn_config.alibi", True, True, "transformers' MPT has no learned positions"),
            RefusedSetting("no_bias", True, True, "transformers' MPT has no biases"),
        ),
        rotary=None,
        clip_qkv_key="attn_config.clip_qkv",
        target_positions_key="max_seq_len",  # its ALiBi biases are built for this many positions
        # Its ALiBi depends on the distance to each key alone (not on the padding mask): packed
        # documents take the document mask, so not the `alibi` quirk.
        notes="Wqkv rows [Q | K | V], no biases; ALiBi slopes stay with the query heads; clip_qkv clamps Wqkv's output",
        key_aliases=(("num_attention_heads", "n_heads"), ("hidden_size", "d_model"), ("num_hidden_layers", "n_layers")),
    ),
    uptrain_modeled(
        "falcon",
        "Falcon",
        "Falcon",
        AttentionLayout(attn_prefix="transformer.h.{layer}.self_attention", **PER_HEAD_QKV),
        refused_settings=(
            RefusedSetting("multi_query", False, True, "it has one KV head already"),
            RefusedSetting("new_decoder_architecture", False, False, "its KV heads are grouped already"),
        ),
        alibi="alibi",  # Falcon-RW; rotary otherwise
        rotary=Rotary(off_key="alibi"),
        notes="multi-head Falcon (Falcon-RW): query_key_value rows [h, 3, d] interleaved per head; "
        "ALiBi (alibi: true) or rotary",
    ),
)

DECODERS: tuple[Architecture, ...] = (*NATIVE_GQA, *UPTRAIN_MODELING)
