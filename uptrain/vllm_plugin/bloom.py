"""`bloom_gqa` (`BloomGQAForCausalLM`): vLLM's BLOOM, ALiBi in its attention (which vLLM's
transformers backend cannot give: its attention takes no score bias), with a fused QKV of h and
G heads and the slopes of the query heads, tensor-parallel as vLLM's BLOOM is. The stored rows are
grouped per KV head, `[G, r + 2, d]` (modeling_bloom_gqa.py): repacked to `[Q | K | V]` as they
load."""

from __future__ import annotations

import math

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.models import bloom
from vllm.model_executor.models.utils import AutoWeightsLoader, make_layers

from .attention import FusedQKVAttention


def alibi_slopes(heads: int) -> torch.Tensor:
    """BLOOM's ALiBi slope of each query head (float32, as transformers computes them): powers
    of 2^(-8/n) for the n = largest power of two ≤ heads, then odd powers of 2^(-4/n) for the rest."""
    closest = 2 ** math.floor(math.log2(heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        odd = torch.arange(1, 1 + 2 * (heads - closest), 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra, odd)])
    return slopes


def qkv_of_grouped_rows(weights, heads: int, kv_heads: int):
    """The checkpoint's tensors, each `query_key_value` (weight or bias) whose rows are grouped
    per KV head, `[G, r + 2, d]` (its r = h / G query heads, its K, its V: BLOOM's and Falcon's
    GQA layout), repacked to the `[Q | K | V]` vLLM's fused-QKV loader splits."""
    r = heads // kv_heads
    for name, w in weights:
        if "query_key_value" in name:
            grouped = w.view(kv_heads, r + 2, -1, *w.shape[1:])
            q, k, v = (part.reshape(-1, *w.shape[1:]) for part in (grouped[:, :r], grouped[:, r], grouped[:, r + 1]))
            w = torch.cat([q, k, v])
        yield name, w


class BloomGQAAttention(FusedQKVAttention):
    """vLLM's BloomAttention over `num_key_value_heads` KV heads, ALiBi slopes of the query heads."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__(
            config.hidden_size,
            config.n_head,
            config.num_key_value_heads,
            names=("query_key_value", "dense"),
            biases=(True, True),
            slopes=alibi_slopes(config.n_head),
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=prefix,
        )

    def forward(self, position_ids, hidden_states):
        return super().forward(hidden_states)  # ALiBi: no positions (vLLM's BLOOM block passes them)


class BloomGQABlock(bloom.BloomBlock):
    """vLLM's BloomBlock with the GQA attention."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)
        hidden = config.hidden_size
        self.input_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.self_attention = BloomGQAAttention(config, cache_config, quant_config, prefix=f"{prefix}.self_attention")
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.mlp = bloom.BloomMLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm


@support_torch_compile
class BloomGQAModel(nn.Module):
    """vLLM's BloomModel with GQA blocks (its methods; not a subclass, as GPT2GQAModel)."""

    embed_input_ids = bloom.BloomModel.embed_input_ids
    forward = bloom.BloomModel.forward

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_dim = config.hidden_size
        self.word_embeddings = bloom.VocabParallelEmbedding(config.vocab_size, self.embed_dim)
        self.word_embeddings_layernorm = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.start_layer, self.end_layer, self.h = make_layers(
            config.num_hidden_layers,
            lambda prefix: BloomGQABlock(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix),
            prefix=f"{prefix}.h",
        )
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.make_empty_intermediate_tensors = bloom.make_empty_intermediate_tensors_factory(
            ["hidden_states"], config.hidden_size
        )

    def load_weights(self, weights):
        """The checkpoint's tensors, each fused QKV's rows `[G, r + 2, d]` repacked to `[Q | K | V]`."""
        kv_heads = self.config.num_key_value_heads
        return AutoWeightsLoader(self).load_weights(qkv_of_grouped_rows(weights, self.config.n_head, kv_heads))


class BloomGQAForCausalLM(bloom.BloomForCausalLM):
    """vLLM's BloomForCausalLM on the GQA model."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.transformer = BloomGQAModel(vllm_config=vllm_config, prefix=bloom.maybe_prefix(prefix, "transformer"))
        self.lm_head = bloom.ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=bloom.maybe_prefix(prefix, "lm_head")
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.transformer.word_embeddings)
        self.logits_processor = bloom.LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.transformer.make_empty_intermediate_tensors
