"""`gpt2_gqa` (`GPT2GQAForCausalLM`): vLLM's GPT-2 with its fused QKV projection of h query heads
and G KV heads (`num_key_value_heads` from the config) and an attention layer over G KV heads,
both tensor-parallel as vLLM's GPT-2 is. The stored `c_attn` columns are `[Q | K | V]`
(modeling_gpt2_gqa.py), which vLLM's fused-QKV loader splits by those sizes. Everything else is
vLLM's GPT-2 unchanged (its blocks, MLP, embeddings, head)."""

from __future__ import annotations

from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.layernorm import LayerNorm
from vllm.model_executor.models import gpt2
from vllm.model_executor.models.utils import AutoWeightsLoader

from .attention import FusedQKVAttention, layer_kv_heads
from .causal_lm import attach_head, stage_blocks


class GPT2GQAAttention(FusedQKVAttention):
    """vLLM's GPT2Attention over its layer's KV heads (`layer_kv_heads`)."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        hidden, heads = config.hidden_size, config.num_attention_heads
        super().__init__(
            hidden,
            heads,
            layer_kv_heads(config, prefix, layers=config.num_hidden_layers, heads=heads),
            names=("c_attn", "c_proj"),
            biases=(True, True),
            scale=None if config.scale_attn_weights else 1.0,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=prefix,
        )


class GPT2GQABlock(gpt2.GPT2Block):
    """vLLM's GPT2Block with the GQA attention."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)
        hidden = config.hidden_size
        self.ln_1 = LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.attn = GPT2GQAAttention(config, cache_config, quant_config, prefix=f"{prefix}.attn")
        self.ln_2 = LayerNorm(hidden, eps=config.layer_norm_epsilon)
        inner = config.n_inner if config.n_inner is not None else 4 * hidden
        self.mlp = gpt2.GPT2MLP(inner, config, quant_config, prefix=f"{prefix}.mlp")


@support_torch_compile
class GPT2GQAModel(nn.Module):
    """vLLM's GPT2Model with GQA blocks: its methods, its weight names, compiled as it is (not a
    subclass: the compile decorator wraps each class it decorates once)."""

    hf_to_vllm_mapper = gpt2.GPT2Model.hf_to_vllm_mapper
    embed_input_ids = gpt2.GPT2Model.embed_input_ids
    forward = gpt2.GPT2Model.forward

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if config.add_cross_attention or config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            raise ValueError("uptrain's vLLM gpt2_gqa serves GPT-2 without cross-attention or per-layer scaling")
        self.config = config
        self.embed_dim = config.hidden_size
        self.wte = gpt2.VocabParallelEmbedding(
            config.vocab_size, self.embed_dim, quant_config=vllm_config.quant_config, prefix=f"{prefix}.wte"
        )
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.h = stage_blocks(self, GPT2GQABlock, vllm_config=vllm_config, prefix=f"{prefix}.h")
        self.ln_f = LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

    def load_weights(self, weights):
        """The checkpoint's tensors, GPT-2's Conv1D weights (stored `[in, out]`) transposed to the
        `[out, in]` of vLLM's linear layers, as vLLM's GPT-2 loads them."""
        conv1d = ("c_attn", "c_proj", "c_fc")
        transposed = (
            (name, w.t() if name.endswith(".weight") and any(p in name for p in conv1d) else w) for name, w in weights
        )
        return AutoWeightsLoader(self).load_weights(transposed, mapper=self.hf_to_vllm_mapper)


class GPT2GQAForCausalLM(gpt2.GPT2LMHeadModel):
    """vLLM's GPT2LMHeadModel on the GQA model."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        tied = vllm_config.model_config.hf_config.tie_word_embeddings
        attach_head(self, GPT2GQAModel, vllm_config=vllm_config, prefix=prefix, embeddings="wte", tied=tied)
