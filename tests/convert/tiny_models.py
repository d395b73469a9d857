"""Tiny real checkpoints (8 heads, head_dim 8, 2 layers) for every supported architecture."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

HEADS = 8
COMMON = dict(
    hidden_size=64,
    num_attention_heads=HEADS,
    num_hidden_layers=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Per-architecture settings that exercise what makes each layout different.
EXTRA = {
    "llama": dict(attention_bias=True),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),
    "qwen3": dict(head_dim=8),
    "gemma": dict(head_dim=16),  # explicit head_dim ≠ hidden / heads
    "gemma2": dict(head_dim=16),
    "phi": dict(partial_rotary_factor=0.5, qk_layernorm=True),
    "phi3": dict(),
    "stablelm": dict(qk_layernorm=True, use_qkv_bias=True),
    "olmo": dict(),
    "olmo2": dict(),
    "starcoder2": dict(),
    "granite": dict(),
}
ARCHITECTURES = sorted(EXTRA)


def build_model(model_type: str, num_kv_heads: int = HEADS, seed: int = 0):
    config = AutoConfig.for_model(model_type, num_key_value_heads=num_kv_heads, **COMMON, **EXTRA[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Fresh norms are all ones and biases all zeros: randomise them so pooling them is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def head_dim(config) -> int:
    if config.model_type == "stablelm":
        return config.hidden_size // config.num_attention_heads
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def make_heads_identical(model, num_groups: int) -> None:
    """Make every KV head equal to the first head of its contiguous group (test-side, written
    independently of the converter's layout tables)."""
    cfg = model.config
    d, h, kv = head_dim(cfg), cfg.num_attention_heads, cfg.num_key_value_heads
    r = kv // num_groups

    def tie_rows(t: torch.Tensor) -> None:
        heads = t.view(kv, d, *t.shape[1:])
        for i in range(kv):
            heads[i] = heads[(i // r) * r]

    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"\.(k_proj|v_proj)\.(weight|bias)$", name):
                tie_rows(p)
            elif name.endswith("k_norm.weight") and p.shape[0] == kv * d:  # olmo2: whole key vector
                tie_rows(p)
            elif name.endswith("qkv_proj.weight"):
                tie_rows(p[h * d : (h + kv) * d])
                tie_rows(p[(h + kv) * d :])
        norms = {}
        for name, p in model.named_parameters():
            m = re.search(r"k_layernorm\.norms\.(\d+)\.(\w+)$", name)
            if m:
                norms[(name[: m.start()], int(m.group(1)), m.group(2))] = p
        for (prefix, i, kind), p in norms.items():
            p.copy_(norms[(prefix, (i // r) * r, kind)])


def save(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


def logits(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits
