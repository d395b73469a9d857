"""Random-weight Llama checkpoints written straight to safetensors, shard by shard.

For benchmarks and memory tests: no model object is ever built, so writing a multi-GB
checkpoint costs one shard of memory. A helper of the scripts and tests, not shipped in the
package: the benchmark scripts import it as their sibling (`from synthetic_checkpoint import
…`), tests and `device_check.sh` from the repository root (`from scripts.synthetic_checkpoint
import …`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def llama_tensor_shapes(
    hidden: int, heads: int, kv_heads: int, layers: int, intermediate: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    d = hidden // heads
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (heads * d, hidden)),
            (p + "self_attn.k_proj.weight", (kv_heads * d, hidden)),
            (p + "self_attn.v_proj.weight", (kv_heads * d, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * d)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def write_synthetic_llama(
    folder: str | Path,
    *,
    hidden: int = 1024,
    heads: int = 8,
    kv_heads: int | None = None,
    layers: int = 8,
    intermediate: int = 2816,
    vocab: int = 32000,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 500_000_000,
    seed: int = 0,
) -> Path:
    """Write a sharded MHA (or GQA) Llama checkpoint with random weights and a matching config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kv_heads = kv_heads or heads
    generator = torch.Generator().manual_seed(seed)
    shapes = llama_tensor_shapes(hidden, heads, kv_heads, layers, intermediate, vocab)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(s, generator=generator) * 0.02).to(dtype) for n, s in shard}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
