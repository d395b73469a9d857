"""What T5 and UMT5 with grouped-query attention share (modeling_t5_gqa.py, modeling_umt5_gqa.py):
the config fields, the K/V projections at G heads, the relative position bias as transformers'
`compute_bias`, the attention replacement and the model classes' build. What differs stays in
each file: which layers have a position bias of their own (T5: block 0, passed on; UMT5: every
self-attention) and how the bias meets the mask. Copied beside converted weights with those
files (GQAModeling.siblings): imports only torch, transformers and the attention file next to it.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import (
    STACK_KV_HEADS,
    TRANSFORMERS_4,
    AttentionBackends,
    GroupedStacksConfig,
    build_as_eager,
    encoder_decoder_kv,
    kv_heads_of_layer,
    refuse_backend,
)

# The attention implementations that add the position bias (see each attention's forward), and
# were tested so. Not flex: transformers 5's takes the bias, but its T5 (and these) crash in
# inductor's CPU flex kernel with a batch > 1 (index out of bounds), so it is untested; 4.x's
# would drop the bias. Flash attention and registered kernels have no place for a per-head bias.
BACKENDS = ("eager", "sdpa")


class T5FamilyConfig(GroupedStacksConfig):
    """Mixin for the T5-family GQA configs: one `num_heads` for all three attentions."""

    def _stack_heads(self) -> dict[str, int]:
        return dict.fromkeys(STACK_KV_HEADS, self.num_heads)

    def _stack_layers(self) -> dict[str, int]:
        return {"encoder": self.num_layers, "decoder-self": self.num_decoder_layers, "cross": self.num_decoder_layers}

    def _grouped_stacks(self) -> None:
        super()._grouped_stacks()
        if TRANSFORMERS_4 and getattr(self, "scale_decoder_outputs", None) is False:
            # transformers 5 writes `tie_word_embeddings: true` for every T5 and UMT5 and says
            # whether the output is rescaled in `scale_decoder_outputs` (false for T5 v1.1, mT5
            # and the published UMT5s; their `lm_head` is its own tensor); 4.57 rescales, and ties
            # `lm_head`, whenever `tie_word_embeddings` is true. Read so, 4.57 computes what 5
            # does, from the `lm_head` in the file. (One whose `lm_head` is the embeddings, so not
            # in the file, as a v1.1 or mT5 made from scratch under 5, gets a fresh one under
            # 4.57, which says so in its "newly initialized" warning.)
            self.tie_word_embeddings = False


def t5_family_config(module: str, config_class: type) -> type:
    """`config_class` (T5Config, UMT5Config) with one number of KV heads per attention, named as
    it with "GQA" before "Config" and belonging to `module`, the calling modeling file's
    `__name__` (`auto_map` and `trust_remote_code` find it there)."""
    fields = ("num_key_value_heads", *STACK_KV_HEADS.values())
    return type(
        config_class.__name__.replace("Config", "GQAConfig"),
        (T5FamilyConfig, config_class),
        {
            "__module__": module,
            "__doc__": f"{config_class.__name__} with one number of KV heads per attention (GroupedStacksConfig).",
            "model_type": f"{config_class.model_type}_gqa",
            # Declared here, so that transformers 5 makes them dataclass fields (GroupedStacksConfig).
            "__annotations__": dict.fromkeys(fields, "int | None"),
            **dict.fromkeys(fields),
        },
    )


class T5FamilyAttention:
    """Mixin for T5's and UMT5's GQA attentions, put before transformers' attention class (which
    keeps its name for transformers' output recorders and builds q, o and the position bias):
    k and v get G·d_kv rows, G this layer's `kv_heads`; the cache holds G heads. Each class sets `gqa_model_type` and
    `needs` (how refusals name the position bias) and has its own `forward`, which dispatches."""

    gqa_model_type = ""
    needs = ""
    bias_in_every_layer = False  # else only block 0's self-attentions have a position bias

    def __init__(
        self, config, kv_heads: int, backend_config, has_relative_attention_bias=False, layer_idx=None, causal=False
    ):
        super().__init__(config, has_relative_attention_bias=has_relative_attention_bias, layer_idx=layer_idx)
        self.is_causal = causal  # 4.57's T5Attention and UMT5Attention have none
        self.num_key_value_heads = kv_heads
        self.num_key_value_groups = self.n_heads // kv_heads
        kv_dim = kv_heads * self.key_value_proj_dim
        self.k = nn.Linear(self.d_model, kv_dim, bias=False)
        self.v = nn.Linear(self.d_model, kv_dim, bias=False)
        # The model's own config, not the stack's: T5 gives each stack a copy of the config, made
        # while the model was built as eager (build_as_eager), so only the model's one says (and
        # `set_attn_implementation` changes) which attention function to use.
        self.config = backend_config

    @classmethod
    def check_backend(cls, implementation: str | None) -> None:
        """Refuse, in one line, an attention implementation with no place for the position bias
        (flash attention, a registered kernel) or one untested with it (flex): it would run
        without it and be wrong."""
        refuse_backend(implementation, BACKENDS, cls.gqa_model_type, cls.needs)

    def _kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*states.shape[:-1], -1, self.key_value_proj_dim)
        return self.k(states).view(shape).transpose(1, 2), self.v(states).view(shape).transpose(1, 2)

    def _queries_keys_values(self, hidden_states, cache, encoder_states, kwargs: dict):
        """The positions already in the cache (read before this step's K/V are added, as
        transformers), the queries `[B, h, T, d]` and K, V `[B, G, S, d]` through the cache."""
        cross = encoder_states is not None
        b, t = hidden_states.shape[:2]
        past = cache.get_seq_length(self.layer_idx) if cache is not None and not cross else 0
        past = past.clone() if isinstance(past, torch.Tensor) else past  # a static cache's count changes in place
        q = self.q(hidden_states).view(b, t, -1, self.key_value_proj_dim).transpose(1, 2)
        states = encoder_states if cross else hidden_states
        k, v = encoder_decoder_kv(cache, self.layer_idx, self._kv, states, cross, kwargs)
        return past, q, k, v

    def _no_position_bias(self, t: int, s: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros((1, self.n_heads, t, s), device=like.device, dtype=like.dtype)

    def _position_bias(self, t: int, s: int, past, like: torch.Tensor) -> torch.Tensor:
        """`[1, h, t, s]`: the layer's relative position bias of the last t of past + t queries
        over s keys (zeros in the layers without one), as transformers' `compute_bias` (whose
        arguments differ between 4.57 and 5); `_buckets` is the architecture's bucketing."""
        if not self.has_relative_attention_bias:
            return self._no_position_bias(t, s, like)
        context = torch.arange(t, dtype=torch.long, device=like.device)[:, None] + past
        memory = torch.arange(s, dtype=torch.long, device=like.device)[None, :]
        return self.relative_attention_bias(self._buckets(memory - context)).permute([2, 0, 1]).unsqueeze(0)


def use_t5_family_attention(model, attention_class) -> None:
    """Replace the three attentions of every block of `model` (a T5- or UMT5-style model just
    built) with `attention_class` ones of the config's KV-head counts, each layer its own
    (`kv_heads_of_layer`). The self-attentions with a position bias of their own: block 0's, or
    every one where `attention_class.bias_in_every_layer`."""
    config = model.config
    for stack, self_key in (
        (model.encoder, STACK_KV_HEADS["encoder"]),
        (model.decoder, STACK_KV_HEADS["decoder-self"]),
    ):
        for i, block in enumerate(stack.block):
            block.layer[0].SelfAttention = attention_class(
                stack.config,
                kv_heads_of_layer(config, i, self_key),
                config,
                has_relative_attention_bias=attention_class.bias_in_every_layer or i == 0,
                layer_idx=i,
                causal=stack.is_decoder,
            )
            if stack.is_decoder:
                block.layer[1].EncDecAttention = attention_class(
                    stack.config, kv_heads_of_layer(config, i, STACK_KV_HEADS["cross"]), config, layer_idx=i
                )


class T5FamilyGQAModel(AttentionBackends):
    """Mixin for the T5-family GQA model classes, put before transformers' class (which stays
    last: `uptrain.modeling.gqa_counterpart` finds it so): transformers' model, built, then each
    attention replaced by `gqa_attention` (the file's T5FamilyAttention) of its KV heads.

    The position bias is a per-head term of the scores: eager and SDPA add it; flash attention
    and registered kernels have no place for it (and flex is untested, see BACKENDS), so they are
    refused when the model is built rather than run without it, and engines that ask
    `is_backend_compatible()` are told no."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    gqa_attention = None  # set on each class

    def __init__(self, config):
        build_as_eager(super().__init__, self, config)
        self.gqa_attention.check_backend(self.config._attn_implementation)
        use_t5_family_attention(self, self.gqa_attention)
        self.post_init()


def t5_family_models(module: str, config: type, attention: type, model_class: type, head_class: type):
    """The GQA base model and seq2seq model of a T5-family architecture: transformers'
    `model_class` and `head_class` (T5Model, T5ForConditionalGeneration, …) built with
    `attention` (its T5FamilyAttention) for `config` (t5_family_config's), named as transformers'
    with "GQA" after the prefix (T5Model → T5GQAModel) and belonging to `module`, the calling
    modeling file's `__name__` (`save_pretrained` copies that file, `auto_map` names it)."""
    prefix = config.__name__.removesuffix("GQAConfig")

    def gqa_model(base: type) -> type:
        body = {
            "__module__": module,
            "__doc__": f"{base.__name__} with grouped-query attention.",
            "config_class": config,
            "gqa_attention": attention,
        }
        return type(f"{prefix}GQA{base.__name__.removeprefix(prefix)}", (T5FamilyGQAModel, base), body)

    return gqa_model(model_class), gqa_model(head_class)
