"""The GQA modeling uptrain ships (`uptrain/modeling/`), as data: which model_types get it, the
classes a converted checkpoint's `auto_map` names, and the files copied beside its weights.

Data only: `uptrain convert` reads this without importing torch's modeling or transformers
(importing `uptrain.modeling` itself registers the classes with transformers, see there).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from uptrain.model_info import standard_config_names

# The package holding the modeling files; found by path so that this module need not import it.
MODELING_DIR = Path(__file__).parent / "modeling"
ATTENTION_FILE = "attention.py"


@dataclass(frozen=True)
class GQAModeling:
    """Where uptrain's modeling of one architecture lives and what its classes are called."""

    model_type: str  # of the converted checkpoint
    config_class: str
    model_class: str
    head_class: str  # the model with its task head (a causal LM, or a seq2seq model)
    auto_class: str = "AutoModelForCausalLM"  # the Auto class that loads `head_class`

    @property
    def module(self) -> str:
        """The modeling file's module name, in `uptrain/modeling/` and beside the weights alike
        (`auto_map` refers to it)."""
        return f"modeling_{self.model_type}"


# Source model_type → GQA modeling. A converted checkpoint's own model_type maps to the same
# entry, so it can be pooled further.
MODELING: dict[str, GQAModeling] = {
    "gpt2": GQAModeling("gpt2_gqa", "GPT2GQAConfig", "GPT2GQAModel", "GPT2GQAForCausalLM"),
    "gpt_neox": GQAModeling("gpt_neox_gqa", "GPTNeoXGQAConfig", "GPTNeoXGQAModel", "GPTNeoXGQAForCausalLM"),
    "opt": GQAModeling("opt_gqa", "OPTGQAConfig", "OPTGQAModel", "OPTGQAForCausalLM"),
    "gptj": GQAModeling("gptj_gqa", "GPTJGQAConfig", "GPTJGQAModel", "GPTJGQAForCausalLM"),
    "bloom": GQAModeling("bloom_gqa", "BloomGQAConfig", "BloomGQAModel", "BloomGQAForCausalLM"),
    "gpt_neo": GQAModeling("gpt_neo_gqa", "GPTNeoGQAConfig", "GPTNeoGQAModel", "GPTNeoGQAForCausalLM"),
    # Encoder–decoders: the paper's setting (T5); mT5 and T5 v1.1 / Flan-T5 share T5's classes.
    "t5": GQAModeling("t5_gqa", "T5GQAConfig", "T5GQAModel", "T5GQAForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    "bart": GQAModeling(
        "bart_gqa", "BartGQAConfig", "BartGQAModel", "BartGQAForConditionalGeneration", "AutoModelForSeq2SeqLM"
    ),
    "mbart": GQAModeling(
        "mbart_gqa", "MBartGQAConfig", "MBartGQAModel", "MBartGQAForConditionalGeneration", "AutoModelForSeq2SeqLM"
    ),
    "marian": GQAModeling(
        "marian_gqa", "MarianGQAConfig", "MarianGQAModel", "MarianGQAMTModel", "AutoModelForSeq2SeqLM"
    ),
    "whisper": GQAModeling(
        "whisper_gqa",
        "WhisperGQAConfig",
        "WhisperGQAModel",
        "WhisperGQAForConditionalGeneration",
        "AutoModelForSpeechSeq2Seq",
    ),
}
MODELING["mt5"] = MODELING["t5"]
MODELING.update({m.model_type: m for m in list(MODELING.values())})


# An encoder–decoder's attentions → the config.json key of each one's KV heads (the same table
# as `uptrain.modeling.attention.STACK_KV_HEADS`, which the modeling files beside a converted
# checkpoint carry; kept here so that conversion imports no modeling code). Absent, a key means
# that attention's query heads (MHA).
STACK_KV_HEADS: dict[str, str] = {
    "encoder": "encoder_num_key_value_heads",
    "decoder-self": "decoder_num_key_value_heads",
    "cross": "cross_attention_num_key_value_heads",
}
# What `-g G` changes of an encoder–decoder unless told otherwise: the paper's choice (§3.1),
# the decoder's self- and cross-attention, whose caches grow with generation; the encoder's K/V
# are computed once per input and never cached.
DEFAULT_ATTENTIONS = ("decoder-self", "cross")


def modeling_for(model_type: str | None) -> GQAModeling | None:
    """The GQA modeling uptrain ships for this model_type; None where transformers has native GQA."""
    return MODELING.get(model_type)


def gqa_config(config: dict, num_kv_heads: int | Mapping[str, int]) -> dict:
    """The converted checkpoint's config.json: `num_key_value_heads`, and for architectures
    without native GQA also `model_type`, `architectures` and `auto_map` naming uptrain's modeling
    (and the standard names of n_head, n_layer, n_embd where the source spells them so). Every
    other field stays as it was.

    For an encoder–decoder `num_kv_heads` maps attentions (STACK_KV_HEADS) to their KV heads
    (an int: G for DEFAULT_ATTENTIONS); each is written under its key, the others kept as the
    source has them, and `num_key_value_heads` mirrors the decoder self-attention's."""
    config = dict(config)
    if isinstance(num_kv_heads, Mapping) or config.get("is_encoder_decoder") is True:
        per_attention = (
            num_kv_heads if isinstance(num_kv_heads, Mapping) else dict.fromkeys(DEFAULT_ATTENTIONS, num_kv_heads)
        )
        for attention, kv in per_attention.items():
            config[STACK_KV_HEADS[attention]] = kv
        decoder = config.get(STACK_KV_HEADS["decoder-self"])
        if decoder is not None:
            config["num_key_value_heads"] = decoder
    else:
        config["num_key_value_heads"] = num_kv_heads
    if config.get("model_type") == "mt5":
        # mT5 never rescales the decoder's output before lm_head; T5's classes, which t5_gqa
        # builds on, do unless the config says not to.
        config["scale_decoder_outputs"] = False
    modeling = modeling_for(config.get("model_type"))
    if modeling is not None:
        # GPT-2, GPT-J and BLOOM configs spell the geometry n_head, n_layer, n_embd: add the
        # standard names too (the config class maps them to the same fields), so uptrain's
        # readers of config.json (inspect, train) understand the converted checkpoint.
        config = standard_config_names(config)
        module = modeling.module
        config.update(
            model_type=modeling.model_type,
            architectures=[modeling.head_class],
            auto_map={
                "AutoConfig": f"{module}.{modeling.config_class}",
                "AutoModel": f"{module}.{modeling.model_class}",
                modeling.auto_class: f"{module}.{modeling.head_class}",
            },
        )
    return config


def modeling_files(model_type: str | None) -> dict[str, Path]:
    """Files to save beside a converted checkpoint's weights: name there → source file.
    Empty where transformers' own modeling reads the checkpoint."""
    modeling = modeling_for(model_type)
    if modeling is None:
        return {}
    return {
        f"{modeling.module}.py": MODELING_DIR / f"{modeling.module}.py",
        ATTENTION_FILE: MODELING_DIR / ATTENTION_FILE,
    }


def copy_modeling_files(model_type: str | None, folder: Path) -> None:
    """Save the modeling files a converted checkpoint of `model_type` loads with (none where
    transformers has native GQA) into `folder`."""
    for name, path in modeling_files(model_type).items():
        shutil.copyfile(path, folder / name)
