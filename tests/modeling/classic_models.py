"""Tiny real checkpoints of the architectures uptrain brings its own GQA modeling for
(8 heads, head_dim 8, 2 layers), and test-side helpers written independently of the
converter's layout tables."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from uptrain import UptrainError
from uptrain.model_info import attention_geometry

HEADS, HEAD_DIM, HIDDEN = 8, 8, 64
SHARED = dict(vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "gpt2": dict(n_embd=HIDDEN, n_head=HEADS, n_layer=2, n_positions=64),
    # partial rotary: half of each head rotated, half passed through
    "gpt_neox": dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_hidden_layers=2,
        intermediate_size=96,
        max_position_embeddings=64,
        rotary_pct=0.5,
    ),
    "opt": dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_hidden_layers=2,
        ffn_dim=96,
        word_embed_proj_dim=HIDDEN,
        max_position_embeddings=64,
    ),
    # rotary on the first 4 of 8 dims of each head, in adjacent pairs
    "gptj": dict(n_embd=HIDDEN, n_head=HEADS, n_layer=2, n_positions=64, rotary_dim=4),
    "bloom": dict(hidden_size=HIDDEN, n_head=HEADS, n_layer=2),
    # a global layer, then a local one whose window (4) is shorter than the test sequences
    "gpt_neo": dict(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_layers=2,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        intermediate_size=96,
        max_position_embeddings=64,
    ),
    # ALiBi; fused Wqkv [Q | K | V]; no biases (transformers' MPT has none); clip_qkv: test_mpt_falcon_variants.py
    "mpt": dict(d_model=HIDDEN, n_heads=HEADS, n_layers=2, max_seq_len=64),
    # Falcon-RW: multi-head, ALiBi, sequential attention and MLP, biases; rotary Falcon: as above
    "falcon": dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_hidden_layers=2,
        multi_query=False,
        new_decoder_architecture=False,
        alibi=True,
        parallel_attn=False,
        bias=True,
    ),
}
ARCHITECTURES = sorted(CONFIGS)


def reads_config_aliases() -> bool:
    """Whether uptrain reads GPT-2-style configs (n_head, n_layer, n_embd): needed to convert
    gpt2, gptj and bloom checkpoints (uptrain.model_info.attention_geometry)."""
    try:
        attention_geometry({"model_type": "gpt2", "n_head": 2, "n_layer": 1, "n_embd": 4})
        return True
    except UptrainError:
        return False


def build(model_type: str, seed: int = 0, init_std: float | None = None, **settings):
    """A tiny random model. `init_std` (transformers' `initializer_range`, 0.02 by default) set
    to ~0.5 makes greedy generation depend on the context, rather than repeat one token.
    `settings` override CONFIGS' (a variant of the architecture)."""
    std = {} if init_std is None else {"initializer_range": init_std}
    config = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **settings}, **SHARED, **std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Fresh biases are zeros and norms ones: randomise them so pooling them is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def kv_head_views(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each layer: views `[kv_heads, head_dim, …]` of its K and of its V parameters
    (weight and bias), from transformers' own layout of each architecture."""
    views = []
    for name, p in model.named_parameters():
        if name.endswith("attn.c_attn.weight"):  # GPT-2 Conv1D [in, Q | K | V]
            w = p.data.view(HIDDEN, 3, HEADS, HEAD_DIM)
            views.append((w[:, 1].permute(1, 2, 0), w[:, 2].permute(1, 2, 0)))
        elif name.endswith("attn.c_attn.bias"):
            b = p.data.view(3, HEADS, HEAD_DIM)
            views.append((b[1], b[2]))
        elif name.endswith("attn.Wqkv.weight"):  # MPT rows [Q | K | V]
            rows = p.data.view(3, HEADS, HEAD_DIM, HIDDEN)
            views.append((rows[1], rows[2]))
        elif "query_key_value" in name:  # NeoX / BLOOM / Falcon rows [h, 3, d]
            rows = p.data.view(HEADS, 3, HEAD_DIM, *p.shape[1:])
            views.append((rows[:, 1], rows[:, 2]))
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            k = p.data.view(HEADS, HEAD_DIM, *p.shape[1:])
            v = dict(model.named_parameters())[name.replace("k_proj", "v_proj")].data
            views.append((k, v.view(HEADS, HEAD_DIM, *p.shape[1:])))
    return views


def make_heads_identical(model, num_groups: int) -> None:
    """Every K and V head equal to the first head of its contiguous group."""
    r = HEADS // num_groups
    with torch.no_grad():
        for k, v in kv_head_views(model):
            for heads in (k, v):
                for i in range(HEADS):
                    heads[i] = heads[(i // r) * r]


def token_ids(seed: int = 1, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, SHARED["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def word_tokenizer(text: str):
    """A word-level tokenizer trained on `text` offline, wrapped for transformers."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.train_from_iterator([text], WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def text(seed: int, words: int) -> str:
    """Deterministic text with some structure (a few words repeat in patterns) to train on."""
    gen = torch.Generator().manual_seed(seed)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "house", "of", "king", "queen"]
    picks = torch.randint(0, len(vocab), (words,), generator=gen).tolist()
    lines = [" ".join(vocab[i] for i in picks[j : j + 12]) + " ." for j in range(0, words, 12)]
    return "\n\n".join(lines) + "\n"
