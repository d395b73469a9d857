"""`mpt_gqa` (`MptGQAForCausalLM`): MPT over G KV heads (`num_key_value_heads` from the config),
built of vLLM's layers: vLLM 0.32 has no MPT class (it removed it in 0.28). It follows
transformers' MPT, the arithmetic a converted checkpoint is tested against: pre-norm blocks of
bias-free layer norms, one fused `Wqkv` projection (stored `[Q (h·d) | K (G·d) | V (G·d)]`,
modeling_mpt_gqa.py, which vLLM's fused-QKV loader splits by those sizes) whose output
`clip_qkv` clamps, ALiBi with MPT's slopes in vLLM's attention (which vLLM's transformers backend
cannot give), an exact-GELU MLP, no biases, the head tied to the embeddings. Tensor-parallel as
vLLM's BLOOM, the other ALiBi model, is.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from .attention import FusedQKVAttention, layer_kv_heads
from .causal_lm import TOKEN_DIMS, CausalLM, stage_blocks, stage_forward


def mpt_alibi_slopes(heads: int, alibi_bias_max: float) -> torch.Tensor:
    """MPT's ALiBi slope of each query head (float32, as transformers computes them):
    2^(-i·max/n) for i = 1 … n, n the power of two ≥ heads; for other head counts the odd-indexed
    slopes, then the even-indexed, the first `heads` of them."""
    power = 2 ** math.ceil(math.log2(heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, power + 1, dtype=torch.int64).float() * (alibi_bias_max / power))
    if power != heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:heads]
    return slopes


def attention_setting(config, name: str):
    """A key of MPT's `attn_config` (an object in transformers' MptConfig, a dict in others)."""
    attn = config.attn_config
    return attn.get(name) if isinstance(attn, dict) else getattr(attn, name, None)


class MptGQAAttention(FusedQKVAttention):
    """MPT's attention over its layer's KV heads (`layer_kv_heads`): fused QKV, clipped, ALiBi."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__(
            config.d_model,
            config.n_heads,
            layer_kv_heads(config, prefix, layers=config.n_layers, heads=config.n_heads),
            names=("Wqkv", "out_proj"),
            biases=(False, False),
            scale=attention_setting(config, "softmax_scale"),  # None: 1/√d
            slopes=mpt_alibi_slopes(config.n_heads, attention_setting(config, "alibi_bias_max") or 8),
            clip=attention_setting(config, "clip_qkv"),
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=prefix,
        )


class MptGQAMLP(nn.Module):
    """MPT's MLP: up, exact GELU, down, no biases."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        inner = int(config.expansion_ratio * config.d_model)
        self.up_proj = ColumnParallelLinear(
            config.d_model, inner, bias=False, quant_config=quant_config, prefix=f"{prefix}.up_proj"
        )
        self.act = nn.GELU(approximate="none")
        self.down_proj = RowParallelLinear(
            inner, config.d_model, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up, _ = self.up_proj(hidden_states)
        down, _ = self.down_proj(self.act(up))
        return down


class MptGQABlock(nn.Module):
    """MPT's block: attention and MLP, each after a bias-free layer norm, each added to the stream."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        hidden, eps = config.d_model, config.layer_norm_epsilon
        self.norm_1 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.attn = MptGQAAttention(config, cache_config, quant_config, prefix=f"{prefix}.attn")
        self.norm_2 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.ffn = MptGQAMLP(config, quant_config, prefix=f"{prefix}.ffn")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm_1(hidden_states))
        return hidden_states + self.ffn(self.norm_2(hidden_states))


@support_torch_compile(dynamic_arg_dims=TOKEN_DIMS)
class MptGQAModel(nn.Module):
    """MPT's model: token embeddings (no positions: ALiBi), the blocks, a bias-free final norm."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.blocks = stage_blocks(self, MptGQABlock, vllm_config=vllm_config, prefix=f"{prefix}.blocks")
        self.norm_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        def embed():
            return inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)

        return stage_forward(self, embed, self.blocks, self.norm_f, intermediate_tensors)


class MptGQAForCausalLM(CausalLM):
    """MPT's causal LM: the model and its head (tied to the embeddings unless the config unties them)."""

    model_class = MptGQAModel

    def __init__(self, *, vllm_config, prefix: str = ""):
        if not attention_setting(vllm_config.model_config.hf_config, "alibi"):
            raise ValueError("uptrain's vLLM mpt_gqa serves MPT with ALiBi (as transformers' MPT computes it)")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
