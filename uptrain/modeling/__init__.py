"""GQA modeling for architectures whose transformers code has no `num_key_value_heads`.

Each architecture is one module here (gpt2.py, gpt_neox.py, …) built on transformers' own
classes; `attention.py` holds the one grouped-query attention they share. A converted
checkpoint of such an architecture gets its own `model_type` (e.g. "gpt2_gqa"), an
`auto_map`, and a copy of its modeling file and attention.py beside the weights, so it loads:
- after `import uptrain`, with `AutoModelForCausalLM.from_pretrained` (see `auto_hook`), and
- without uptrain installed, with `trust_remote_code=True`.

This module is data and file names only, imported by `import uptrain` (through
`auto_hook`): it imports neither torch nor transformers, nor even dataclasses (9 ms).
"""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
ATTENTION_FILE = "attention.py"


class GQAModeling:
    """Where uptrain's modeling of one architecture lives and what its classes are called."""

    __slots__ = ("module", "model_type", "config_class", "model_class", "causal_lm_class")

    def __init__(self, module: str, model_type: str, config_class: str, model_class: str, causal_lm_class: str):
        self.module = module  # file in uptrain/modeling, without .py
        self.model_type = model_type  # of the converted checkpoint
        self.config_class, self.model_class, self.causal_lm_class = config_class, model_class, causal_lm_class

    @property
    def remote_module(self) -> str:
        """The modeling file's name beside the weights (`auto_map` refers to it)."""
        return f"modeling_{self.model_type}"


# Source model_type → GQA modeling. A converted checkpoint's own model_type maps to the same
# entry, so it can be pooled further.
MODELING: dict[str, GQAModeling] = {
    "gpt2": GQAModeling("gpt2", "gpt2_gqa", "GPT2GQAConfig", "GPT2GQAModel", "GPT2GQAForCausalLM"),
    "gpt_neox": GQAModeling("gpt_neox", "gpt_neox_gqa", "GPTNeoXGQAConfig", "GPTNeoXGQAModel",
                            "GPTNeoXGQAForCausalLM"),
    "opt": GQAModeling("opt", "opt_gqa", "OPTGQAConfig", "OPTGQAModel", "OPTGQAForCausalLM"),
    "gptj": GQAModeling("gptj", "gptj_gqa", "GPTJGQAConfig", "GPTJGQAModel", "GPTJGQAForCausalLM"),
    "bloom": GQAModeling("bloom", "bloom_gqa", "BloomGQAConfig", "BloomGQAModel", "BloomGQAForCausalLM"),
}
MODELING.update({m.model_type: m for m in list(MODELING.values())})


def modeling_for(model_type: str | None) -> GQAModeling | None:
    """The GQA modeling uptrain ships for this model_type; None where transformers has native GQA."""
    return MODELING.get(model_type)


def gqa_config(config: dict, num_kv_heads: int) -> dict:
    """The converted checkpoint's config.json: `num_key_value_heads`, and for architectures
    without native GQA also `model_type`, `architectures` and `auto_map` naming uptrain's modeling
    (and the standard names of n_head, n_layer, n_embd where the source spells them so). Every
    other field stays as it was."""
    config = dict(config, num_key_value_heads=num_kv_heads)
    modeling = modeling_for(config.get("model_type"))
    if modeling is not None:
        # GPT-2, GPT-J and BLOOM configs spell the geometry n_head, n_layer, n_embd: add the
        # standard names too (the config class maps them to the same fields), so uptrain's
        # readers of config.json (inspect, train) understand the converted checkpoint.
        from uptrain.convert.layouts import standard_config_names

        config = standard_config_names(config)
        remote = modeling.remote_module
        config.update(model_type=modeling.model_type, architectures=[modeling.causal_lm_class], auto_map={
            "AutoConfig": f"{remote}.{modeling.config_class}",
            "AutoModel": f"{remote}.{modeling.model_class}",
            "AutoModelForCausalLM": f"{remote}.{modeling.causal_lm_class}",
        })
    return config


def modeling_files(model_type: str | None) -> dict:
    """Files to save beside a converted checkpoint's weights: name there → source file (a Path).
    Empty where transformers' own modeling reads the checkpoint."""
    from pathlib import Path

    modeling = modeling_for(model_type)
    if modeling is None:
        return {}
    here = Path(HERE)
    return {f"{modeling.remote_module}.py": here / f"{modeling.module}.py", ATTENTION_FILE: here / ATTENTION_FILE}


def register() -> None:
    """Register every GQA architecture with transformers' Auto classes (imports transformers)."""
    import importlib

    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for model_type, modeling in MODELING.items():
        if model_type != modeling.model_type:
            continue
        module = importlib.import_module(f"uptrain.modeling.{modeling.module}")
        config_class = getattr(module, modeling.config_class)
        AutoConfig.register(modeling.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, getattr(module, modeling.model_class), exist_ok=True)
        AutoModelForCausalLM.register(config_class, getattr(module, modeling.causal_lm_class), exist_ok=True)


def copy_modeling_files(model_type: str | None, folder) -> None:
    """Save the modeling files a converted checkpoint of `model_type` loads with (none where
    transformers has native GQA) into `folder`."""
    import shutil

    for name, path in modeling_files(model_type).items():
        shutil.copyfile(path, folder / name)


def gqa_counterpart(model, num_kv_heads: int):
    """`(model class, config)` for a copy of transformers model `model` with `num_kv_heads` KV
    heads: its own class where transformers has native GQA, uptrain's GQA class (same task
    head) for gpt2, gpt_neox, opt, gptj and bloom. Imports transformers."""
    import copy

    modeling = modeling_for(model.config.model_type)
    if modeling is None:
        config = copy.deepcopy(model.config)
        config.num_key_value_heads = num_kv_heads
        return type(model), config
    import importlib

    module = importlib.import_module(f"uptrain.modeling.{modeling.module}")
    config_class = getattr(module, modeling.config_class)
    config = config_class.from_dict(gqa_config(model.config.to_dict(), num_kv_heads))
    causal_lm = getattr(module, modeling.causal_lm_class)
    base = getattr(module, modeling.model_class)
    # The task head decides the class: a causal LM stays a causal LM, a base model a base model.
    # The transformers class each GQA class extends is its last base (after uptrain's mixin).
    return (causal_lm if isinstance(model, causal_lm.__bases__[-1]) else base), config
