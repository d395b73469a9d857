"""The DeepSeek-V2 layout (multi-head latent attention, MLA): how a Llama-family checkpoint is
written so that transformers' own `DeepseekV2ForCausalLM` loads it without uptrain.

What transformers 5 runs (`models/deepseek_v2/modeling_deepseek_v2.py`; docs/concepts/mla.md has
the lines): per token, `kv_a_proj_with_mqa` gives a latent of `kv_lora_rank` columns and one rotary
key of `qk_rope_head_dim` columns shared by every head; the latent goes through an RMSNorm
(`kv_a_layernorm`) and is cached with the rotary key; `kv_b_proj` expands it into each head's
non-rotary key (`qk_nope_head_dim`) and value (`v_head_dim`). Queries come from `q_proj` (no low
rank: `q_lora_rank` null), each head's rotary part last. Rotary acts on interleaved pairs (2j,
2j+1) at frequency θ^(−2j/qk_rope_head_dim) (the config's `head_dim` is forced to
`qk_rope_head_dim`). Layers from `first_k_dense_replace` on are MoE: set to the layer count,
every layer has the dense `mlp.{gate,up,down}_proj` a Llama has.

The rotary is written as YaRN at factor 1 (`rotary_parameters`), which is the plain rotary exactly,
because of vLLM: its CPU build (0.32) runs `rope_type: default` through a rotary kernel
(`torch.ops._C.rotary_embedding`) that mis-indexes DeepSeek-V2's query, a [tokens, heads, D]
slice: row t·heads + h turns at position t·heads + h, rows past the token count not at all
(docs/concepts/mla.md, "Serving"), where any other rope_type takes its own rotary class
(`DeepseekScalingRotaryEmbedding`), written in PyTorch.

Imports nothing from torch or transformers.
"""

from __future__ import annotations

MODEL_TYPE = "deepseek_v2"
ARCHITECTURE = "DeepseekV2ForCausalLM"

# The attention's tensors in a layer, after `model.layers.{i}.self_attn.`; the rest of a Llama
# layer (norms, dense MLP) keeps its names.
Q_PROJ = "q_proj.weight"
KV_A_PROJ = "kv_a_proj_with_mqa.weight"
KV_A_NORM = "kv_a_layernorm.weight"
KV_B_PROJ = "kv_b_proj.weight"
LAYER_TENSORS = (Q_PROJ, KV_A_PROJ, KV_A_NORM, KV_B_PROJ)  # in the order they are written

# Llama keys a DeepSeek-V2 config does not read (its `head_dim` is set from qk_rope_head_dim).
_DROPPED_KEYS = ("head_dim", "pretraining_tp", "rope_scaling", "auto_map")


def rope_theta_for(theta: float, rope_dims: int, head_dim: int, stride: int = 1) -> float:
    """The base at which DeepSeek-V2's rotary over `rope_dims` columns turns at the source's
    frequencies 0, s, …, s (D/2 − 1): θ'^(−2j/D) = θ^(−2sj/d) for θ' = θ^(sD/d). Its frequencies
    are a geometric sequence from 1 (the plain rotary, `rotary_parameters`: transformers and vLLM
    take them from `rope_theta` alone), so every s-th of the source's from the highest is what one
    base can give."""
    return float(theta ** (stride * rope_dims / head_dim))


def rotary_parameters(theta: float, max_positions: int) -> dict:
    """`rope_parameters` for the plain rotary at base `theta` that vLLM's CPU build runs right: YaRN
    at factor 1 over the model's whole length. transformers' YaRN (and vLLM's
    `DeepseekScalingRotaryEmbedding`) then blends two equal frequency sets, θ^(−2j/D) with
    θ^(−2j/D) / 1, and scales by an attention factor of 1 (given, not derived), and DeepSeek-V2's
    softmax-scale correction `mscale_all_dim` is absent: the default rotary up to float rounding of
    the blend (a float32 ulp of each frequency)."""
    return {
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": max_positions,
        "attention_factor": 1.0,
        "rope_theta": theta,
    }


def mla_config(
    config: dict,
    kv_rank: int,
    rope_dims: int,
    head_dim: int,
    rope_theta: float,
    rope_stride: int = 1,
    nope_dims: int | None = None,
) -> dict:
    """A Llama config.json (dict) as a dense DeepSeek-V2 one: every query head's key is
    `head_dim - rope_dims` columns from the latent plus the shared rotary key of `rope_dims`
    columns (so `qk_nope_head_dim + qk_rope_head_dim = head_dim` and the softmax scale
    head_dim^−½ is the source's; `nope_dims` wider with `--rope-residual`, whose queries carry the
    scale's correction), values of `head_dim` columns (`o_proj` unchanged)."""
    theta = rope_theta_for(rope_theta, rope_dims, head_dim, rope_stride)
    out = {k: v for k, v in config.items() if k not in _DROPPED_KEYS}
    out.update(
        model_type=MODEL_TYPE,
        architectures=[ARCHITECTURE],
        # expand_kv gives every query head its own key and value: eager attention repeats none
        num_key_value_heads=config["num_attention_heads"],
        q_lora_rank=None,
        kv_lora_rank=kv_rank,
        qk_rope_head_dim=rope_dims,
        qk_nope_head_dim=head_dim - rope_dims if nope_dims is None else nope_dims,
        v_head_dim=head_dim,
        # No MoE layer: the MoE keys keep transformers' defaults, which build nothing.
        first_k_dense_replace=config["num_hidden_layers"],
        rope_parameters=rotary_parameters(theta, config["max_position_embeddings"]),
        # transformers 4.57 reads the top-level key and, with no `rope_scaling`, the plain rotary
        rope_theta=theta,
    )
    return out


def latent_elements_per_token(kv_rank: int, rope_dims: int) -> int:
    """What one layer caches per token: the latent and the shared rotary key."""
    return kv_rank + rope_dims


def cache_elements_per_token(config: dict) -> int:
    """What a DeepSeek-V2 config's model caches per token, every layer's latent and rotary key."""
    return config["num_hidden_layers"] * latent_elements_per_token(config["kv_lora_rank"], config["qk_rope_head_dim"])


def attention_width(config: dict) -> int:
    """What the attention term of the training FLOPs counts per layer (query heads × head width,
    `train.metrics.train_flops_per_token`'s H·Q): transformers expands the latent into every head's
    key of `qk_nope_head_dim + qk_rope_head_dim` columns and value of `v_head_dim`, so the scores
    and the values read those widths; their mean is Q (the source's head_dim, as converted)."""
    key = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return config["num_attention_heads"] * (key + config["v_head_dim"]) // 2
