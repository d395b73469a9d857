"""`gpt_neo_gqa` (`GPTNeoGQAForCausalLM`): GPT-Neo over G KV heads (`num_key_value_heads` from the
config), built of vLLM's layers: vLLM 0.32 has no GPT-Neo class, and its transformers backend's
attention takes no mask, so a local layer's window (`attention_layers`, `window_size`) would not
apply there. Here each local layer's attention is vLLM's with that window
(`per_layer_sliding_window`: a query sees the `window_size` keys up to itself, as transformers'
GPT-Neo's mask allows). It follows transformers' GPT-Neo: learned positions added to the token
embeddings, pre-norm blocks, separate Q, K (G·d rows), V projections without biases (stored so:
modeling_gpt_neo_gqa.py; fused here into vLLM's QKV projection as they load) and an output
projection with one, scores not scaled by 1/√d, the config's activation in the MLP, the head
tied to the embeddings. Tensor-parallel as vLLM's GPT-2 is.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.utils import WeightsMapper

from .attention import FusedQKVAttention, layer_kv_heads
from .causal_lm import TOKEN_DIMS, CausalLM, stage_blocks, stage_forward


class GPTNeoGQASelfAttention(nn.Module):
    """The `attn` of a GPT-Neo block: its `attention` (transformers' nesting, kept for the weights'
    names), global or local with its window, over its layer's KV heads (`layer_kv_heads`)."""

    def __init__(self, config, window: int | None, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        self.attention = FusedQKVAttention(
            config.hidden_size,
            config.num_heads,
            layer_kv_heads(config, prefix, layers=config.num_layers, heads=config.num_heads),
            names=("qkv_proj", "out_proj"),
            biases=(False, True),
            scale=1.0,  # GPT-Neo does not scale the scores
            window=window,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attention",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attention(hidden_states)


class GPTNeoGQAMLP(nn.Module):
    """GPT-Neo's MLP: c_fc, the config's activation, c_proj, with biases."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        hidden = config.hidden_size
        inner = config.intermediate_size or 4 * hidden
        self.c_fc = ColumnParallelLinear(hidden, inner, bias=True, quant_config=quant_config, prefix=f"{prefix}.c_fc")
        self.act = get_act_fn(config.activation_function)
        self.c_proj = RowParallelLinear(inner, hidden, bias=True, quant_config=quant_config, prefix=f"{prefix}.c_proj")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up, _ = self.c_fc(hidden_states)
        down, _ = self.c_proj(self.act(up))
        return down


def layer_index(prefix: str) -> int:
    """The layer number make_layers puts at the end of each layer's prefix (`….h.3`)."""
    return int(prefix.rsplit(".", 1)[-1])


class GPTNeoGQABlock(nn.Module):
    """GPT-Neo's block: attention and MLP, each after a layer norm, each added to the stream."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        local = config.attention_layers[layer_index(prefix)] == "local"
        window = config.window_size if local else None
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPTNeoGQASelfAttention(config, window, cache_config, quant_config, prefix=f"{prefix}.attn")
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPTNeoGQAMLP(config, quant_config, prefix=f"{prefix}.mlp")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


@support_torch_compile(dynamic_arg_dims=TOKEN_DIMS)
class GPTNeoGQAModel(nn.Module):
    """GPT-Neo's model: token and learned position embeddings, the blocks, a final layer norm."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = stage_blocks(self, GPTNeoGQABlock, vllm_config=vllm_config, prefix=f"{prefix}.h")
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        def embed():
            tokens = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            return tokens + self.wpe(positions)

        return stage_forward(self, embed, self.h, self.ln_f, intermediate_tensors)


class GPTNeoGQAForCausalLM(CausalLM):
    """GPT-Neo's causal LM: the model and its head (tied to the embeddings unless the config unties them)."""

    # transformers' separate projections → vLLM's fused one, each its shard.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".attention.q_proj": (".attention.qkv_proj", "q"),
            ".attention.k_proj": (".attention.qkv_proj", "k"),
            ".attention.v_proj": (".attention.qkv_proj", "v"),
        }
    )
    model_class = GPTNeoGQAModel
