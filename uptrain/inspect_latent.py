"""`uptrain inspect` of a multi-head latent attention checkpoint (DeepSeek-V2 layout, as `uptrain
convert --target mla` writes it): what its cache holds per token and layer — the latent
(`kv_lora_rank`) and one rotary key shared by all heads (`qk_rope_head_dim`) — against what the
same heads would cache as expanded keys and values, with all of them (MHA) and at every G.
"""

from __future__ import annotations

from uptrain.architecture import deepseek_v2
from uptrain.model_info import divisors


def latent_report(config: dict, dtype_bytes: int, context: int, batch: int) -> dict:
    """The report's fields for a DeepSeek-V2 config (`inspect_checkpoint` adds source, dtype, …)."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    key_dim, value_dim = config["qk_nope_head_dim"] + rope, config["v_head_dim"]
    per_token = deepseek_v2.cache_elements_per_token(config) * dtype_bytes

    def expanded(g: int) -> int:  # g KV heads' keys and values, as GQA caches them
        return layers * g * (key_dim + value_dim) * dtype_bytes

    return {
        "encoder_decoder": False,
        "latent": True,
        "num_layers": layers,
        "num_attention_heads": heads,
        "kv_lora_rank": rank,
        "qk_rope_head_dim": rope,
        "kv_cache_bytes_per_token": per_token,
        "kv_cache_bytes": per_token * context * batch,
        "expanded": [
            {"num_kv_heads": g, "kv_cache_bytes_per_token": expanded(g), "latent_share": per_token / expanded(g)}
            for g in sorted(divisors(heads), reverse=True)
        ],
    }


def format_latent(info: dict, human_bytes) -> str:
    params = "unknown" if info["parameters"] is None else f"{info['parameters']:,}"
    lines = [
        f"source        {info['source']}",
        f"architecture  {info['model_type']}  (multi-head latent attention)",
        f"layers        {info['num_layers']}",
        f"heads         {info['num_attention_heads']} query; cached: a latent of rank {info['kv_lora_rank']} "
        f"+ one rotary key of {info['qk_rope_head_dim']} shared by all heads",
        f"parameters    {params}",
        f"KV cache      {human_bytes(info['kv_cache_bytes_per_token'])} per token, "
        f"{human_bytes(info['kv_cache_bytes'])} for {info['context']} tokens × batch {info['batch']} ({info['dtype']})",
        "",
        "the same heads caching expanded keys and values:",
        f"{'G':>4} {'per token':>11} {'latent / it':>12}",
    ]
    for row in info["expanded"]:
        lines.append(
            f"{row['num_kv_heads']:>4} {human_bytes(row['kv_cache_bytes_per_token']):>11} {row['latent_share']:>12.4g}"
        )
    return "\n".join(lines)
