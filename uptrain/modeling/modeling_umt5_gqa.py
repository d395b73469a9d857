"""UMT5 with grouped-query attention (`model_type` "umt5_gqa"), built on transformers' UMT5.

UMT5 is T5 (v1.1 style) with a relative position bias of its own in *every* self-attention
layer, not only in block 0, each computed by its layer and never passed on to the next. Stored
form: UMT5's own tensor names (T5's), with the K and V projections (`k`, `v`, no biases) of
G·d_kv rows in each of the three attentions: the encoder's self-attention
(`encoder.block.{i}.layer.0.SelfAttention`), the decoder's self-attention
(`decoder.block.{i}.layer.0.SelfAttention`) and its cross-attention
(`decoder.block.{i}.layer.1.EncDecAttention`), each with its own G (`STACK_KV_HEADS`). Every
layer's `relative_attention_bias` stays one column per query head. Everything else is
transformers' UMT5 unchanged. Copied beside converted weights under this name: imports only
torch, transformers and the attention file next to it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import UMT5Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.umt5.modeling_umt5 import UMT5Attention, UMT5ForConditionalGeneration, UMT5Model

from .attention import (
    STACK_KV_HEADS,
    TRANSFORMERS_4,
    AttentionBackends,
    GroupedStacksConfig,
    alibi_as_mask,
    build_as_eager,
    eager_attention_forward,
    encoder_decoder_kv,
    pop_cache,
    refuse_backend,
)

# The attention implementations that add the position bias (see UMT5GQAAttention.forward), and
# were tested so. Not flex, for the reason t5_gqa gives (inductor's CPU flex kernel fails on T5's
# bias with a batch > 1, so it is untested); flash attention and registered kernels have no place
# for a per-head bias.
BACKENDS = ("eager", "sdpa")


def check_backend(implementation: str | None) -> None:
    """Refuse, in one line, an attention implementation that would run without UMT5's position
    bias, or is untested with it."""
    refuse_backend(implementation, BACKENDS, "umt5_gqa", "UMT5's position bias")


class UMT5GQAConfig(GroupedStacksConfig, UMT5Config):
    model_type = "umt5_gqa"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None
    decoder_num_key_value_heads: int | None = None
    cross_attention_num_key_value_heads: int | None = None

    def _stack_heads(self) -> dict[str, int]:
        return dict.fromkeys(STACK_KV_HEADS, self.num_heads)

    def _grouped_stacks(self) -> None:
        super()._grouped_stacks()
        if TRANSFORMERS_4 and getattr(self, "scale_decoder_outputs", None) is False:
            # As for T5 (see t5_gqa): transformers 5 writes `tie_word_embeddings: true` and keeps
            # the checkpoint's choice in `scale_decoder_outputs` (false for the published UMT5s,
            # whose `lm_head` is its own tensor); 4.57 rescales and ties whenever
            # `tie_word_embeddings` is true. Read so, 4.57 computes what 5 does.
            self.tie_word_embeddings = False


class UMT5GQAAttention(UMT5Attention):
    """One UMT5 attention (self or cross) over `kv_heads` K/V heads; the cache holds G heads.

    The scores are unscaled, plus the layer's own position bias per query head (zeros in a
    cross-attention), plus the mask. transformers 5's SDPA function takes the bias itself (as
    for its own UMT5); uptrain's eager function and every 4.57 path get it folded into the
    additive mask."""

    def __init__(self, config, kv_heads: int, backend_config, has_relative_attention_bias, layer_idx, causal=False):
        super().__init__(config, has_relative_attention_bias=has_relative_attention_bias, layer_idx=layer_idx)
        self.is_causal = causal  # 4.57's UMT5Attention has none
        self.num_key_value_heads = kv_heads
        self.num_key_value_groups = self.n_heads // kv_heads
        kv_dim = kv_heads * self.key_value_proj_dim
        self.k = nn.Linear(self.d_model, kv_dim, bias=False)
        self.v = nn.Linear(self.d_model, kv_dim, bias=False)
        # The model's own config, not the stack's copy (made while the model was built as eager,
        # build_as_eager): only the model's says, and `set_attn_implementation` changes, which
        # attention function to use.
        self.config = backend_config

    def _kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*states.shape[:-1], -1, self.key_value_proj_dim)
        return self.k(states).view(shape).transpose(1, 2), self.v(states).view(shape).transpose(1, 2)

    def _position_bias(self, t: int, s: int, past, like: torch.Tensor) -> torch.Tensor:
        """`[1, h, t, s]`: this layer's relative position bias of the last t of past + t queries
        over s keys (zeros in a cross-attention), as transformers' `compute_bias`, whose
        arguments differ between 4.57 and 5."""
        if not self.has_relative_attention_bias:
            return torch.zeros((1, self.n_heads, t, s), device=like.device, dtype=like.dtype)
        context = torch.arange(t, dtype=torch.long, device=like.device)[:, None] + past
        memory = torch.arange(s, dtype=torch.long, device=like.device)[None, :]
        buckets = self._relative_position_bucket(memory - context)
        return self.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        if kwargs.pop("layer_head_mask", None) is not None:  # 4.57's; None unless the caller gives one
            raise ValueError("umt5_gqa does not support head masks")
        cross = encoder_hidden_states is not None
        b, t = hidden_states.shape[:2]
        # Positions already in the cache, read before this step's K/V are added (as transformers).
        past = cache.get_seq_length(self.layer_idx) if cache is not None and not cross else 0
        past = past.clone() if isinstance(past, torch.Tensor) else past  # a static cache's count changes in place
        q = self.q(hidden_states).view(b, t, -1, self.key_value_proj_dim).transpose(1, 2)
        states = encoder_hidden_states if cross else hidden_states
        k, v = encoder_decoder_kv(cache, self.layer_idx, self._kv, states, cross, kwargs)

        implementation = self.config._attn_implementation
        check_backend(implementation)  # also after a `set_attn_implementation`
        bias = self._position_bias(t, k.shape[-2], past, q)
        if TRANSFORMERS_4 or implementation in (None, "eager"):
            # One additive mask: the bias with the mask in it (4.57's UMT5 adds them so). The bias
            # enters the scores as ALiBi does, hence attention.py's fold; with no mask an encoder's
            # or cross-attention's queries see every key.
            if attention_mask is not None or (self.is_causal and not cross):
                bias = alibi_as_mask(bias, attention_mask, t, k.shape[-2], bias.dtype)
            mask, extra = bias, {}
        else:
            mask, extra = attention_mask, {"position_bias": bias}
        dropout = self.dropout if self.training else 0.0
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(self, q, k, v, mask, scaling=1.0, dropout=dropout, **extra, **kwargs)
        return self.o(out.reshape(b, t, -1).contiguous()), weights


def _use_gqa_attention(model) -> None:
    """Replace the attentions of every block of `model` (a UMT5Model or
    UMT5ForConditionalGeneration just built) with GQA ones of the config's KV-head counts; every
    self-attention keeps a position bias of its own, as in UMT5."""
    config = model.config
    for stack, self_heads in (
        (model.encoder, config.encoder_num_key_value_heads),
        (model.decoder, config.decoder_num_key_value_heads),
    ):
        for i, block in enumerate(stack.block):
            block.layer[0].SelfAttention = UMT5GQAAttention(
                stack.config, self_heads, config, has_relative_attention_bias=True, layer_idx=i, causal=stack.is_decoder
            )
            if stack.is_decoder:
                block.layer[1].EncDecAttention = UMT5GQAAttention(
                    stack.config, config.cross_attention_num_key_value_heads, config, False, layer_idx=i
                )


class UMT5Backends(AttentionBackends):
    """Eager and SDPA add the position bias; flash attention and registered kernels have no
    place for it and flex is untested (BACKENDS): refused when the model is built, and engines
    that ask `is_backend_compatible()` are told no."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False


def _build(model, init, config: UMT5GQAConfig) -> None:
    """Build `model` with transformers' `init` (its class's `__init__`), then its GQA attentions."""
    build_as_eager(init, model, config)
    check_backend(model.config._attn_implementation)
    _use_gqa_attention(model)
    model.post_init()


class UMT5GQAModel(UMT5Backends, UMT5Model):
    config_class = UMT5GQAConfig

    def __init__(self, config: UMT5GQAConfig):
        _build(self, super().__init__, config)


class UMT5GQAForConditionalGeneration(UMT5Backends, UMT5ForConditionalGeneration):
    config_class = UMT5GQAConfig

    def __init__(self, config: UMT5GQAConfig):
        _build(self, super().__init__, config)
