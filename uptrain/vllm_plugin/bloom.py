"""`bloom_gqa` (`BloomGQAForCausalLM`): vLLM's BLOOM, ALiBi in its attention (which vLLM's
transformers backend cannot give: its attention takes no score bias), with a fused QKV of h and
G heads and the slopes of the query heads, tensor-parallel as vLLM's BLOOM is. The stored rows are
grouped per KV head, `[G, r + 2, d]` (modeling_bloom_gqa.py): repacked to `[Q | K | V]` as they
load."""

from __future__ import annotations

from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.models import bloom
from vllm.model_executor.models.utils import AutoWeightsLoader

from .attention import FusedQKVAttention, alibi_slopes, layer_kv_heads, qkv_of_grouped_rows
from .causal_lm import attach_head, stage_blocks


class BloomGQAAttention(FusedQKVAttention):
    """vLLM's BloomAttention over its layer's KV heads (`layer_kv_heads`), ALiBi slopes of the query heads."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__(
            config.hidden_size,
            config.n_head,
            layer_kv_heads(config, prefix, layers=config.num_hidden_layers, heads=config.n_head),
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
        self.h = stage_blocks(self, BloomGQABlock, vllm_config=vllm_config, prefix=f"{prefix}.h")
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

    def load_weights(self, weights):
        """The checkpoint's tensors, each fused QKV's rows `[G, r + 2, d]` repacked to `[Q | K | V]`."""
        config = self.config
        grouped = qkv_of_grouped_rows(weights, config, layers=config.num_hidden_layers, heads=config.n_head)
        return AutoWeightsLoader(self).load_weights(grouped)


class BloomGQAForCausalLM(bloom.BloomForCausalLM):
    """vLLM's BloomForCausalLM on the GQA model."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        tied = vllm_config.model_config.hf_config.tie_word_embeddings
        attach_head(
            self, BloomGQAModel, vllm_config=vllm_config, prefix=prefix, embeddings="word_embeddings", tied=tied
        )
