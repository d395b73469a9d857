"""The DeciLM / Nemotron-NAS layout: how a Llama-family checkpoint with its own KV heads per layer
is written, so that vLLM (`DeciLMForCausalLM`) and llama.cpp (`convert_hf_to_gguf.py`'s
`DeciModel`) serve it natively and uptrain's `modeling_decilm.py` loads it in transformers.

transformers' LlamaConfig holds one `num_key_value_heads`; the engines read a per-layer one from
`block_configs`, one entry per layer:
- `attention.n_heads_in_group`: query heads per KV head, so the layer's KV heads are
  `num_attention_heads // n_heads_in_group` (`no_op` / `replace_with_linear` mark layers without
  attention, which a conversion never writes);
- `ffn`: the MLP width, as `ffn_mult` (both engines: `int(2 · ffn_mult · hidden / 3)` rounded up
  to a multiple of 256) or as `intermediate_size` (vLLM only, since its PR #30795; llama.cpp's
  converter reads `ffn_mult` alone).
`ffn_mult` reaches the source's `intermediate_size` exactly when that is a multiple of 256 (every
published Llama: 11008, 14336, 28672, 5632, 1536); otherwise the block says `intermediate_size`,
which vLLM serves and llama.cpp's converter refuses (see docs/concepts/kv_cache.md).

Imports nothing from torch or transformers (conversion writes it; `Architecture.stacks` checks it).
"""

from __future__ import annotations

from uptrain import UptrainError

MODEL_TYPE = "nemotron-nas"
ARCHITECTURE = "DeciLMForCausalLM"  # the class name both engines look up
FFN_MULTIPLE = 256  # both engines round the width from ffn_mult up to a multiple of this


def engine_ffn_width(ffn_mult: float, hidden: int) -> int:
    """The MLP width vLLM and llama.cpp build from `ffn_mult` (their one formula)."""
    width = int(2 * ffn_mult * hidden / 3)
    return -(-width // FFN_MULTIPLE) * FFN_MULTIPLE


def ffn_mult_for(intermediate: int, hidden: int) -> float | None:
    """An `ffn_mult` from which both engines build exactly `intermediate` columns, or None where
    none does (the width is not a multiple of 256)."""
    mult = 3 * intermediate / (2 * hidden)
    return mult if engine_ffn_width(mult, hidden) == intermediate else None


def block_configs(kv_heads: tuple[int, ...], heads: int, intermediate: int, hidden: int) -> list[dict]:
    """One `block_configs` entry per layer: its KV heads as `n_heads_in_group`, the source's MLP
    width as `ffn_mult` where both engines reach it exactly, else as `intermediate_size`."""
    mult = ffn_mult_for(intermediate, hidden)
    ffn = {"intermediate_size": intermediate} if mult is None else {"ffn_mult": mult}
    return [
        {
            "attention": {"n_heads_in_group": heads // kv, "no_op": False, "replace_with_linear": False},
            "ffn": {**ffn, "no_op": False, "replace_with_linear": False},
        }
        for kv in kv_heads
    ]


def decilm_config(config: dict, kv_heads: tuple[int, ...], modeling_module: str, classes: tuple[str, str, str]) -> dict:
    """A Llama config.json (dict) with these per-layer KV heads in the DeciLM layout: model_type
    "nemotron-nas", `block_configs` (what the engines and uptrain's modeling read), the contract's
    `num_key_value_heads_per_layer` beside `num_key_value_heads` = the largest (what uptrain's
    readers and llama.cpp's DeciLM-7B path read), and `auto_map` naming uptrain's modeling
    (`modeling_module` and its config, model and causal-LM `classes`) beside the weights."""
    config = dict(config)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    config_class, model_class, head_class = classes
    config.update(
        model_type=MODEL_TYPE,
        architectures=[ARCHITECTURE],
        num_key_value_heads=max(kv_heads),
        num_key_value_heads_per_layer=list(kv_heads),
        block_configs=block_configs(kv_heads, heads, config["intermediate_size"], hidden),
        auto_map={
            "AutoConfig": f"{modeling_module}.{config_class}",
            "AutoModel": f"{modeling_module}.{model_class}",
            "AutoModelForCausalLM": f"{modeling_module}.{head_class}",
        },
    )
    return config


def llama_config(config: dict, source_model_type: str) -> dict:
    """`config` as its source family's own (a Llama): one KV-head count for every layer, so
    transformers' modeling reads it; a config in this layout (pooled to one G) loses its
    `block_configs`, its per-layer list and the `auto_map` naming uptrain's modeling."""
    if config.get("model_type") != MODEL_TYPE:
        return config
    config = {
        k: v for k, v in config.items() if k not in ("block_configs", "num_key_value_heads_per_layer", "auto_map")
    }
    return {**config, "model_type": source_model_type, "architectures": ["LlamaForCausalLM"]}


def check_decilm(config: dict) -> None:
    """One line unless `config` (model_type "nemotron-nas") is a layout uptrain reads: every
    layer an attention and an MLP of the source's width, each layer's KV heads in `block_configs`
    equal to `num_key_value_heads_per_layer`. A published Nemotron-NAS model (layers without
    attention, MLPs of their own widths) is not one: it loads with its own remote code."""
    blocks, listed = config.get("block_configs"), config.get("num_key_value_heads_per_layer")
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not isinstance(blocks, list) or not isinstance(listed, list) or len(blocks) != layers:
        raise UptrainError(
            f"{MODEL_TYPE} config without one block_configs entry per layer and num_key_value_heads_per_layer "
            "is not a layout uptrain wrote; load it with its own code (trust_remote_code=True)"
        )
    for index, block in enumerate(blocks):
        attention, ffn = block.get("attention", {}), block.get("ffn", {})
        if any(part.get(flag) for part in (attention, ffn) for flag in ("no_op", "replace_with_linear")):
            raise UptrainError(
                f"{MODEL_TYPE} block_configs[{index}] replaces its attention or MLP (no_op / replace_with_linear): "
                "uptrain reads layers that have both; load it with its own code (trust_remote_code=True)"
            )
        group = attention.get("n_heads_in_group")
        kv = heads // group if isinstance(group, int) and group >= 1 and heads % group == 0 else None
        if kv is None or kv != listed[index]:
            raise UptrainError(
                f"{MODEL_TYPE} block_configs[{index}].attention.n_heads_in_group is {group!r}, which is not "
                f"{heads} heads / num_key_value_heads_per_layer[{index}] = {listed[index]!r} KV heads"
            )
        width = (
            engine_ffn_width(ffn["ffn_mult"], config["hidden_size"])
            if "ffn_mult" in ffn
            else ffn.get("intermediate_size")
        )
        if width != config.get("intermediate_size"):
            raise UptrainError(
                f"{MODEL_TYPE} block_configs[{index}].ffn gives an MLP of {width!r} columns, not intermediate_size "
                f"{config.get('intermediate_size')!r}: uptrain reads layers whose MLP is the source's"
            )
