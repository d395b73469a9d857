"""What each architecture is, as data looked up by `model_type`: one record per model_type.

Imports nothing from torch or transformers (`uptrain convert` reads it without them). Every
reader of an architecture — conversion, uptrain's modeling registration, train, speed, inspect,
budgets — asks here (`architecture`, `find_architecture`); nothing else names a model_type.

A record (`Architecture`) holds:
- `sites`: its attentions, each an `AttentionSite` — which attention ("decoder-self",
  "encoder", "cross"), its tensors (`AttentionLayout`: prefix with `{layer}`, K/V rows, fused
  Q|K|V, per-head norms) and the config keys of its geometry (`StandardKeys` for a
  decoder-only model's one attention, `StackKeys` for an encoder–decoder's three). Code
  iterates the sites: a decoder-only model is the one-site case.
- `modeling`: uptrain's GQA modeling (`GQAModeling`: the converted `<model_type>_gqa` and its
  class names in `uptrain/modeling/modeling_<model_type>_gqa.py`), or None where transformers'
  own modeling reads `num_key_value_heads` (llama, mistral, …);
- `auto_class`, `default_objective`, `pipeline_tag`: how it loads, trains and is tagged;
- its init std (`init_std_key`, `init_std_width_key`), output `renames`, `converted_config`;
- quirks the code acts on (`alibi`, always or where a config key turns it on;
  `mask_ignores_positions`, `attention_ignores_positions`) and what it refuses
  (`refused_settings`: config settings outside what the record describes,
  each with its reason, refused wherever the geometry is read; `key_aliases`: the standard
  names its transformers config class reads as its own keys, its `attribute_map`, refused
  where a config sets one apart from its key), and an encoder–decoder's
  `source_positions_key` / `source_unit`, and what its targets begin with (`target_prompt`:
  Whisper's language and task tokens, mBART's and NLLB's language codes);
- its positions, as config fields: `target_positions_key` (a decoder-only model's, or an
  encoder–decoder decoder's: GPT-2's n_positions, MPT's max_seq_len, None for none) and
  `source_text_positions_key` (a text encoder's); every length uptrain chooses (calibration
  blocks, evaluate's and speed's defaults) is clamped to them and a longer one asked for refused
  (`block_positions`, `Architecture.target_positions` / `source_positions`);
- what whole-layer merges (`calibrated`) must commute with: its rotary embedding (`rotary`, a
  `Rotary`: which dims rotate and how they pair; None where positions never touch q and k, so
  any per-head key map folds into the queries) and where its config keeps a clamp of q, k and v
  (`clip_qkv_key`). The layout says where Q, K, V and O live (separate, fused, Conv1D) and which
  tensors belong to the query heads (`query_head_tensors`: T5's relative bias).

To add an architecture:
1. Add one record to `decoders.py` (`decoder_only(model_type, name, layout, ...)`, with
   `geometry=StackKeys(...)` where the config does not use transformers' standard names, e.g.
   n_layers / n_heads / d_model) or to `encoder_decoders.py` (`bart_family(...)`, or sites of its
   own as T5's), naming its tensors relative to the checkpoint's root and the config keys of its
   heads and layers (each site's KV heads under `STACK_KV_HEADS`, as uptrain's modeling reads them).
2. If its transformers modeling has no `num_key_value_heads`, it needs uptrain's: write
   `uptrain/modeling/modeling_<model_type>_gqa.py` (loadable alone beside the weights: it imports
   only torch, transformers and `.attention`, or sibling modules it lists in `GQAModeling.siblings`,
   as T5's and UMT5's `.t5_family`) and name its classes in `modeling=GQAModeling(...)`
   (a decoder-only record: `decoders.uptrain_modeled(model_type, name, class_prefix, layout, ...)`,
   its classes under a causal LM's usual names). `uptrain.modeling` imports that module
   and registers the classes from the record: no edit there. Otherwise leave `modeling` None.
3. Name its positions' config field where it is not max_position_embeddings
   (`target_positions_key`; an encoder–decoder's text source: `source_text_positions_key`).
   Set the quirks and refusals that hold (ALiBi, a mask built without position ids, layers
   that pass none to attention, settings the modeling does not compute, its rotary embedding),
   and `default_objective` / `auto_class` / `pipeline_tag` for an encoder–decoder. Tests: a tiny
   model from its config, converted exactly (tests/convert).
A converted checkpoint's `<model_type>_gqa` finds its source's record (`source_model_type`), so
it can be pooled further.
"""

from __future__ import annotations

from uptrain import UptrainError
from uptrain.architecture.decoders import DECODERS
from uptrain.architecture.encoder_decoders import ENCODER_DECODERS
from uptrain.architecture.schema import (
    ATTENTIONS,
    DECODER_SELF,
    DEFAULT_ATTENTIONS,
    STACK_KV_HEADS,
    Architecture,
    AttentionLayout,
    AttentionSite,
    AttentionStack,
    GQAModeling,
    RefusedSetting,
    Rotary,
    StackKeys,
    StandardKeys,
    TargetPrompt,
)
from uptrain.model_info import AttentionGeometry, attention_geometry, config_positions

__all__ = [
    "ATTENTIONS",
    "DECODER_SELF",
    "DEFAULT_ATTENTIONS",
    "STACK_KV_HEADS",
    "Architecture",
    "AttentionLayout",
    "AttentionSite",
    "AttentionStack",
    "GQAModeling",
    "RefusedSetting",
    "Rotary",
    "StackKeys",
    "StandardKeys",
    "TargetPrompt",
    "architecture",
    "auto_class_name",
    "block_positions",
    "config_geometry",
    "converted_architectures",
    "find_architecture",
    "modeling_of",
    "source_model_type",
    "supported_model_types",
]

# Source model_type → its record.
REGISTRY: dict[str, Architecture] = {a.model_type: a for a in (*DECODERS, *ENCODER_DECODERS)}


def _converted() -> dict[str, Architecture]:
    """A converted checkpoint's model_type → the record of the first source that converts to it
    (t5_gqa: t5's, which mt5 shares; nemotron-nas, the per-layer layout: llama's)."""
    found: dict[str, Architecture] = {}
    for record in REGISTRY.values():
        for modeling in (record.modeling, record.per_layer_modeling):
            if modeling is not None:
                found.setdefault(modeling.model_type, record)
    return found


CONVERTED = _converted()


def source_model_type(model_type: str | None) -> str | None:
    """The model_type a converted `*_gqa` checkpoint was converted from (t5_gqa → t5); any other
    model_type is its own source."""
    record = CONVERTED.get(model_type)
    return model_type if record is None else record.model_type


def find_architecture(model_type: str | None) -> Architecture | None:
    """The record of a model_type, source or converted (gpt2_gqa reads as gpt2); None if unknown."""
    return REGISTRY.get(source_model_type(model_type))


# A model uptrain trains or measures but has no record of: its positions under the names
# transformers' configs use.
STANDARD_POSITIONS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def block_positions(config: dict, label: str) -> tuple[int | None, str | None]:
    """(the positions a block of `seq_len` tokens fills, the config key holding them): a
    decoder-only model's, an encoder–decoder's text source's (None: no limit — T5's relative
    positions, Whisper's audio), as the model's record names them; without a record, the first
    of `STANDARD_POSITIONS` the config sets."""
    arch = find_architecture(config.get("model_type"))
    if arch is None:
        key = next((k for k in STANDARD_POSITIONS if k in config), None)
    else:
        key = arch.source_text_positions_key if arch.encoder_decoder else arch.target_positions_key
    return config_positions(config, key, label), key


def supported_model_types() -> list[str]:
    """Every model_type uptrain converts: the sources and their converted `*_gqa` types."""
    return sorted([*REGISTRY, *CONVERTED])


def architecture(model_type: str | None) -> Architecture:
    """The record of a model_type; one line naming the supported ones if there is none."""
    record = find_architecture(model_type)
    if record is None:
        raise UptrainError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}")
    return record


def converted_architectures() -> dict[str, Architecture]:
    """Each model_type of uptrain's GQA modeling (gpt2_gqa, t5_gqa, …, nemotron-nas) → its source's record."""
    return dict(CONVERTED)


def modeling_of(model_type: str | None) -> GQAModeling | None:
    """uptrain's modeling that reads checkpoints of `model_type` (gpt2_gqa's, or the per-layer
    layout's, nemotron-nas: `GQAModeling`); None for a source type or one transformers reads."""
    record = CONVERTED.get(model_type)
    if record is None:
        return None
    return next(m for m in (record.modeling, record.per_layer_modeling) if m is not None and m.model_type == model_type)


def auto_class_name(config: dict) -> str:
    """The transformers Auto class that loads a checkpoint with its task head: its record's, else
    by what the config says it is (an encoder–decoder: AutoModelForSeq2SeqLM)."""
    record = find_architecture(config.get("model_type"))
    if record is not None:
        return record.auto_class
    return "AutoModelForSeq2SeqLM" if config.get("is_encoder_decoder") else "AutoModelForCausalLM"


def config_geometry(config: dict) -> AttentionGeometry:
    """The geometry of the attention whose cache grows with each generated token: a decoder-only
    model's one, an encoder–decoder's decoder self-attention. A model_type without a record is
    read with transformers' standard names (and its `head_dim`)."""
    record = find_architecture(config.get("model_type"))
    if record is None:
        return attention_geometry(config)
    return record.stacks(config)[DECODER_SELF].geometry
