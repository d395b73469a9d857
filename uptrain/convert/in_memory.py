"""`convert_model`: the conversion of a model already in memory (a notebook's `PreTrainedModel`).

The same orchestration as `uptrain convert` (`uptrain.convert.conversion`: the same checks, plan
and tensor computations), reading tensors from the model's state dict instead of safetensors
shards and putting them in a new model of the same class, whose config has
`num_key_value_heads = G`, instead of a shard writer.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, DEFAULT_ATTENTIONS
from uptrain.convert.conversion import Calibration, conversion_for
from uptrain.convert.kv_heads import KVHeadsRequest, allocation_cost_problem, resolved_allocation_cost
from uptrain.convert.plan import ConversionPlan
from uptrain.convert.pooling import get_strategy
from uptrain.convert.spec import ConversionOptions, KVHeadsKeys, kv_heads_per_layer_text
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
    num_kv_heads: int | KVHeadsRequest,
    options: ConversionOptions | None = None,
    seed: int = 0,
    calibration: Calibration | None = None,
    allocation_cost: str | None = None,
    calibration_blocks: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], ConversionPlan]:
    """The state dict of `model` converted to `num_kv_heads` KV heads (one G, or a request with
    per-layer lists or a budget: `kv_heads.KVHeadsRequest`; tensors not rewritten are
    the model's own, not copies), and the plan it follows. `options`: the validated pooling,
    grouping and attention (default: mean, contiguous, the decoder's); `convert_model` takes
    them as keywords and builds the model. A calibrated allocation minimises `allocation_cost`
    (`kv_heads.resolved_allocation_cost`); `loss` is measured on `calibration_blocks` (token ids)."""
    options = options or validated(ConversionOptions)
    strategy = get_strategy(options.pooling)
    if strategy.needs_calibration and calibration is None:
        raise UptrainError(f"pooling {options.pooling!r} needs calibration statistics (calibration=Calibration(...))")
    conversion = conversion_for(
        model.config.to_dict(), num_kv_heads, strategy, options.grouping, options.attention, seed
    )
    state = model.state_dict()
    source = StateDictSource(state)
    if isinstance(num_kv_heads, KVHeadsRequest) and num_kv_heads.needs_calibration:  # even if the budget forces it
        resolved_allocation_cost(allocation_cost, conversion.arch.encoder_decoder)  # refuses 'loss' there
    if conversion.pending_budget is not None:  # allocation "calibrated": chosen by its cost
        from uptrain.convert.allocation import budget_candidates, settle_allocation

        costs = None
        if resolved_allocation_cost(allocation_cost, conversion.arch.encoder_decoder) == "loss":
            if calibration_blocks is None:
                raise UptrainError(
                    "allocation cost 'loss' measures the model's loss on calibration blocks "
                    "(calibration_blocks=token ids, or allocation_cost='merge')"
                )
            from uptrain.convert.layer_loss import layer_alone_costs

            heads = conversion.stacks[DECODER_SELF].geometry.layer_kv_heads()
            convert = functools.partial(
                convert_model,
                model,
                pooling=options.pooling,
                grouping=options.grouping,
                seed=seed,
                calibration=calibration,
            )
            candidates = budget_candidates(conversion)[DECODER_SELF]
            costs = {DECODER_SELF: layer_alone_costs(model, calibration_blocks, heads, convert, candidates=candidates)}
        elif calibration is None or not calibration.moments:
            raise UptrainError(
                "allocation 'calibrated' measures each layer's merge on calibration moments "
                "(calibration=Calibration(moments), moments kept whole)"
            )
        moments = calibration.moments if calibration is not None else {}
        conversion, _ = settle_allocation(conversion, source, moments, costs=costs)  # planned for it
    else:
        conversion = conversion.planned(source)
    merger = conversion.merger(source, calibration, progress=False)
    converted = {}
    for t in conversion.plan.tensors:
        name = t.out.name
        if t.kind == "copy":
            converted[name] = state[name]
        else:
            converted[name] = conversion.compute(t, source, merger).to(state[name].device)
    return converted, conversion.plan


def convert_model(
    model,
    num_kv_heads: int | None = None,
    pooling: str = "mean",
    *,
    kv_heads_per_layer: str | Sequence[int] | Sequence[Sequence[int]] | None = None,
    kv_budget: float | None = None,
    allocation: str = "uniform",
    allocation_cost: str | None = None,
    cross_kv_weight: float | None = None,
    calibration_blocks: torch.Tensor | None = None,
    grouping: str = "contiguous",
    attention: str = ",".join(DEFAULT_ATTENTIONS),
    seed: int = 0,
    calibration: Calibration | None = None,
):
    """A copy of `model` (a transformers `PreTrainedModel`) with `num_kv_heads` KV heads, or, instead,
    each layer's KV heads `kv_heads_per_layer` ("8,4,4,2", [8, 4, 4, 2], or one list per converted
    attention of an encoder–decoder), or a `kv_budget` spent by `allocation` (as `uptrain convert`).

    Pools exactly as `uptrain convert` does (same plan, same strategies, same seeds per tensor
    name), so the weights equal those of a checkpoint converted from `model.save_pretrained`.
    `attention`: for an encoder–decoder, the attentions pooled (as `--attention`).
    `calibrated` pooling needs `calibration` (see `uptrain.convert.calibration`); a calibrated
    allocation minimises `allocation_cost` (as `--allocation-cost`; `loss`, the default for
    decoder-only models, is measured on `calibration_blocks`, rows of token ids); `cross_kv_weight`
    weighs an encoder–decoder's cross-attention heads in the budget (as `--cross-kv-weight`). The original
    model is left untouched; the copy keeps its dtype, device and train/eval mode.
    """
    options = validated(ConversionOptions, pooling=pooling, grouping=grouping, attention=attention)
    keys = validated(
        KVHeadsKeys,
        num_kv_heads=num_kv_heads,
        kv_heads_per_layer=kv_heads_per_layer_text(kv_heads_per_layer),  # a list as the flag spells it
        kv_budget=kv_budget,
        allocation=allocation,
        allocation_cost=allocation_cost,
        cross_kv_weight=cross_kv_weight,
    )
    if problem := allocation_cost_problem(keys.allocation, keys.allocation_cost):
        raise UptrainError(problem)
    request = KVHeadsRequest.of(
        keys.num_kv_heads, keys.kv_heads_per_layer, keys.kv_budget, keys.allocation, keys.cross_kv_weight
    )
    converted, plan = converted_tensors(
        model, request, options, seed, calibration, keys.allocation_cost, calibration_blocks
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
