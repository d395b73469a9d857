"""T5 with grouped-query attention (`model_type` "t5_gqa"), built on transformers' T5.

Also the GQA form of mT5 and T5 v1.1 / Flan-T5 (gated-GELU): transformers runs them with the
same classes. Stored form: T5's own tensor names, with the K and V projections (`k`, `v`, no
biases) of G·d_kv rows in each of the three attentions: the encoder's self-attention
(`encoder.block.{i}.layer.0.SelfAttention`), the decoder's self-attention
(`decoder.block.{i}.layer.0.SelfAttention`) and its cross-attention
(`decoder.block.{i}.layer.1.EncDecAttention`), each with its own G (`STACK_KV_HEADS`). The
relative position bias (block 0 of each stack) stays one per query head. Everything else is
transformers' T5 unchanged. Copied beside converted weights under this name: imports only
torch, transformers and the attention file next to it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import T5Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.t5.modeling_t5 import T5Attention, T5ForConditionalGeneration, T5Model

from .attention import (
    TRANSFORMERS_4,
    AttentionBackends,
    GroupedStacksConfig,
    build_as_eager,
    eager_attention_forward,
    encoder_decoder_kv,
    pop_cache,
    refuse_backend,
)

# The attention implementations that add T5's position bias (see T5GQAAttention.forward), and
# were tested so. Not flex: transformers 5's takes the bias, but its T5 (and this one) crash in
# inductor's CPU flex kernel with a batch > 1 (index out of bounds), so it is untested; 4.x's
# would drop the bias.
BACKENDS = ("eager", "sdpa")


def check_backend(implementation: str | None) -> None:
    """Refuse, in one line, an attention implementation with no place for T5's position bias
    (flash attention, a registered kernel) or one untested with it (flex): it would run without
    it and be wrong."""
    refuse_backend(implementation, BACKENDS, "t5_gqa", "T5's position bias")


class T5GQAConfig(GroupedStacksConfig, T5Config):
    model_type = "t5_gqa"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None
    decoder_num_key_value_heads: int | None = None
    cross_attention_num_key_value_heads: int | None = None

    def _stack_heads(self) -> dict[str, int]:
        return {"encoder": self.num_heads, "decoder-self": self.num_heads, "cross": self.num_heads}

    def _grouped_stacks(self) -> None:
        super()._grouped_stacks()
        if TRANSFORMERS_4 and getattr(self, "scale_decoder_outputs", None) is False:
            # transformers 5 writes `tie_word_embeddings: true` for every T5 and says whether the
            # output is rescaled in `scale_decoder_outputs` (false for T5 v1.1 and mT5; their
            # `lm_head` is its own tensor); 4.57 rescales, and ties `lm_head`, whenever
            # `tie_word_embeddings` is true. Read so, 4.57 computes what 5 does, from the
            # `lm_head` in the file. (One whose `lm_head` is the embeddings, so not in the file,
            # as a v1.1 or mT5 made from scratch under 5, gets a fresh one under 4.57, which
            # says so in its "newly initialized" warning.)
            self.tie_word_embeddings = False


def _with_mask(bias: torch.Tensor, mask, causal: bool) -> torch.Tensor:
    """T5's position bias `[1 or B, h, T, S]` with the attention mask folded in: the additive
    mask the attention adds to the scores. `mask` is additive, boolean (True = attend) or None;
    None in a causal self-attention means causal (SDPA masks leave that to the kernel), aligned
    to the end of the keys as after a cache."""
    t, s = bias.shape[-2:]
    if mask is None and causal and t > 1:
        mask = torch.ones(t, s, dtype=torch.bool, device=bias.device).tril(diagonal=s - t)
    if mask is None:
        return bias
    mask = mask[..., :s]  # masks may cover a whole static cache
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, torch.finfo(bias.dtype).min)
    return bias + mask


class T5GQAAttention(T5Attention):
    """One T5 attention (self or cross) over `kv_heads` K/V heads; the cache holds G heads.

    T5 adds a position bias per query head to the scores and does not scale them. transformers
    5 passes the bias on separately from the mask (its attention functions add both), 4.57
    passes it on with the mask folded in (block 0 folds it; later layers add only the bias
    they are given): each version's convention is kept, so either version's T5 layers above
    this one run unchanged."""

    def __init__(
        self, config, kv_heads: int, backend_config, has_relative_attention_bias=False, layer_idx=None, causal=False
    ):
        super().__init__(config, has_relative_attention_bias=has_relative_attention_bias, layer_idx=layer_idx)
        self.is_causal = causal  # 4.57's T5Attention has no is_causal
        self.num_key_value_heads = kv_heads
        self.num_key_value_groups = self.n_heads // kv_heads
        kv_dim = kv_heads * self.key_value_proj_dim
        self.k = nn.Linear(self.d_model, kv_dim, bias=False)
        self.v = nn.Linear(self.d_model, kv_dim, bias=False)
        # The model's own config, not the stack's: T5 gives each stack a copy of the config, made
        # while the model was built as eager (build_as_eager), so only the model's one says (and
        # `set_attn_implementation` changes) which attention function to use.
        self.config = backend_config

    def _kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*states.shape[:-1], -1, self.key_value_proj_dim)
        return self.k(states).view(shape).transpose(1, 2), self.v(states).view(shape).transpose(1, 2)

    def _position_bias(self, t: int, s: int, past: int, like: torch.Tensor) -> torch.Tensor:
        """`[1, h, t, s]`: T5's relative position bias of the last t of past + t queries over s
        keys (zeros in the layers without one), as transformers' `compute_bias` (whose
        arguments differ between 4.57 and 5)."""
        if not self.has_relative_attention_bias:
            bias = torch.zeros((1, self.n_heads, t, s), device=like.device, dtype=like.dtype)
            if self.gradient_checkpointing and self.training:
                bias.requires_grad = True  # as transformers' T5: checkpointed layers need an input with grad
            return bias
        context = torch.arange(t, dtype=torch.long, device=like.device)[:, None] + past
        memory = torch.arange(s, dtype=torch.long, device=like.device)[None, :]
        buckets = self._relative_position_bucket(
            memory - context,
            bidirectional=not self.is_decoder,
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        return self.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, **kwargs):
        cache = pop_cache(kwargs)
        output_attentions = kwargs.pop("output_attentions", False)  # 4.57: decides what is returned
        if kwargs.pop("layer_head_mask", None) is not None:
            raise ValueError("t5_gqa does not support head masks")
        for name in ("use_cache", "query_length"):  # 4.57's, read by its T5Attention only
            kwargs.pop(name, None)
        cross = key_value_states is not None
        b, t = hidden_states.shape[:2]
        # Positions already in the cache, read before this step's K/V are added (as transformers).
        past = cache.get_seq_length(self.layer_idx) if cache is not None and not cross else 0
        past = past.clone() if isinstance(past, torch.Tensor) else past  # a static cache's count changes in place
        q = self.q(hidden_states).view(b, t, -1, self.key_value_proj_dim).transpose(1, 2)
        k, v = encoder_decoder_kv(
            cache, self.layer_idx, self._kv, key_value_states if cross else hidden_states, cross, kwargs
        )

        causal = self.is_causal and not cross
        implementation = self.config._attn_implementation
        check_backend(implementation)  # also after a `set_attn_implementation`
        if position_bias is None:
            position_bias = self._position_bias(t, k.shape[-2], past, q)
            if TRANSFORMERS_4:
                position_bias = _with_mask(position_bias, mask, causal)
        if TRANSFORMERS_4:
            mask, extra = position_bias, {}
        elif implementation in (None, "eager"):
            # uptrain's eager function adds one additive mask: the bias with the mask in it.
            mask, extra = _with_mask(position_bias, mask, causal), {}
        else:
            # transformers 5's SDPA function takes T5's bias itself (folds it into the mask),
            # exactly as for its own T5.
            extra = {"position_bias": position_bias}
        dropout = self.dropout if self.training else 0.0
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(self, q, k, v, mask, scaling=1.0, dropout=dropout, **extra, **kwargs)
        out = self.o(out.reshape(b, t, -1).contiguous())
        if TRANSFORMERS_4:
            return (out, position_bias, weights) if output_attentions else (out, position_bias)
        return out, position_bias, weights


def _use_gqa_attention(model) -> None:
    """Replace the three attentions of every block of `model` (a T5Model or
    T5ForConditionalGeneration just built) with GQA ones of the config's KV-head counts."""
    config = model.config
    for stack, self_heads in (
        (model.encoder, config.encoder_num_key_value_heads),
        (model.decoder, config.decoder_num_key_value_heads),
    ):
        for i, block in enumerate(stack.block):
            block.layer[0].SelfAttention = T5GQAAttention(
                stack.config,
                self_heads,
                config,
                has_relative_attention_bias=i == 0,
                layer_idx=i,
                causal=stack.is_decoder,
            )
            if stack.is_decoder:
                block.layer[1].EncDecAttention = T5GQAAttention(
                    stack.config, config.cross_attention_num_key_value_heads, config, layer_idx=i
                )


class T5Backends(AttentionBackends):
    """T5's position bias is a per-head term of the scores: eager and SDPA add it; flash
    attention and registered kernels have no place for it (and flex is untested, see BACKENDS),
    so they are refused when the model is built (`check_backend`) rather than run without it,
    and engines that ask `is_backend_compatible()` are told no."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False


class T5GQAModel(T5Backends, T5Model):
    config_class = T5GQAConfig

    def __init__(self, config: T5GQAConfig):
        build_as_eager(super().__init__, self, config)
        check_backend(self.config._attn_implementation)
        _use_gqa_attention(self)
        self.post_init()


class T5GQAForConditionalGeneration(T5Backends, T5ForConditionalGeneration):
    config_class = T5GQAConfig

    def __init__(self, config: T5GQAConfig):
        build_as_eager(super().__init__, self, config)
        check_backend(self.config._attn_implementation)
        _use_gqa_attention(self)
        self.post_init()
