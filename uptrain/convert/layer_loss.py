"""The measured cost of `--allocation calibrated` (`--allocation-cost loss`): per layer l and
candidate G, the model's loss on the calibration blocks with layer l alone converted to G KV heads
(every other layer kept at its source heads), minus the source model's loss on the same blocks.

This is the quantity an allocation stands for — what merging a layer costs the model, not what it
costs the layer — measured rather than estimated: at most L × (|divisors| − 1) forward passes of the
whole model over the calibration blocks (a budget's `fitting_candidates` only; G = the source's
heads merges nothing and costs 0 without one), each after converting the model in memory as the
conversion itself converts it (`in_memory.convert_model`: the same pooling, grouping, seed and
calibration). Decoder-only models whose per-layer layout uptrain can run (the Llama family, the
*_gqa families); an encoder–decoder's loss is its objective's, over pairs calibration does not
keep, so it is refused there (`kv_heads.resolved_allocation_cost`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from uptrain.model_info import divisors


def mean_loss(model, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """The model's mean next-token cross-entropy (nats per predicted token) over `blocks` (rows of
    token ids), read `batch_size` rows at a time on the model's device, summed in float64."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
            total, count = total + float(loss), count + ids[:, 1:].numel()
    return total / count


def layer_alone_costs(
    model,
    blocks: torch.Tensor,
    source_heads: Sequence[int],
    convert: Callable[..., torch.nn.Module],
    batch_size: int = 8,
    candidates: Sequence[Sequence[int]] | None = None,
) -> list[dict[int, float]]:
    """Per layer l, each candidate G (`candidates[l]`, default the divisors of `source_heads[l]`;
    a budget's `kv_heads.fitting_candidates` spares the passes of those no allocation within it
    can take) → the increase of `mean_loss` on `blocks` when layer l alone is converted to G.
    `convert(kv_heads_per_layer=…)` converts `model` as the conversion does: `in_memory.convert_model`
    with its pooling, grouping, seed and calibration bound (`functools.partial`). Can be negative:
    a merge may happen to help."""
    was_training = model.training
    model.eval()
    try:
        source = mean_loss(model, blocks, batch_size)
        costs: list[dict[int, float]] = []
        for layer, kv in enumerate(source_heads):
            costs.append({})
            for g in divisors(kv) if candidates is None else candidates[layer]:
                if g == kv:  # a group of one head per KV head: nothing merged
                    costs[layer][g] = 0.0
                    continue
                merged = convert(kv_heads_per_layer=[g if i == layer else h for i, h in enumerate(source_heads)])
                loss = mean_loss(merged.eval(), blocks, batch_size)
                del merged  # one converted copy at a time
                costs[layer][g] = loss - source if math.isfinite(loss) else math.inf
        return costs
    finally:
        model.train(was_training)
