"""Calibrated vs uniform allocation at equal KV budgets, on the shipped reference Llama, at α = 0.

    python scripts/allocation_study.py [--budgets 0.5 0.25 0.125] [--eval-blocks 64] [--layer-alone]
        [--checkpoints DIR ...]

Calibrates the reference once (the shipped corpus' train split, the default 32,768 tokens),
prints each layer's cost per candidate G (`allocation.layer_costs`), chooses the calibrated
allocation at each budget (`allocation.allocate`) and scores it beside the uniform one on the
validation split (the demo's 64 blocks of 256 tokens): each layer merged by the calibrated merge
to its own G, its shared K/V heads then repeated back to the source's 8 (which computes exactly
what a GQA layer with G_l KV heads computes), so the transformers Llama scores any allocation.
`--layer-alone`: also the measured cost (`--allocation-cost loss`, `layer_loss.layer_alone_costs`)
— the model's loss on 16 calibration blocks with layer l alone merged to G, minus the source's —
and the allocation it chooses. `--checkpoints DIR …`: score conversions written by `uptrain
convert` (any per-layer allocation: loaded as written) on the same validation blocks.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch
from safetensors.torch import load_file

from uptrain.convert.allocation import allocate, layer_costs, layer_losses, relative_cost
from uptrain.convert.calibrated import LayerAttention, apply_calibrated, solve_calibrated
from uptrain.convert.calibration import collect_attention_moments
from uptrain.convert.conversion import Calibration
from uptrain.convert.in_memory import convert_model
from uptrain.convert.layer_loss import layer_alone_costs, mean_loss
from uptrain.data.corpus import split_path
from uptrain.data.text import load_blocks
from uptrain.loading import load_model, load_tokenizer
from uptrain.model_info import divisors

REFERENCE = "uptrain/assets/reference"


def layer_attention(state: dict, layer: int, config: dict) -> LayerAttention:
    prefix = f"model.layers.{layer}.self_attn."
    return LayerAttention(
        q_w=state[prefix + "q_proj.weight"].double(),
        k_w=state[prefix + "k_proj.weight"].double(),
        v_w=state[prefix + "v_proj.weight"].double(),
        o_w=state[prefix + "o_proj.weight"].double(),
        q_b=None,
        k_b=None,
        v_b=None,
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rotary_dim=config["head_dim"],
    )


def merged_state(state: dict, config: dict, moments, allocation: tuple[int, ...]) -> dict:
    """The source's weights with layer l merged to allocation[l] KV heads, K/V repeated back."""
    out = dict(state)
    kv, d = config["num_key_value_heads"], config["head_dim"]
    for layer, groups in enumerate(allocation):
        source = layer_attention(state, layer, config)
        merged = apply_calibrated(source, groups, solve_calibrated(source, groups, moments[layer].double()))
        prefix = f"model.layers.{layer}.self_attn."
        for name, t in (("q_proj", merged.q_w), ("o_proj", merged.o_w)):
            out[prefix + name + ".weight"] = t.float()
        for name, t in (("k_proj", merged.k_w), ("v_proj", merged.v_w)):
            rows = t.view(groups, d, -1).repeat_interleave(kv // groups, dim=0)
            out[prefix + name + ".weight"] = rows.reshape(kv * d, -1).float()
    return out


def perplexity(model, blocks: torch.Tensor) -> float:
    return math.exp(mean_loss(model, blocks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.25, 0.125])
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--layer-alone", action="store_true", help="also allocate by the loss with one layer merged")
    parser.add_argument("--checkpoints", nargs="*", default=[], help="conversions to score on the same blocks")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(REFERENCE, "the reference")
    blocks, _ = load_blocks(
        str(split_path("validation")), "eval_data", tokenizer, 256, "text", "train", None, "document", False, None
    )
    blocks = blocks.take(list(range(args.eval_blocks)))
    for folder in args.checkpoints:
        converted = load_model(folder, "a conversion", dtype=torch.float32).eval()
        heads = getattr(converted.config, "num_key_value_heads_per_layer", None) or converted.config.num_key_value_heads
        print(f"{folder}: KV heads {heads} ppl {perplexity(converted, blocks):.2f}")
    if not args.budgets and not args.layer_alone:  # `--budgets` with none: only the checkpoints
        return
    config = json.loads(open(f"{REFERENCE}/config.json").read())
    state = load_file(f"{REFERENCE}/model.safetensors")
    moments, _ = collect_attention_moments(REFERENCE, str(split_path("train")), progress=False)
    layers, kv, d = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    losses = [layer_losses(layer_attention(state, i, config), moments[i].double()) for i in range(layers)]
    costs = [layer_costs(layer_attention(state, i, config), moments[i].double()) for i in range(layers)]
    print("layer | " + " | ".join(f"G={g}: cost (values, keys share)" for g in divisors(kv)))
    for i, loss in enumerate(losses):
        cells = [
            f"{relative_cost(x):.4f} ({x.values / x.values_energy:.4f}, {x.keys / x.keys_energy:.4f})"
            for x in loss.values()
        ]
        print(f"{i} | " + " | ".join(cells))
    model = load_model(REFERENCE, "the reference", dtype=torch.float32).eval()
    print(f"MHA: ppl {perplexity(model, blocks):.2f}")
    allocators = {"calibrated": costs}
    if args.layer_alone:
        train, _ = load_blocks(
            str(split_path("train")), "calibration", tokenizer, 256, "text", "train", None, "document", False, None
        )
        calibration = train.take(list(range(16)))
        convert = functools.partial(convert_model, model, pooling="calibrated", calibration=Calibration(moments))
        alone = layer_alone_costs(model, calibration, (kv,) * layers, convert)
        for i, layer in enumerate(alone):
            print(f"layer {i} alone, Δ log ppl: " + ", ".join(f"G={g}: {c:.4f}" for g, c in layer.items()))
        allocators["layer-alone"] = alone
    for fraction in args.budgets:
        rows = [
            (name, allocate({"s": table}, {"s": (kv,) * layers}, {"s": d}, fraction)["s"])
            for name, table in allocators.items()
        ]
        uniform = round(fraction * kv)
        if uniform >= 1 and kv % uniform == 0 and math.isclose(uniform / kv, fraction):
            rows.insert(0, ("uniform", (uniform,) * layers))
        for name, allocation in rows:
            model.load_state_dict(merged_state(state, config, moments, allocation), strict=False)
            print(f"budget {fraction}: {name} {allocation} ppl {perplexity(model, blocks):.2f}")


if __name__ == "__main__":
    main()
