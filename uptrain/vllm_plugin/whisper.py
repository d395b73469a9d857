"""`whisper_gqa` (`WhisperGQAForConditionalGeneration`): vLLM's Whisper with G KV heads in each of
its three attentions, read from the converted config (`encoder_num_key_value_heads`,
`decoder_num_key_value_heads`, `cross_attention_num_key_value_heads`: modeling_whisper_gqa.py; each
layer its own where the config lists them, `<key>_per_layer`: `layer_kv_heads`):
the encoder's self-attention (no cache), the decoder's self-attention and its cross-attention,
whose cache holds the encoder's 1500 frames of every sequence. The stored projections are
Whisper's own with `k_proj` and `v_proj` of G·d rows, which vLLM's fused loaders split by those
sizes. Everything else is vLLM's Whisper unchanged: its audio processing (the multimodal
processor registered on its class, which this one inherits), convolutions, MLPs, embeddings,
head and weight names; tensor-parallel as vLLM's is.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import WhisperProcessor
from transformers.models.whisper.modeling_whisper import sinusoids
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention, CrossAttention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.models import whisper
from vllm.model_executor.models.utils import AutoWeightsLoader, make_layers
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.v1.attention.backend import AttentionType

from .attention import layer_kv_heads


def decoder_kv_heads(config, prefix: str, key: str) -> int:
    """The KV heads of one decoder layer's self- or cross-attention (`key`), the layer `prefix` names."""
    return layer_kv_heads(config, prefix, key, layers=config.decoder_layers, heads=config.decoder_attention_heads)


class WhisperGQAAttention(whisper.WhisperAttention):
    """vLLM's WhisperAttention (the encoder's or the decoder's self-attention) over
    `num_kv_heads` KV heads: one fused QKV projection of h and G heads, as vLLM's Llama has."""

    def __init__(self, config, heads: int, kv_heads: int, attn_type, cache_config, quant_config, prefix: str):
        nn.Module.__init__(self)
        tp = get_tensor_model_parallel_world_size()
        self.embed_dim = config.d_model
        self.total_num_heads, self.total_num_kv_heads = heads, kv_heads
        self.num_heads = heads // tp
        # Fewer KV heads than ranks: each rank holds a replica of one (vLLM's rule for GQA).
        self.num_kv_heads = max(1, kv_heads // tp)
        self.head_dim = self.embed_dim // heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.attn_type = attn_type
        self.scaling = self.head_dim**-0.5
        self._init_qkv(self.embed_dim, True, quant_config, prefix=prefix)
        self.out_proj = RowParallelLinear(
            self.embed_dim, self.embed_dim, bias=True, quant_config=quant_config, prefix=f"{prefix}.out_proj"
        )
        self.attn = self._attention(cache_config, quant_config, prefix)

    def _init_qkv(self, embed_dim: int, bias: bool = True, quant_config=None, prefix: str = "") -> None:
        self.qkv_proj = QKVParallelLinear(
            embed_dim,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )

    def _attention(self, cache_config, quant_config, prefix: str) -> nn.Module:
        """vLLM's attention layer of this attention's kind (as vLLM's WhisperAttention picks it)."""
        heads = (self.num_heads, self.head_dim, self.scaling)
        if self.attn_type == AttentionType.ENCODER:
            return whisper.WhisperEncoderAttention(*heads, num_kv_heads=self.num_kv_heads)
        kind = CrossAttention if self.attn_type == AttentionType.ENCODER_DECODER else Attention
        return kind(
            *heads,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
            attn_type=self.attn_type,
        )


class WhisperGQACrossAttention(WhisperGQAAttention):
    """vLLM's WhisperCrossAttention over `num_kv_heads` KV heads: the query projection of the
    decoder's states, one fused K/V projection (G heads each) of the encoder's."""

    forward = whisper.WhisperCrossAttention.forward

    def __init__(self, config, cache_config, quant_config, prefix: str):
        heads = config.decoder_attention_heads
        kv_heads = decoder_kv_heads(config, prefix, "cross_attention_num_key_value_heads")
        tp = get_tensor_model_parallel_world_size()
        # The fused K/V projection splits its columns across ranks; a KV head cannot be split.
        if kv_heads % tp:
            raise ValueError(f"cross_attention_num_key_value_heads {kv_heads} is not a multiple of {tp} ranks")
        super().__init__(config, heads, kv_heads, AttentionType.ENCODER_DECODER, cache_config, quant_config, prefix)

    def _init_qkv(self, embed_dim: int, bias: bool = True, quant_config=None, prefix: str = "") -> None:
        kv_dim = self.total_num_kv_heads * self.head_dim
        self.q_proj = ColumnParallelLinear(
            embed_dim, embed_dim, bias=bias, quant_config=quant_config, prefix=f"{prefix}.q_proj"
        )
        self.kv_proj = MergedColumnParallelLinear(
            embed_dim, [kv_dim, kv_dim], bias=bias, quant_config=quant_config, prefix=f"{prefix}.kv_proj"
        )


class WhisperGQAEncoderLayer(whisper.WhisperEncoderLayer):
    """vLLM's WhisperEncoderLayer with the encoder's G KV heads."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        config, cache, quant = vllm_config.model_config.hf_config, vllm_config.cache_config, vllm_config.quant_config
        self.embed_dim = config.d_model
        self.self_attn = WhisperGQAAttention(
            config,
            config.encoder_attention_heads,
            layer_kv_heads(
                config,
                prefix,
                "encoder_num_key_value_heads",
                layers=config.encoder_layers,
                heads=config.encoder_attention_heads,
            ),
            AttentionType.ENCODER,
            cache,
            quant,
            prefix=f"{prefix}.self_attn",
        )
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        act = config.activation_function
        self.mlp = whisper.WhisperMLP(self.embed_dim, config.encoder_ffn_dim, act, quant, prefix=f"{prefix}.mlp")
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)


class WhisperGQADecoderLayer(whisper.WhisperDecoderLayer):
    """vLLM's WhisperDecoderLayer with the G KV heads of its self-attention and its cross-attention."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        config, cache, quant = vllm_config.model_config.hf_config, vllm_config.cache_config, vllm_config.quant_config
        hidden = config.d_model
        self.self_attn = WhisperGQAAttention(
            config,
            config.decoder_attention_heads,
            decoder_kv_heads(config, prefix, "decoder_num_key_value_heads"),
            AttentionType.DECODER,
            cache,
            quant,
            prefix=f"{prefix}.self_attn",
        )
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.encoder_attn = WhisperGQACrossAttention(config, cache, quant, prefix=f"{prefix}.encoder_attn")
        self.encoder_attn_layer_norm = nn.LayerNorm(hidden)
        act = config.activation_function
        self.mlp = whisper.WhisperMLP(hidden, config.decoder_ffn_dim, act, quant, prefix=f"{prefix}.mlp")
        self.final_layer_norm = nn.LayerNorm(hidden)


class WhisperGQAEncoder(whisper.WhisperEncoder):
    """vLLM's WhisperEncoder (its forward) with GQA layers: two convolutions over the log-mel
    features, sinusoidal positions, the layers."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        if getattr(config, "pos_embed", "sinusoidal") != "sinusoidal":
            raise ValueError("uptrain's vLLM whisper_gqa serves Whisper's sinusoidal encoder positions")
        embed_dim = config.d_model
        self.pos_embed_type = whisper.WhisperPosEmbedType.SINUSOIDAL
        self.num_mel_bins, self.max_source_positions = config.num_mel_bins, config.max_source_positions
        self.embed_scale = math.sqrt(embed_dim) if config.scale_embedding else 1.0
        self.conv1 = nn.Conv1d(self.num_mel_bins, embed_dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(embed_dim, embed_dim, stride=2, kernel_size=3, padding=1)
        self.total_stride = self.conv1.stride[0] * self.conv2.stride[0]
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.encoder_layers,
            lambda prefix: WhisperGQAEncoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.layer_norm = nn.LayerNorm(embed_dim)
        self.embed_positions = nn.Embedding(self.max_source_positions, embed_dim)
        with torch.no_grad():
            self.embed_positions.weight.copy_(sinusoids(*self.embed_positions.weight.shape))


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1})
class WhisperGQADecoder(nn.Module):
    """vLLM's WhisperDecoder with GQA layers (its methods; not a subclass: the compile decorator
    wraps each class it decorates once)."""

    forward = whisper.WhisperDecoder.forward
    embed_input_ids = whisper.WhisperDecoder.embed_input_ids

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.layerdrop, self.padding_idx = config.decoder_layerdrop, config.pad_token_id
        self.max_target_positions, self.max_source_positions = config.max_target_positions, config.max_source_positions
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, self.padding_idx)
        self.embed_positions = whisper.WhisperPositionalEmbedding(self.max_target_positions, config.d_model)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.decoder_layers,
            lambda prefix: WhisperGQADecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.layer_norm = nn.LayerNorm(config.d_model)


class WhisperGQAModel(whisper.WhisperModel):
    """vLLM's WhisperModel (its forward and encoder outputs) on the GQA encoder and decoder."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        self.encoder = WhisperGQAEncoder(vllm_config=vllm_config, prefix=f"{prefix}.encoder")
        self.decoder = WhisperGQADecoder(vllm_config=vllm_config, prefix=f"{prefix}.decoder")


def zero_k_biases(weights):
    """The checkpoint's tensors, and a zero bias after each `k_proj.weight` (Whisper's K has no
    bias; vLLM's fused projections have one for all of Q, K and V), of its G·d rows."""
    for name, weight in weights:
        yield name, weight
        if name.endswith(".k_proj.weight"):
            yield name.removesuffix(".weight") + ".bias", torch.zeros(weight.shape[0], dtype=weight.dtype)


class WhisperGQAProcessingInfo(whisper.WhisperProcessingInfo):
    """vLLM's Whisper processing, with transformers' WhisperProcessor asked for by name: a
    conversion's model_type (whisper_gqa) is not in transformers' AutoProcessor map, which then
    gives the tokenizer alone where the folder names no processor class (a Hub-style folder: a
    preprocessor_config.json and the tokenizer's files, as openai/whisper-base has them)."""

    def get_hf_processor(self, **kwargs):
        return self.ctx.get_hf_processor(WhisperProcessor, **kwargs)


@MULTIMODAL_REGISTRY.register_processor(
    whisper.WhisperMultiModalProcessor, info=WhisperGQAProcessingInfo, dummy_inputs=whisper.WhisperDummyInputsBuilder
)
class WhisperGQAForConditionalGeneration(whisper.WhisperForConditionalGeneration):
    """vLLM's WhisperForConditionalGeneration (its audio processing, prompts, weight names) on
    the GQA model."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        self.config, self.dtype = config, vllm_config.model_config.dtype
        with self._mark_composite_model(
            vllm_config, language_targets=WhisperGQADecoder, tower_targets={"audio": WhisperGQAEncoder}
        ):
            self.model = WhisperGQAModel(vllm_config=vllm_config, prefix=prefix)
        self.proj_out = whisper.ParallelLMHead(
            config.vocab_size,
            config.d_model,
            quant_config=vllm_config.quant_config,
            prefix=whisper.maybe_prefix(prefix, "proj_out"),
        )
        self.proj_out = self.proj_out.tie_weights(self.model.decoder.embed_tokens)
        self.logits_processor = whisper.LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))

    def load_weights(self, weights):
        """The checkpoint's tensors under vLLM's Whisper names, a zero K bias of G·d rows added
        (vLLM's Whisper adds one of d_model rows, h heads')."""
        return AutoWeightsLoader(self).load_weights(zero_k_biases(weights), mapper=self.hf_to_vllm_mapper)
