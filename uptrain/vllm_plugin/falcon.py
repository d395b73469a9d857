"""`falcon_gqa` (`FalconGQAForCausalLM`): vLLM's Falcon for multi-head Falcon (Falcon-RW:
`multi_query` and `new_decoder_architecture` false) converted to G KV heads
(`num_key_value_heads` from the config), ALiBi or rotary. vLLM's Falcon reads G only from those
two flags (1 or h); here its fused QKV projection has h and G heads and its attention layer G KV
heads, tensor-parallel as vLLM's Falcon is. ALiBi (`alibi: true`), which vLLM's transformers
backend cannot give, is vLLM's attention's: the query heads' slopes, scaled as transformers'
Falcon scales the biased scores. The stored rows are grouped per KV head, `[G, r + 2, d]`
(modeling_falcon_gqa.py), as BLOOM's: repacked to `[Q | K | V]` as they load. Everything else is
vLLM's Falcon unchanged (its layers' order, MLP, norms, embeddings, head).
"""

from __future__ import annotations

import math

from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import LayerNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models import falcon
from vllm.model_executor.models.utils import AutoWeightsLoader

from .attention import alibi_slopes, layer_kv_heads, qkv_of_grouped_rows
from .causal_lm import attach_head, stage_blocks


class FalconGQAAttention(falcon.FalconAttention):
    """vLLM's FalconAttention (its forward) over its layer's KV heads (`layer_kv_heads`)."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = layer_kv_heads(config, prefix, layers=config.num_hidden_layers, heads=heads)
        tp = get_tensor_model_parallel_world_size()
        self.hidden_size, self.total_num_heads, self.total_num_kv_heads = hidden, heads, kv_heads
        self.num_heads = heads // tp
        # Fewer KV heads than ranks: each rank holds a replica of one (vLLM's rule for GQA).
        self.num_kv_heads = max(1, kv_heads // tp)
        self.head_dim = hidden // heads
        self.new_decoder_architecture, self.multi_query = False, False
        self.query_key_value = QKVParallelLinear(
            hidden,
            self.head_dim,
            heads,
            kv_heads,
            bias=config.bias,
            skip_bias_add=True,
            quant_config=quant_config,
            prefix=f"{prefix}.query_key_value",
        )
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        # Sequential attention and MLP reduce each; parallel ones once, in the layer (vLLM's Falcon).
        self.reduce_row_parallel_results = not config.parallel_attn
        self.dense = RowParallelLinear(
            hidden,
            hidden,
            bias=config.bias,
            skip_bias_add=True,
            quant_config=quant_config,
            reduce_results=self.reduce_row_parallel_results,
            prefix=f"{prefix}.dense",
        )
        self.use_rotary, self.use_alibi = config.rotary, config.alibi
        slopes = None
        if self.use_rotary:
            self.rotary_emb = get_rope(
                self.head_dim,
                max_position=getattr(config, "max_position_embeddings", 8192),
                rope_parameters=config.rope_parameters,
            )
        elif self.use_alibi:
            first = get_tensor_model_parallel_rank() * self.num_heads
            slopes = (alibi_slopes(heads) * self.inv_norm_factor)[first : first + self.num_heads].tolist()
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.inv_norm_factor,
            num_kv_heads=self.num_kv_heads,
            alibi_slopes=slopes,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )


class FalconGQADecoderLayer(falcon.FalconDecoderLayer):
    """vLLM's FalconDecoderLayer (its forward) of multi-head Falcon, with the GQA attention."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)
        if config.new_decoder_architecture or config.multi_query:
            raise ValueError("uptrain's vLLM falcon_gqa serves multi-head Falcon (Falcon-RW's architecture)")
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.self_attention = FalconGQAAttention(config, cache_config, quant_config, prefix=f"{prefix}.self_attention")
        self.mlp = falcon.FalconMLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.config = config
        # One layer norm before the attention (and, sequential, one before the MLP): vLLM's
        # Falcon's reading of `num_ln_in_parallel_attn` (None) for this architecture.
        config.num_ln_in_parallel_attn = None
        self.input_layernorm = LayerNorm(hidden, eps=config.layer_norm_epsilon)
        if not config.parallel_attn:
            self.post_attention_layernorm = LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.reduce_row_parallel_results = not config.parallel_attn


@support_torch_compile
class FalconGQAModel(nn.Module):
    """vLLM's FalconModel with GQA layers (its methods; not a subclass: the compile decorator
    wraps each class it decorates once)."""

    embed_input_ids = falcon.FalconModel.embed_input_ids
    forward = falcon.FalconModel.forward

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_dim, self.num_heads, self.use_alibi = config.hidden_size, config.num_attention_heads, config.alibi
        self.word_embeddings = falcon.VocabParallelEmbedding(config.vocab_size, self.embed_dim)
        self.h = stage_blocks(self, FalconGQADecoderLayer, vllm_config=vllm_config, prefix=f"{prefix}.h")
        self.ln_f = LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

    def load_weights(self, weights):
        """The checkpoint's tensors, each fused QKV's rows `[G, r + 2, d]` repacked to `[Q | K | V]`."""
        config = self.config
        heads = config.num_attention_heads
        grouped = qkv_of_grouped_rows(weights, config, layers=config.num_hidden_layers, heads=heads)
        return AutoWeightsLoader(self).load_weights(grouped)


class FalconGQAForCausalLM(falcon.FalconForCausalLM):
    """vLLM's FalconForCausalLM on the GQA model."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        # Falcon configs before tie_word_embeddings tied them (vLLM's Falcon's default).
        self.tie_word_embeddings = vllm_config.model_config.hf_config.tie_word_embeddings is not False
        attach_head(
            self,
            FalconGQAModel,
            vllm_config=vllm_config,
            prefix=prefix,
            embeddings="word_embeddings",
            tied=self.tie_word_embeddings,
        )
