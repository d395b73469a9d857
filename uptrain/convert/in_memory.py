"""`convert_model`: the conversion of a model already in memory (a notebook's `PreTrainedModel`).

The same plan and the same pooling code as `uptrain convert`, reading tensors from the model's
state dict instead of safetensors shards; the result is a new model of the same class whose
config has `num_key_value_heads = G`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, DEFAULT_ATTENTIONS, architecture
from uptrain.convert.layer_merge import LayerMerger, check_no_clamp
from uptrain.convert.pipeline import Calibration
from uptrain.convert.plan import ConversionPlan, choose_attentions, plan_conversion
from uptrain.convert.pooling import get_strategy
from uptrain.convert.spec import ConversionOptions
from uptrain.convert.stream import compute_tensor
from uptrain.model_info import rotary_dim
from uptrain.modeling import gqa_counterpart
from uptrain.options import validated


@dataclass(frozen=True)
class _Header:
    """What the planner reads of a tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class StateDictSource:
    """A state dict seen through the interface the planner and `LayerMerger` read
    (`tensors`, `order()`, `read_tensor`): tensors stay where they are until pooled."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.tensors = {name: _Header(name, t.dtype, tuple(t.shape)) for name, t in state.items()}
        self.files: list[Path] = []
        self.metadata: dict = {}

    def order(self) -> list[_Header]:
        return list(self.tensors.values())

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.state[name].detach().cpu()


def converted_tensors(
    model,
    num_kv_heads: int,
    pooling: str = "mean",
    *,
    grouping: str = "contiguous",
    attention: str = ",".join(DEFAULT_ATTENTIONS),
    seed: int = 0,
    calibration: Calibration | None = None,
) -> tuple[dict[str, torch.Tensor], ConversionPlan]:
    """The state dict of `model` converted to `num_kv_heads` KV heads (tensors not rewritten are
    the model's own, not copies), and the plan it follows. `convert_model` builds the model."""
    options = validated(ConversionOptions, pooling=pooling, grouping=grouping, attention=attention)
    strategy = get_strategy(options.pooling)
    config = model.config.to_dict()
    arch = architecture(config.get("model_type"))
    stacks, chosen = choose_attentions(config, arch, options.attention, num_kv_heads)
    geometry = stacks[DECODER_SELF].geometry
    if strategy.whole_layer and calibration is None:
        raise UptrainError(f"pooling {pooling!r} needs calibration statistics (calibration=Calibration(...))")
    check_no_clamp(strategy, config)
    state = model.state_dict()
    source = StateDictSource(state)
    plan = plan_conversion(source, arch, stacks, chosen, num_kv_heads, None, strategy, options.grouping)
    init_std = arch.init_std(config)
    merger = LayerMerger(
        source,
        plan.stacks[DECODER_SELF].layout,  # whole-layer merges: decoder-only models only
        geometry,
        num_kv_heads,
        strategy,
        options.grouping,
        rotary_dim(config, geometry.head_dim),
        calibration.moments if calibration else None,
        seed,
        init_std,
        progress=False,
    )
    converted = {}
    for t in plan.tensors:
        name = t.out.name
        if t.kind == "copy":
            converted[name] = state[name]
        else:
            converted[name] = compute_tensor(t, source, plan, strategy, seed, init_std, merger).to(state[name].device)
    return converted, plan


def convert_model(
    model,
    num_kv_heads: int,
    pooling: str = "mean",
    *,
    grouping: str = "contiguous",
    attention: str = ",".join(DEFAULT_ATTENTIONS),
    seed: int = 0,
    calibration: Calibration | None = None,
):
    """A copy of `model` (a transformers `PreTrainedModel`) with `num_kv_heads` KV heads.

    Pools exactly as `uptrain convert` does (same plan, same strategies, same seeds per tensor
    name), so the weights equal those of a checkpoint converted from `model.save_pretrained`.
    `attention`: for an encoder–decoder, the attentions pooled (as `--attention`).
    `calibrated` pooling needs `calibration` (see `uptrain.convert.calibration`). The original
    model is left untouched; the copy keeps its dtype, device and train/eval mode.
    """
    converted, plan = converted_tensors(
        model, num_kv_heads, pooling, grouping=grouping, attention=attention, seed=seed, calibration=calibration
    )
    # The same class where transformers has native GQA; uptrain's GQA class for GPT-2, NeoX, T5, ….
    new_class, new_config = gqa_counterpart(model, plan.config_kv_heads)
    with torch.device("meta"):
        new = new_class(new_config)
    new.load_state_dict(converted, assign=True)
    # Buffers outside the state dict (rotary tables) do not depend on the KV heads: share them.
    old_buffers = dict(model.named_buffers())
    for name, buffer in list(new.named_buffers()):
        if buffer.is_meta:
            module_name, _, attr = name.rpartition(".")
            new.get_submodule(module_name).register_buffer(attr, old_buffers[name].clone(), persistent=False)
    new.tie_weights()
    new.generation_config = copy.deepcopy(model.generation_config)
    return new.train(model.training)
