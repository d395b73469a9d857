"""The types an architecture's record is made of (see the package docstring for how to add one)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Protocol

from uptrain import UptrainError
from uptrain.architecture.decilm import MODEL_TYPE as DECILM_MODEL_TYPE
from uptrain.architecture.decilm import check_decilm
from uptrain.model_info import (
    AttentionGeometry,
    attention_geometry,
    config_positions,
    rotary_dim,
    show,
    stack_geometry,
)

# The attentions of a model, in model order, as `uptrain convert --attention` names them → the
# config.json key of each one's KV heads in an encoder–decoder uptrain converted (the same table
# as `uptrain.modeling.attention.STACK_KV_HEADS`, which the modeling files beside a converted
# checkpoint carry; kept here too so that conversion imports no modeling code). Absent, a key
# means that attention's query heads (MHA).
STACK_KV_HEADS: dict[str, str] = {
    "encoder": "encoder_num_key_value_heads",
    "decoder-self": "decoder_num_key_value_heads",
    "cross": "cross_attention_num_key_value_heads",
}
ATTENTIONS: tuple[str, ...] = tuple(STACK_KV_HEADS)
DECODER_SELF = "decoder-self"
# What `-g G` changes unless told otherwise: the paper's choice (§3.1), the decoder's self- and
# cross-attention, whose caches grow with generation; the encoder's K/V are computed once per
# input and never cached. A decoder-only model has the first of them only.
DEFAULT_ATTENTIONS = ("decoder-self", "cross")


@dataclass(frozen=True)
class AttentionLayout:
    """Where one attention keeps its tensors. Every name is relative to one layer's attention
    module, `attn_prefix` with the layer index filled in. A K/V tensor is one of:
    - `kv_rows`: rows are `[num_kv_heads * head_dim]` (K/V weight or bias, OLMo-2's k_norm).
    - `fused_qkv` (+ `fused_qkv_bias`): one projection holding Q, K and V, ordered by
      `fused_order` along `fused_axis`:
      - "blocks": `[Q (h·d) | K (G·d) | V (G·d)]` (Phi-3 rows; GPT-2's Conv1D columns, axis 1
        of its `[in, out]` weight);
      - "per_group": `[G, r + 2, d]` with r = h / G: each KV head's r query heads, then its K,
        then its V. At G = h this is `[h, 3, d]`, the per-head interleaving of NeoX and BLOOM.
    - `per_head_kv`: one module per KV head, `{head}` filled in (StableLM's per-head k LayerNorm).
    """

    attn_prefix: str = "model.layers.{layer}.self_attn"
    # Query and output projections: rewritten only by whole-layer merges (calibrated, similarity).
    q_proj: str = "q_proj"
    o_proj: str = "o_proj"
    kv_modules: tuple[str, ...] = ("k_proj", "v_proj")
    # Row-pooled tensors inside each module ("weight", "bias" when present).
    kv_rows: tuple[str, ...] = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
    # The kv_rows every layer must have (the rest, biases and norms, are optional).
    kv_weights: tuple[str, ...] = ("k_proj.weight", "v_proj.weight")
    fused_qkv: str | None = None
    fused_qkv_bias: str | None = None
    fused_order: str = "blocks"  # or "per_group"
    fused_axis: int = 0  # 1 for a Conv1D weight, stored [in, out]
    per_head_kv: tuple[str, ...] = ()
    # GPT-2's Conv1D `c_proj`: the output projection's weight stored [in = h·d, out], so its
    # per-head columns are rows (whole-layer merges fold per-head maps into them).
    o_proj_transposed: bool = False
    # Tensors of the attention module indexed by query head along their last axis (T5's
    # relative_attention_bias: one column per query head, added to the scores). A merge leaves
    # them as they are; renumbering heads (similarity grouping) permutes their columns with the
    # layer's query heads, unless the architecture shares them across layers
    # (`Architecture.position_bias_shared`).
    query_head_tensors: tuple[str, ...] = ()
    # Other spellings of `attn_prefix` found in published checkpoints (GPT-2 and BLOOM were
    # saved without the base model's "transformer." prefix; BartModel without the task model's
    # "model."); the one the checkpoint uses is read.
    attn_prefix_alternatives: tuple[str, ...] = ()

    def attn_prefix_in(self, names) -> str:
        """The `attn_prefix` template the checkpoint with these tensor names uses."""
        for template in (self.attn_prefix, *self.attn_prefix_alternatives):
            first = template.format(layer=0) + "."
            if any(n.startswith(first) for n in names):
                return template
        return self.attn_prefix


@dataclass(frozen=True)
class Rotary:
    """How an architecture's rotary embedding rotates each head: which dims, paired how.

    Whole-layer merges read it: a per-head map folded into the queries must commute with the
    rotation on the rotated dims (complex scales per pair), and may be any map on the rest."""

    # "half": dim i pairs with i + rot/2 (transformers' rotate_half); "adjacent": 2i with 2i + 1
    # (GPT-J's rotate_every_two).
    pairs: str = "half"
    # The config field holding the rotated dims per head (GPT-J's rotary_dim; None or absent:
    # the whole head); None: head_dim × partial_rotary_factor (`model_info.rotary_dim`).
    dims_key: str | None = None
    # An older config spelling of partial_rotary_factor (GPT-NeoX 4.x: rotary_pct), read where
    # the config has no rope_parameters.
    factor_key: str | None = None
    # A config field that, true, replaces the rotary embedding by ALiBi (Falcon's `alibi`).
    off_key: str | None = None

    def dims(self, config: dict, head_dim: int) -> int:
        """Dims of each head the rotary embedding rotates in the model of `config` (0: none)."""
        if self.off_key is not None and config.get(self.off_key):
            return 0
        if self.dims_key is not None:
            return config.get(self.dims_key) or head_dim
        if self.factor_key is not None and self.factor_key in config and not config.get("rope_parameters"):
            return int(head_dim * config[self.factor_key])
        return rotary_dim(config, head_dim)


ROTATE_HALF = Rotary()


class GeometryKeys(Protocol):
    """The config keys of one attention's geometry, and how they are read."""

    kv_heads_key: str  # where config.json records this attention's KV heads

    def read(self, config: dict) -> AttentionGeometry: ...


@dataclass(frozen=True)
class StandardKeys:
    """A decoder-only model's one attention, under transformers' standard names
    (num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size, or their older
    spellings n_layer, n_head, n_embd: `model_info.attention_geometry`)."""

    # The config field that overrides hidden_size // heads; None where the modeling ignores it.
    head_dim_key: str | None = "head_dim"
    kv_heads_key: str = "num_key_value_heads"

    def read(self, config: dict) -> AttentionGeometry:
        return attention_geometry(config, self.head_dim_key)


@dataclass(frozen=True)
class StackKeys:
    """One attention of an encoder–decoder, under its architecture's own names (T5 `num_heads`,
    `d_kv`; BART `encoder_attention_heads`, …: `model_info.stack_geometry`)."""

    layers_key: str
    heads_key: str
    kv_heads_key: str
    hidden_key: str = "d_model"
    head_dim_key: str | None = None  # None: hidden // heads
    layers_fallback_key: str | None = None  # T5: num_decoder_layers, when absent, is num_layers

    def read(self, config: dict) -> AttentionGeometry:
        return stack_geometry(config, **asdict(self))  # the fields are its keywords


@dataclass(frozen=True)
class AttentionSite:
    """One attention of a model (all its layers): which one, its tensors, its geometry's keys.
    A decoder-only model has one site, "decoder-self"; an encoder–decoder three."""

    attention: str  # one of ATTENTIONS
    layout: AttentionLayout
    geometry: GeometryKeys


@dataclass(frozen=True)
class AttentionStack:
    """One attention of a model with its geometry read from a config."""

    attention: str  # one of ATTENTIONS
    layout: AttentionLayout
    geometry: AttentionGeometry


@dataclass(frozen=True)
class RefusedSetting:
    """A config setting outside what an architecture's record describes: any value of `key`
    (dotted into nested settings: MPT's `attn_config.qk_ln`) but `accepted`, read as `default`
    where the config lacks it (transformers' default). `why` says what the other values are."""

    key: str
    accepted: object
    default: object
    why: str

    def check(self, config: dict) -> None:
        """One line if `config` sets `key` to anything but `accepted`."""
        found: object = config
        for part in self.key.split("."):
            found = found.get(part, self.default) if isinstance(found, dict) else self.default
        if found != self.accepted:
            raise UptrainError(
                f"{config.get('model_type')} with {self.key}: {show(found)} cannot be converted ({self.why}); "
                f"uptrain converts {self.key}: {self.accepted!r}"
            )


@dataclass(frozen=True)
class GQAModeling:
    """uptrain's modeling of an architecture whose transformers code has no GQA
    (`uptrain/modeling/<module>.py`): the converted checkpoint's model_type and its classes."""

    model_type: str  # of the converted checkpoint: "<source>_gqa"
    config_class: str
    model_class: str
    head_class: str  # the model with its task head (a causal LM, or a seq2seq model)
    # Modules of uptrain/modeling/ the file imports besides attention.py (T5's and UMT5's share
    # t5_family), copied beside the weights with it.
    siblings: tuple[str, ...] = ()
    # The modeling file's name where it is not `modeling_<model_type>` (the DeciLM layout's
    # model_type, "nemotron-nas", is no Python module name).
    module_name: str = ""

    @property
    def module(self) -> str:
        """The modeling file's module name, in `uptrain/modeling/` and beside the weights alike
        (`auto_map` refers to it)."""
        return self.module_name or f"modeling_{self.model_type}"


class TargetPrompt(enum.Enum):
    """What a family's targets begin with, as the users' `generate()` starts them, beyond the
    decoder start token the model puts in front of its labels itself (`uptrain.objectives.prompts`
    builds each from the checkpoint and the run's keys)."""

    # Whisper: <|lang|><|task|><|notimestamps|> after <|startoftranscript|>, the ids
    # `generate(language=…, task=…)` forces, read from generation_config.json (keys `language`, `task`).
    SPEECH_TASK = "language and task tokens"
    # mBART, mBART-50, M2M100, NLLB: the tokenizer writes the language codes itself once its
    # `src_lang` / `tgt_lang` are set (keys `source_lang`, `target_lang`), the target's where
    # `forced_bos_token_id` (or mBART's decoder start) puts it.
    LANGUAGE_CODES = "language codes"
    # Multilingual Marian (opus-mt-en-ROMANCE, …): the target language is a `>>code<<` token
    # opening the source text (key `target_lang`); the targets have none.
    TARGET_CODE_IN_SOURCE = "target code in the source"


@dataclass(frozen=True)
class Architecture:
    """Everything uptrain needs to know of one `model_type`."""

    model_type: str
    name: str  # how messages name it ("BLOOM", "T5")
    sites: tuple[AttentionSite, ...]
    # uptrain's own modeling; None where transformers' has native GQA (num_key_value_heads).
    modeling: GQAModeling | None = None
    # Where transformers' modeling reads one num_key_value_heads for every layer (modeling None):
    # uptrain's modeling of an output with each layer's own KV heads, in a layout engines serve
    # (the Llama family: DeciLM / Nemotron-NAS, `decilm.py`), or None with `per_layer_refusal`
    # naming what the family's layers have that no such layout holds (Phi-3's fused qkv_proj).
    per_layer_modeling: GQAModeling | None = None
    per_layer_refusal: str = ""
    auto_class: str = "AutoModelForCausalLM"  # loads the model with its task head, source or converted
    default_objective: str = "causal"  # what `uptrain train` trains it with unless told
    pipeline_tag: str = "text-generation"  # the Hub task of the model cards
    # Config field holding the std of the architecture's weight init, which `random` pooling
    # draws fresh K/V weights with (transformers' default 0.02 when the config lacks it); where
    # the std is a factor × width^-½ (T5: initializer_factor × d_model^-½), the width's field.
    init_std_key: str = "initializer_range"
    init_std_width_key: str | None = None
    # (old, new) name prefixes renamed in the output, where transformers renames a key on
    # loading by the source's class name, which uptrain's modeling classes do not share.
    renames: tuple[tuple[str, str], ...] = ()
    # Fields the converted config.json sets (mT5 never rescales the decoder's output before
    # lm_head; T5's classes, which t5_gqa builds on, do unless the config says not to).
    converted_config: tuple[tuple[str, object], ...] = ()
    # Config settings whose model the record's layout, geometry or modeling does not describe
    # (Falcon's multi_query: one KV head, not `num_attention_heads`), each with its reason:
    # refused wherever the geometry is read (`stacks`), before anything is converted.
    refused_settings: tuple[RefusedSetting, ...] = ()
    # (alias, key): the standard names transformers' config class reads as the record's own keys
    # (its `attribute_map`: BART's num_attention_heads is encoder_attention_heads, T5's is
    # num_heads). A config.json setting both to different values is refused wherever the
    # geometry is read: uptrain would read one and transformers load the other, an output that
    # does not load.
    key_aliases: tuple[tuple[str, str], ...] = ()
    # Quirks the code acts on. ALiBi: position biases built from the 2D padding mask (BLOOM), so
    # no per-document mask can replace it. True: always; a config key: where the config sets it
    # true (Falcon's `alibi`; absent, false). ALiBi that depends on the distance to each key
    # alone (MPT's) takes the document mask and is not this quirk.
    alibi: bool | str = False
    # The `query_head_tensors` of a stack's first layer serve every layer of it (T5 computes its
    # relative position bias in block 0 and hands it on): renumbering each layer's heads
    # differently, as similarity grouping does, would need a bias per layer the modeling does not
    # have. False where each layer holding them reads its own (UMT5).
    position_bias_shared: bool = False
    # The forward builds its attention mask without `position_ids` (OPT): transformers finds no
    # packed documents there, so flash and flex attention would attend across them.
    mask_ignores_positions: bool = False
    # Its layers pass no `position_ids` on to attention (GPT-Neo): flash attention, which finds
    # packed documents from them there, would attend across them. Flex attention is unaffected:
    # its block mask is built by the forward, which has the positions.
    attention_ignores_positions: bool = False
    # Its rotary embedding (None: positions that never touch q and k — learned or sinusoidal
    # embeddings, ALiBi, T5's relative bias — so a key merge may fold any d×d map into the queries).
    rotary: Rotary | None = ROTATE_HALF
    # The config field (dotted into nested settings) of an element-wise clamp of q, k and v
    # after the projections (OLMo's clip_qkv, MPT's attn_config.clip_qkv): per-head maps folded
    # into q_proj and o_proj do not commute with it.
    clip_qkv_key: str = "clip_qkv"
    # The encoder's positions each cross-attention layer caches whole (Whisper: 1500 audio
    # frames, 30 s); None where the source length is the input's (text).
    source_positions_key: str | None = None
    source_unit: str = "source token"
    # The config field of the decoder's positions: the longest sequence a decoder-only model
    # reads (GPT-2's n_positions), the most tokens an encoder–decoder generates (Whisper's
    # max_target_positions, 448); None where it has no position table (T5's relative positions,
    # BLOOM's ALiBi). Every length uptrain chooses is clamped to it, and one asked for refused.
    target_positions_key: str | None = "max_position_embeddings"
    # The config field of the positions a text source fills (BART's max_position_embeddings, its
    # decoder's too); None where the encoder has no position table (T5) or reads a fixed number
    # of audio frames (Whisper: `source_positions_key`), and for a decoder-only model.
    source_text_positions_key: str | None = None
    # What its targets begin with beyond the decoder start (Whisper's language and task tokens,
    # mBART's and NLLB's language codes); None: the tokenizer's targets as they are.
    target_prompt: TargetPrompt | None = None
    notes: str = ""  # what makes the layout different (the encoder–decoder model card quotes it)

    @property
    def attentions(self) -> tuple[str, ...]:
        return tuple(site.attention for site in self.sites)

    @property
    def encoder_decoder(self) -> bool:
        return len(self.sites) > 1

    def rotary_dims(self, config: dict, head_dim: int) -> int:
        """Dims of each head its rotary embedding rotates in the model of `config` (0: none)."""
        return 0 if self.rotary is None else self.rotary.dims(config, head_dim)

    def clip_qkv(self, config: dict) -> object:
        """The clamp of q, k and v the model of `config` applies after the projections (None: none)."""
        found: object = config
        for part in self.clip_qkv_key.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        return found

    def target_positions(self, config: dict, label: str) -> int | None:
        """The decoder's positions in `config` (`target_positions_key`), or None where it has none."""
        return config_positions(config, self.target_positions_key, label)

    def source_positions(self, config: dict, label: str) -> int | None:
        """The positions an encoder–decoder's source fills (`source_positions_key`: fixed audio
        frames; `source_text_positions_key`: at most this many tokens), or None where it has none."""
        return config_positions(config, self.source_positions_key or self.source_text_positions_key, label)

    def site(self, attention: str) -> AttentionSite:
        return next(s for s in self.sites if s.attention == attention)

    def has_alibi(self, config: dict) -> bool:
        """Whether the model of `config` builds ALiBi biases from its 2D padding mask (`alibi`)."""
        return bool(config.get(self.alibi, False)) if isinstance(self.alibi, str) else self.alibi

    def stacks(self, config: dict) -> dict[str, AttentionStack]:
        """Every attention of the model, in model order, with its geometry read from `config`
        (one line if `config` has one of the `refused_settings`, or sets one of `key_aliases`
        and its key apart)."""
        for setting in self.refused_settings:
            setting.check(config)
        if config.get("model_type") == DECILM_MODEL_TYPE:
            check_decilm(config)  # a per-layer layout uptrain wrote, not a published Nemotron-NAS
        for alias, key in self.aliases_in(config):
            if config.get(alias) is not None and config.get(key) is not None and config[alias] != config[key]:
                raise UptrainError(
                    f"{config.get('model_type')} config sets {alias}: {show(config[alias])} and {key}: "
                    f"{show(config[key])}, which transformers reads as one setting ({key}); remove {alias} "
                    "or make them agree"
                )
        return {s.attention: AttentionStack(s.attention, s.layout, s.geometry.read(config)) for s in self.sites}

    def aliases_in(self, config: dict) -> tuple[tuple[str, str], ...]:
        """The `key_aliases` of the config class that reads `config`: a converted checkpoint's
        num_key_value_heads is its GQA config's own field (Whisper's names the encoder's heads)."""
        converted = self.modeling is not None and config.get("model_type") == self.modeling.model_type
        return tuple((a, k) for a, k in self.key_aliases if not (converted and a == "num_key_value_heads"))

    def output_name(self, name: str) -> str:
        """A tensor's name in the converted checkpoint (`renames`)."""
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def init_std(self, config: dict) -> float:
        """The std `random` pooling draws fresh K/V weights with, as the architecture's own init does."""
        if self.init_std_width_key is not None:
            return config.get(self.init_std_key, 1.0) * config[self.init_std_width_key] ** -0.5
        return config.get(self.init_std_key, 0.02)
