"""Grouped-query attention shared by every GQA modeling file uptrain ships.

This file is copied beside converted weights and loaded by `trust_remote_code=True` without
uptrain installed: it imports only torch and transformers, and works under transformers 4.57
(the last 4.x) and 5.x. The two differ in what an attention layer is called with (4.x:
`past_key_values=` or `layer_past=`, 5.x: `cache=`) and in how configs are built (5.x configs
are dataclasses): the helpers here absorb both, so each modeling file has one code path.

KV heads may differ by layer: beside an attention's scalar key (`num_key_value_heads`, or one of
STACK_KV_HEADS), config.json may hold a list under the same name + "_per_layer", one entry per
layer of that attention, the scalar then the largest entry (`check_per_layer`,
`kv_heads_of_layer`). uptrain reads the same lists with `uptrain.model_info.layer_kv_heads`;
this file, which must load without uptrain, reads them itself.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# The oldest transformers these files were tested with. Older ones differ in ways that give no
# error (cache and mask conventions): refuse them rather than compute something else.
MIN_TRANSFORMERS = (4, 57)
TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
if TRANSFORMERS_VERSION < MIN_TRANSFORMERS:
    needed = ".".join(map(str, MIN_TRANSFORMERS))
    raise ImportError(
        f"uptrain's GQA modeling needs transformers >= {needed} (found {transformers.__version__}): "
        f"pip install -U 'transformers>={needed}'"
    )
TRANSFORMERS_4 = TRANSFORMERS_VERSION < (5, 0)

# What the layer above passes the KV cache as: 5.x `cache`, 4.57 `past_key_values` (GPT-2, OPT)
# or `layer_past` (NeoX, GPT-J, BLOOM), earlier 4.x `past_key_value`.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def pop_cache(kwargs: dict):
    """The KV cache among an attention layer's keyword arguments (removed from them), or None."""
    found = None
    for name in CACHE_ARGUMENTS:
        value = kwargs.pop(name, None)
        if value is not None:  # not `or`: an empty cache is falsy
            found = value
    return found


def update_cache(cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict):
    """K and V of every position so far, after adding these (G heads, never repeated) to `cache`.
    The layer's keyword arguments go along positionally: 4.x caches read `cache_position` from
    them, 5.x's paged cache (continuous batching) writes its read/write indices into them for
    the attention function."""
    if cache is None:
        return key, value
    return cache.update(key, value, layer_idx, kwargs)


# config.json's per-layer KV heads of one attention: a list under its scalar key's name + this.
PER_LAYER = "_per_layer"
KV_HEADS = "num_key_value_heads"  # a decoder-only model's scalar key


def _whole(entry) -> bool:
    return isinstance(entry, int) and not isinstance(entry, bool) and entry >= 1


def _largest(entries) -> int | None:
    """The largest entry of a per-layer list (None when `entries` is no list of whole numbers ≥ 1):
    the scalar's default where a config gives the list alone, as the scalar must equal it."""
    if isinstance(entries, (list, tuple)) and entries and all(_whole(e) for e in entries):
        return max(entries)
    return None


def check_per_layer(config, key: str, layers: int, heads: int, attention: str) -> None:
    """Refuse, in one line, a per-layer list (`key` + PER_LAYER) that is not one whole number ≥ 1
    per layer of the attention (`layers`) dividing its `heads` query heads, or whose largest entry
    is not the scalar `key` (the upper bound readers that know only the scalar size caches by).
    A tuple is kept as a list: config.json writes one, and a loaded config compares equal."""
    name = key + PER_LAYER
    entries = getattr(config, name, None)
    if entries is None:
        return
    if _largest(entries) is None:
        raise ValueError(f"{name} must be a list of whole numbers >= 1, one per layer; got {entries!r}")
    if len(entries) != layers:
        raise ValueError(f"{name} has {len(entries)} entries for the {attention}'s {layers} layers")
    for layer, kv in enumerate(entries):
        if heads % kv:
            raise ValueError(f"{name}[{layer}] = {kv} does not divide the {attention}'s {heads} heads")
    if max(entries) != getattr(config, key):
        raise ValueError(f"{key} {getattr(config, key)} is not the largest entry of {name} {list(entries)}")
    setattr(config, name, list(entries))


def kv_heads_of_layer(config, layer_idx: int, key: str = KV_HEADS) -> int:
    """The KV heads of layer `layer_idx` of the attention whose scalar key is `key`: its entry of
    the per-layer list where the config has one (checked when the config was built), else the
    scalar, as before per-layer lists existed."""
    entries = getattr(config, key + PER_LAYER, None)
    return getattr(config, key) if entries is None else entries[layer_idx]


def refuse_one_count_engine(config) -> None:
    """Refuse, in one line, vLLM's transformers backend (its attention function, "vllm") for a
    model whose layers differ in KV heads: it sizes every layer's KV cache by the config's one
    count (the largest), which the smaller layers' K and V do not fill."""
    entries = getattr(config, KV_HEADS + PER_LAYER, None)
    if config._attn_implementation == "vllm" and entries is not None and len(set(entries)) > 1:
        raise ValueError(
            f"{config.model_type} with per-layer KV heads {list(entries)} cannot serve in vLLM's transformers "
            f"backend: it gives every layer {config.num_key_value_heads} KV heads"
        )


class GroupedHeadsConfig:
    """Mixin for the GQA configs: `num_key_value_heads` defaults to the number of attention
    heads (to the largest entry of `num_key_value_heads_per_layer` where only that is given) and
    must divide it, under transformers 4.x (`__init__`) and 5.x (`__post_init__`); a per-layer
    list is checked (`check_per_layer`). Each config declares the scalar field itself
    (`num_key_value_heads: int | None = None`), so that 5.x makes it a dataclass field; the list
    is not declared, so a config without it writes exactly the keys it wrote before (both
    versions keep config.json's undeclared keys as attributes, and write them back).
    `_check_gqa` holds a config's own further checks."""

    def _grouped_heads(self) -> None:
        if self.num_key_value_heads is None:
            per_layer = getattr(self, KV_HEADS + PER_LAYER, None)
            self.num_key_value_heads = _largest(per_layer) or self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        check_per_layer(self, KV_HEADS, self.num_hidden_layers, self.num_attention_heads, "model")
        self._check_gqa()

    def _check_gqa(self) -> None:
        pass

    @staticmethod
    def _kwargs_for_4x(kwargs: dict) -> dict:
        """config.json's fields as this config's 4.x `__init__` takes them (where 5.x renamed some)."""
        return kwargs

    if TRANSFORMERS_4:  # configs built by `__init__(**kwargs)`

        def __init__(self, num_key_value_heads=None, **kwargs):
            super().__init__(**self._kwargs_for_4x(kwargs))
            self.num_key_value_heads = num_key_value_heads
            self._grouped_heads()
    else:  # transformers 5 builds configs as dataclasses: fields, then `__post_init__`

        def __post_init__(self, **kwargs):
            if self.num_key_value_heads is None:
                per_layer = kwargs.get(KV_HEADS + PER_LAYER)  # an attribute only once the base class has run
                self.num_key_value_heads = _largest(per_layer) or self.num_attention_heads
            heads = self.num_key_value_heads
            super().__post_init__(**kwargs)
            # The base config may derive its own (Falcon's, from 5.25, from its `num_kv_heads`,
            # which a converted config.json holds as the source had it): the GQA count stands.
            self.num_key_value_heads = heads
            self._grouped_heads()


def rope_for_4x(kwargs: dict, theta: str, partial: str | None = None) -> dict:
    """config.json's fields with the rotary settings also under 4.x's names: transformers 5
    writes them only inside `rope_parameters`, which 4.x ignores (it would rotate at base 10000,
    and NeoX a quarter of each head, whatever the model has). `theta` (and `partial`, for a
    partial rotary factor) are the names the architecture's 4.x config reads them by."""
    rope = kwargs.get("rope_parameters")
    if not isinstance(rope, dict):
        return kwargs
    kwargs = dict(kwargs)
    if partial is not None and "partial_rotary_factor" in rope:
        kwargs.setdefault(partial, rope["partial_rotary_factor"])
    if "rope_theta" in rope:
        kwargs.setdefault(theta, rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        kwargs.setdefault(
            "rope_scaling", {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        )
    return kwargs


# An encoder–decoder's attentions, as `uptrain convert --attention` names them, and the config.json
# field holding each one's number of KV heads.
STACK_KV_HEADS = {
    "encoder": "encoder_num_key_value_heads",
    "decoder-self": "decoder_num_key_value_heads",
    "cross": "cross_attention_num_key_value_heads",
}


class GroupedStacksConfig:
    """Mixin for the encoder–decoder GQA configs: one KV-head count per attention
    (`STACK_KV_HEADS`), each defaulting to that attention's number of query heads
    (`_stack_heads`; to the largest entry of its per-layer list where only that is given) and
    dividing it; a per-layer list (`<key>_per_layer`) is checked against that attention's layers
    (`_stack_layers`, `check_per_layer`). `num_key_value_heads` mirrors the decoder
    self-attention's scalar, the count generic tools (and static caches) read; no list mirrors
    the decoder's. Each config declares the three fields and `num_key_value_heads` itself
    (`… : int | None = None`), so that 5.x makes them dataclass fields; the lists are not declared
    (a config without them writes the keys it wrote before); 4.x's `__init__` and 5.x's
    `__post_init__` keep unknown keys as attributes."""

    def _stack_heads(self) -> dict[str, int]:
        """Query heads of each attention in STACK_KV_HEADS, in the BART family's (and Whisper's)
        config names; T5, with one `num_heads`, overrides it."""
        return {
            "encoder": self.encoder_attention_heads,
            "decoder-self": self.decoder_attention_heads,
            "cross": self.decoder_attention_heads,
        }

    def _stack_layers(self) -> dict[str, int]:
        """Layers of each attention in STACK_KV_HEADS (the cross-attention: one per decoder
        layer), in the BART family's names; T5 overrides it."""
        return {"encoder": self.encoder_layers, "decoder-self": self.decoder_layers, "cross": self.decoder_layers}

    def _grouped_stacks(self) -> None:
        if getattr(self, "decoder_num_key_value_heads", None) is None:
            self.decoder_num_key_value_heads = getattr(self, "num_key_value_heads", None)
        layers = self._stack_layers()
        for attention, heads in self._stack_heads().items():
            key = STACK_KV_HEADS[attention]
            if getattr(self, key, None) is None:
                setattr(self, key, _largest(getattr(self, key + PER_LAYER, None)) or heads)
            kv = getattr(self, key)
            if heads % kv:
                raise ValueError(f"{key} {kv} does not divide the {attention} attention's {heads} heads")
            check_per_layer(self, key, layers[attention], heads, f"{attention} attention")
        self.num_key_value_heads = self.decoder_num_key_value_heads

    if TRANSFORMERS_4:

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._grouped_stacks()
    else:

        def __post_init__(self, **kwargs):
            super().__post_init__(**kwargs)
            self._grouped_stacks()


def encoder_decoder_kv(cache, layer_idx: int, project, states: torch.Tensor, cross: bool, kwargs: dict):
    """K and V `[B, G, S, d]` of one attention layer of an encoder–decoder, through its cache.

    `project(states)` gives the layer's new K and V at G heads. A decoder self-attention adds them
    to the self-attention cache and gets every position so far; a cross-attention projects the
    encoder states once, at the first step, and reads them back from the cross-attention cache
    at every later step. transformers 4.57 and 5.x share this cache API (`EncoderDecoderCache`,
    its `is_updated` flags, `layers[i].keys`)."""
    from transformers.cache_utils import EncoderDecoderCache

    if cache is None:
        return project(states)
    both = isinstance(cache, EncoderDecoderCache)
    own = (cache.cross_attention_cache if cross else cache.self_attention_cache) if both else cache
    if cross and both and cache.is_updated.get(layer_idx, False):
        layer = own.layers[layer_idx]
        return layer.keys, layer.values
    key, value = project(states)
    # Cross-attention K/V cover the whole source at once: no position to write them at.
    key, value = own.update(key, value, layer_idx, {"cache_position": None} if cross else kwargs)
    if cross and both:
        cache.is_updated[layer_idx] = True
    return key, value


class EncoderDecoderAttention:
    """Mixin for the GQA attentions of BART, mBART, Marian, Whisper, M2M100 and Pegasus, whose
    transformers attentions are one design (`BartAttention` and its copies): put first, before the
    architecture's own attention class, which keeps its name for transformers' output recorders
    (`output_attentions`) and builds q_proj and out_proj. k_proj and v_proj get G·d rows, G the
    KV heads of this layer of this `attention` ("encoder", "decoder-self" or "cross",
    STACK_KV_HEADS; `kv_heads_of_layer`), with the biases the architecture's own have (Whisper's
    k_proj has none); both caches hold each layer's G heads.

    `queries_scaled_first`: Whisper scales the queries before the product (and attends with
    scale 1) and makes q, K, V contiguous; the others scale inside the attention. Each order is
    kept, so that G = h reproduces the architecture's logits bit for bit."""

    queries_scaled_first = False

    def __init__(self, config, attention: str, layer_idx: int):
        # All of them name their query heads alike: the encoder's, and the decoder's (self and cross).
        heads = config.encoder_attention_heads if attention == "encoder" else config.decoder_attention_heads
        super().__init__(
            embed_dim=config.d_model,
            num_heads=heads,
            dropout=config.attention_dropout,
            is_decoder=attention != "encoder",
            is_causal=attention == "decoder-self",
            config=config,
            layer_idx=layer_idx,
        )
        self.num_key_value_heads = kv_heads_of_layer(config, layer_idx, STACK_KV_HEADS[attention])
        self.num_key_value_groups = heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.k_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=self.k_proj.bias is not None)
        self.v_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=self.v_proj.bias is not None)
        # The scale the attention function applies: 1 where the queries come scaled already.
        self.attention_scaling = 1.0 if self.queries_scaled_first else self.scaling

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        # 4.57 passes a per-head mask (None unless the caller gives one; 5.x has none), refused as t5_gqa does.
        if kwargs.pop("layer_head_mask", None) is not None:
            raise ValueError("uptrain's encoder–decoder GQA modeling does not support head masks")
        cross = key_value_states is not None
        bsz, tgt_len = hidden_states.shape[:-1]
        contiguous = self.queries_scaled_first

        def heads(x: torch.Tensor) -> torch.Tensor:
            x = x.view(bsz, x.shape[1], -1, self.head_dim).transpose(1, 2)
            return x.contiguous() if contiguous else x

        def project(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return heads(self.k_proj(states)), heads(self.v_proj(states))

        q = self.q_proj(hidden_states)
        q = heads(q * self.scaling if self.queries_scaled_first else q)
        states = key_value_states if cross else hidden_states
        k, v = encoder_decoder_kv(cache, self.layer_idx, project, states, cross, kwargs)
        # Dispatched here, as transformers' attentions do: vLLM's transformers backend looks in `forward`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.attention_scaling,
            dropout=self.dropout if self.training else 0.0,
            **kwargs,
        )
        out = out.reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(out), weights


def use_encoder_decoder_attention(model, attention_class, config) -> None:
    """Replace every attention of `model` (a BART-style model with `encoder.layers` and
    `decoder.layers`, each with `self_attn`, the decoder's also with `encoder_attn`) by
    `attention_class` (an EncoderDecoderAttention) of its KV heads."""
    for i, layer in enumerate(model.encoder.layers):
        layer.self_attn = attention_class(config, "encoder", i)
    for i, layer in enumerate(model.decoder.layers):
        layer.self_attn = attention_class(config, "decoder-self", i)
        layer.encoder_attn = attention_class(config, "cross", i)


class AttentionBackends:
    """Mixin for the GQA model classes: every GQA attention's `forward` dispatches through
    transformers' attention interface (`ALL_ATTENTION_FUNCTIONS`, "eager" being
    `eager_attention_forward` below), as transformers' own attentions do, so eager, SDPA, flash,
    flex, registered kernels and engines that register their own (vLLM's transformers backend,
    which looks for that dispatch in the attention's `forward` source) all see K/V at G heads;
    `num_key_value_groups` on each attention layer tells them to share each KV head among its
    queries."""

    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True


def build_as_eager(init, model, config) -> None:
    """Run `init(config)`, the transformers class's `__init__`, with the attention implementation
    set to "eager", then check the requested one against `model`'s own flags (AttentionBackends).
    transformers' classes check it against theirs while they build (its BLOOM allows eager only,
    4.x GPT-J has no SDPA), although every attention layer they build is replaced by a GQA one
    right after, which serves each backend."""
    requested = config._attn_implementation
    config._attn_implementation_internal = "eager"
    try:
        init(config)
    finally:
        config._attn_implementation_internal = requested
    model.config._attn_implementation_internal = model._check_and_adjust_attn_implementation(
        requested, is_init_check=True
    )


# Flex attention takes a per-head bias (`position_bias`) in transformers 5; 4.x's would drop it silently.
FLEX_TAKES_BIAS = "position_bias" in inspect.signature(ALL_ATTENTION_FUNCTIONS["flex_attention"]).parameters


def refuse_backend(implementation: str | None, backends: tuple[str, ...], model_type: str, needs: str) -> None:
    """Refuse, in one line, an attention implementation outside `backends`, those with a place for
    what the model `needs` (ALiBi, a position bias): any other would run without it, and be wrong."""
    if implementation is not None and implementation not in backends:
        allowed = ", ".join(backends)
        chosen = f"attn_implementation={implementation!r}"
        raise ValueError(f"{model_type} cannot use {chosen}: {needs} needs one of {allowed}")


class EncoderDecoderGQAModel(AttentionBackends):
    """Mixin for the GQA model classes `encoder_decoder_gqa` builds: transformers' model, built,
    then each of its attentions replaced by `gqa_attention` (that architecture's
    EncoderDecoderAttention) of its KV heads. The encoder and the decoder are the base model's
    (`base_model`: the model itself, or the task model's `model`)."""

    gqa_attention = None  # set on each class

    def __init__(self, config):
        build_as_eager(super().__init__, self, config)
        use_encoder_decoder_attention(self.base_model, self.gqa_attention, config)
        self.post_init()


def encoder_decoder_gqa(
    module: str,
    config_class: type,
    attention_class: type,
    model_class: type,
    head_class: type,
    *,
    queries_scaled_first: bool = False,
    config_attributes: dict | None = None,
    head_mixins: tuple[type, ...] = (),
) -> tuple[type, type, type, type]:
    """The GQA classes (config, attention, base model, model with its task head) of an
    encoder–decoder whose transformers attention is `BartAttention`'s design (BART, mBART,
    Marian, Whisper, M2M100, Pegasus), built from transformers' own: the config with one KV-head
    count per attention (GroupedStacksConfig, `model_type` its source's + "_gqa"), and the models
    with each attention an EncoderDecoderAttention of its KV heads. Everything else is
    transformers' model unchanged.

    Each class is named as transformers' with "GQA" after the architecture's prefix
    (BartConfig → BartGQAConfig, MarianMTModel → MarianGQAMTModel) and belongs to `module`, the
    calling modeling file's `__name__`, which binds each under its name: `save_pretrained` copies
    that file and writes `module.Name` into `auto_map`, and `trust_remote_code` loads the names
    from it. What differs by architecture comes in as arguments: `queries_scaled_first`
    (EncoderDecoderAttention), class attributes of the config (`config_attributes`), and mixins
    put before the task model's transformers class (`head_mixins`)."""
    prefix = config_class.__name__.removesuffix("Config")

    def gqa_name(cls: type) -> str:
        if not cls.__name__.startswith(prefix):
            raise ValueError(f"{cls.__name__} does not begin with its architecture's name {prefix}")
        return f"{prefix}GQA{cls.__name__.removeprefix(prefix)}"

    fields = ("num_key_value_heads", *STACK_KV_HEADS.values())
    config = type(
        gqa_name(config_class),
        (GroupedStacksConfig, config_class),
        {
            "__module__": module,
            "__doc__": f"{config_class.__name__} with one number of KV heads per attention (GroupedStacksConfig).",
            "model_type": f"{config_class.model_type}_gqa",
            # Declared here, so that transformers 5 makes them dataclass fields (GroupedStacksConfig).
            "__annotations__": dict.fromkeys(fields, "int | None"),
            **dict.fromkeys(fields),
            **(config_attributes or {}),
        },
    )
    attention = type(
        gqa_name(attention_class),
        (EncoderDecoderAttention, attention_class),
        {
            "__module__": module,
            "__doc__": f"{attention_class.__name__} over the KV heads of its place (encoder, decoder self, cross).",
            "queries_scaled_first": queries_scaled_first,
        },
    )

    def gqa_model(base: type, mixins: tuple[type, ...] = ()) -> type:
        body = {
            "__module__": module,
            "__doc__": f"{base.__name__} with grouped-query attention.",
            "config_class": config,
            "gqa_attention": attention,
        }
        # transformers' class last: `uptrain.modeling.gqa_counterpart` finds it as the last base.
        return type(gqa_name(base), (*mixins, EncoderDecoderGQAModel, base), body)

    return config, attention, gqa_model(model_class), gqa_model(head_class, head_mixins)


class CausalGQAModel(AttentionBackends):
    """Mixin for the GQA model classes `causal_lm_gqa` builds: transformers' decoder-only model,
    built, its backend checked (`gqa_check_backend`), then each attention replaced by
    `gqa_use_attention` in `base_model` (the model itself, or the task model's `transformer`,
    `model`, …), or, with `gqa_base_model` set, the task model given a new base model of it."""

    gqa_use_attention = None  # staticmethods, set on each class
    gqa_check_backend = None
    gqa_base_model = None

    def __init__(self, config):
        refuse_one_count_engine(config)
        build_as_eager(super().__init__, self, config)
        if self.gqa_check_backend is not None:
            self.gqa_check_backend(self.config._attn_implementation)
        if self.gqa_base_model is not None:
            setattr(self, self.base_model_prefix, self.gqa_base_model(config))
        else:
            self.gqa_use_attention(self.base_model, config)
        self.post_init()


def causal_lm_gqa(
    module: str,
    config_class: type,
    model_class: type,
    head_class: type,
    use_gqa_attention,
    *,
    mixins: tuple[type, ...] = (),
    check_backend=None,
    model_mixins: tuple[type, ...] = (),
    head_mixins: tuple[type, ...] = (),
    new_base_model: bool = False,
) -> tuple[type, type]:
    """The GQA base model and causal-LM model (`<prefix>GQAModel`, `<prefix>GQAForCausalLM`, the
    prefix `config_class`'s name less "GQAConfig") of a decoder-only architecture, built from
    transformers' `model_class` and `head_class`: `use_gqa_attention(base_model, config)` replaces
    each attention by the GQA one. Both belong to `module`, the calling modeling file's
    `__name__`, which binds each under its name (`save_pretrained` copies that file and writes
    `module.Name` into `auto_map`). What differs by architecture comes in as arguments: mixins
    before both (`mixins`: an AttentionBackends with the architecture's backend flags) or one
    (`model_mixins`, `head_mixins`), `check_backend(implementation)` once built, and
    `new_base_model` (the task model's base a new GQA base model, for a `model_mixins` method)."""
    prefix = config_class.__name__.removesuffix("GQAConfig")

    def gqa_model(name: str, base: type, own_mixins: tuple[type, ...], body: dict) -> type:
        body = {
            "__module__": module,
            "__doc__": f"{base.__name__} with grouped-query attention.",
            "config_class": config_class,
            "gqa_use_attention": staticmethod(use_gqa_attention),
            "gqa_check_backend": None if check_backend is None else staticmethod(check_backend),
            **body,
        }
        # transformers' class last: `uptrain.modeling.gqa_counterpart` finds it as the last base.
        return type(f"{prefix}GQA{name}", (*own_mixins, *mixins, CausalGQAModel, base), body)

    model = gqa_model("Model", model_class, model_mixins, {})
    head = gqa_model("ForCausalLM", head_class, head_mixins, {"gqa_base_model": model if new_base_model else None})
    return model, head


def _bottom_right_causal(t: int, s: int, device: torch.device) -> torch.Tensor:
    """Query i (of the last t positions) sees keys 0 … s − t + i: aligned to the end, as with a cache."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def grouped_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    alibi: torch.Tensor | None = None,
    dropout: float = 0.0,
    eager: bool = False,
    divisor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of h query heads over G shared K/V heads; returns (`[B, h, T, d]`, weights or None).

    q `[B, h, T, d]`; k, v `[B, G, S, d]` with G dividing h; query head i reads KV head
    i // (h / G). `attention_mask` is boolean (True = attend) or additive, broadcastable to
    `[B, h, T, S]`; when it is given it already holds the causal pattern (transformers builds it
    so), otherwise `causal` masks keys after each query, aligned to the end of the keys (the
    last T of S positions are the queries, as after a cache). `alibi` `[B or 1, h, 1 or T, S]`
    is added to the scores before the mask. The default path is `scaled_dot_product_attention`
    with `enable_gqa` (K/V are not repeated); `eager=True` computes the softmax explicitly per
    group and also returns the weights `[B, h, T, S]`; with `divisor` it divides the scores by
    it instead of multiplying them by `scale` (Falcon's arithmetic: the two differ by an ulp).
    """
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    if h % g:
        raise ValueError(f"{h} query heads cannot be grouped over {g} KV heads")
    scale = d**-0.5 if scale is None else scale
    if attention_mask is None and causal and 1 < t < s:
        attention_mask = _bottom_right_causal(t, s, q.device)
    is_causal = attention_mask is None and causal and t > 1
    if not eager:
        if alibi is not None:
            # A float mask is the only way to add a bias inside SDPA; fold causality into it.
            if is_causal:
                attention_mask = _bottom_right_causal(t, s, q.device)
                is_causal = False
            bias = alibi.to(q.dtype)
            attention_mask = bias if attention_mask is None else bias + _as_additive(attention_mask, q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scale, is_causal=is_causal, enable_gqa=g != h
        )
        return out, None
    if is_causal:
        attention_mask = _bottom_right_causal(t, s, q.device)
    r = h // g
    if r == 1 and alibi is not None and divisor is None:
        # BLOOM's own fused alibi + scale · q kᵀ, so G = h is bit-identical to it.
        bias = alibi.expand(b, h, alibi.shape[2], s).reshape(b * h, alibi.shape[2], s)
        scores = bias.baddbmm(q.reshape(b * h, t, d), k.reshape(b * h, s, d).transpose(1, 2), alpha=scale)
        scores = scores.view(b, h, t, s)
    else:
        if r == 1:
            # The same operations as transformers' eager attention, so G = h is bit-identical to it.
            scores = torch.matmul(q, k.transpose(-1, -2))
        else:
            # [B, G, r, T, d] @ [B, G, 1, d, S]: each group's r query heads read its one K head.
            scores = torch.matmul(q.view(b, g, r, t, d), k.unsqueeze(2).transpose(-1, -2)).view(b, h, t, s)
        scores = scores * scale if divisor is None else scores / divisor
        if alibi is not None:
            scores = scores + alibi
    if attention_mask is not None:
        scores = scores + _as_additive(attention_mask, scores.dtype)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # softmax in fp32 under half precision
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    if r == 1:
        out = torch.matmul(weights, v)
    else:
        out = torch.matmul(weights.view(b, g, r, t, s), v.unsqueeze(2)).view(b, h, t, d)
    return out, weights


def alibi_as_mask(
    alibi: torch.Tensor, attention_mask: torch.Tensor | None, t: int, s: int, dtype: torch.dtype
) -> torch.Tensor:
    """ALiBi `[B, h, 1, S]` and the causal/padding mask (boolean, additive or None = causal) as
    one additive mask `[B, h, T, S]`: the form SDPA (and the interface's sdpa function, which
    passes a float mask through) adds to the scores."""
    if attention_mask is None:
        attention_mask = _bottom_right_causal(t, s, alibi.device)
    attention_mask = attention_mask[..., :s]  # 4.x's may cover the whole cache length
    return alibi.to(dtype) + _as_additive(attention_mask, dtype)


def eager_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    alibi: torch.Tensor | None = None,
    score_divisor: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The "eager" entry of transformers' attention interface for these models: the explicit,
    per-group softmax of `grouped_query_attention` (bit-identical to transformers' own eager
    attention at G = h; `score_divisor` for those that divide the scores by √d rather than
    multiply). Returns `[B, T, h, d]` and the weights, as every interface function."""
    if isinstance(attention_mask, torch.Tensor):
        # 4.x builds GPT-J's and BLOOM's masks for the whole cache length: the keys so far only.
        attention_mask = attention_mask[..., : key.shape[-2]]
    # An encoder's and a cross-attention's queries see every key: with no padding transformers
    # passes no mask, and only the layer says whether it is causal (as for its own SDPA path).
    out, weights = grouped_query_attention(
        query,
        key,
        value,
        causal=getattr(module, "is_causal", True),
        attention_mask=attention_mask,
        scale=scaling,
        alibi=alibi,
        dropout=dropout,
        eager=True,
        divisor=score_divisor,
    )
    return out.transpose(1, 2).contiguous(), weights
