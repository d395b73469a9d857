"""The files of a converted checkpoint besides its weights: config.json, tokenizer and
generation files, licence files, provenance (`uptrain.json`) and the model card (`README.md`).

Provenance is a chain: a converted checkpoint's `uptrain.json` records the conversion; the
`final/` of `uptrain train` records the uptraining and embeds the `uptrain.json` of the
checkpoint it started from (see `uptrain.train.final`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import uptrain
from uptrain.architecture import DECODER_SELF, Architecture, AttentionLayout, architecture
from uptrain.architecture.converted import copy_modeling_files, gqa_config
from uptrain.checkpoint.card import front_matter
from uptrain.checkpoint.source import ResolvedSource, portable
from uptrain.convert.grouping import kv_groups, query_to_kv
from uptrain.convert.plan import ATTENTION_NAMES, ConversionPlan
from uptrain.convert.pooling import STRATEGIES, MergeCard, Strategy, WholeLayerStrategy
from uptrain.model_info import AttentionGeometry

# Files besides the weights that make the output a usable checkpoint, and the licence terms
# the source was published under (they bind the converted model too).
SIDE_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.spm",  # Marian's source/target sentencepiece models
    "preprocessor_config.json",  # Whisper's feature extractor
    "processor_config.json",
    "normalizer.json",  # Whisper's English text normaliser
    "chat_template.*",
    "generation_config.json",
    "LICENSE*",
    "LICENCE*",
    "USE_POLICY*",
    "NOTICE*",
)


def write_config(src: Path, dst: Path, config: dict, num_kv_heads: int | Mapping[str, int], dtype: str | None) -> dict:
    """config.json of the output, returned: the source's, with `num_key_value_heads` (and the
    dtype when cast) edited in place; an encoder–decoder's KV heads per attention, a per-layer
    Llama's layout (`gqa_config`)."""
    # Edit the JSON itself, not a transformers config object: every other field stays as it was.
    config = set_dtype(gqa_config(config, num_kv_heads), dtype)  # + model_type/auto_map for gpt2_gqa, …
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def copy_side_files(src: Path, dst: Path, config: dict) -> None:
    """Tokenizer, generation and licence files of `src`, byte for byte; the modeling files the
    output's `config` (as written) loads with; a generation_config.json made of the config's
    special token ids when `src` has none."""
    for pattern in SIDE_FILE_PATTERNS:
        for path in src.glob(pattern):
            if path.is_file() and not (dst / path.name).exists():
                shutil.copy2(path, dst / path.name)
    copy_modeling_files(config.get("model_type"), dst)  # gpt2_gqa's, …, nemotron-nas's (none for llama, …)
    if not (dst / "generation_config.json").exists():
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        (dst / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")


def groups_used(
    source_kv_heads: int | tuple[int, ...],
    num_kv_heads: int | tuple[int, ...],
    kv_orders: dict[int, list[int]] | None = None,
) -> list[list[int]] | dict[str, list[list[int]]]:
    """Source KV heads merged into each new KV head: one list of groups (contiguous grouping, one G),
    or per layer when `similarity` grouping renumbered the heads (`kv_orders`: layer → source
    KV heads in their new order, consecutive runs of which form the groups) or the layers' KV
    heads differ (tuples: each layer's, source and output)."""
    if not kv_orders and isinstance(source_kv_heads, int) and isinstance(num_kv_heads, int):
        return kv_groups(source_kv_heads, num_kv_heads)
    tuples = [h for h in (num_kv_heads, source_kv_heads) if isinstance(h, tuple)]
    layers = len(tuples[0]) if tuples else max(kv_orders) + 1
    sources = _each_layer(source_kv_heads, layers)
    targets = _each_layer(num_kv_heads, layers)

    def groups(layer: int) -> list[list[int]]:
        order, r = kv_orders.get(layer) if kv_orders else None, sources[layer] // targets[layer]
        if order is None:
            return kv_groups(sources[layer], targets[layer])
        return [order[j * r : (j + 1) * r] for j in range(targets[layer])]

    return {str(layer): groups(layer) for layer in (sorted(kv_orders) if kv_orders else range(layers))}


def _each_layer(kv_heads: int | tuple[int, ...], layers: int) -> tuple[int, ...]:
    return kv_heads if isinstance(kv_heads, tuple) else (kv_heads,) * layers


def heads_record(geo: AttentionGeometry, kv_heads: int | tuple[int, ...], kv_orders: dict | None) -> dict:
    """One attention's KV heads, groups and query → KV map in `uptrain.json`: one G as always; where
    the output's (or the source's) layers differ, the largest under `num_key_value_heads` (as
    config.json's key), each layer's under `…_per_layer`, and the groups and map per layer."""
    source = geo.layer_kv_heads() if geo.kv_heads_per_layer is not None else geo.num_kv_heads
    record = {"source_num_key_value_heads": geo.num_kv_heads}
    if isinstance(source, tuple):
        record["source_num_key_value_heads_per_layer"] = list(source)
    if isinstance(kv_heads, int):
        return record | {
            "num_key_value_heads": kv_heads,
            "kv_groups": groups_used(source, kv_heads, kv_orders),
            "query_to_kv": query_to_kv(geo.num_heads, kv_heads),
        }
    return record | {
        "num_key_value_heads": max(kv_heads),
        "num_key_value_heads_per_layer": list(kv_heads),
        "kv_groups": groups_used(source, kv_heads, kv_orders),
        "query_to_kv": {str(layer): query_to_kv(geo.num_heads, g) for layer, g in enumerate(kv_heads)},
    }


def source_record(source: ResolvedSource, source_files: dict[str, dict]) -> dict:
    """The head of every conversion's `uptrain.json`: which uptrain, when, and from what (the
    source named portably, its Hub revision and base model where known, its files' digests)."""
    return {
        "uptrain_version": uptrain.__version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": source.name,
        "source_revision": source.revision,
        "base_model": source.base_model,
        "source_files": source_files,
    }


def set_dtype(config: dict, dtype: str | None) -> dict:
    """`config` (a config.json dict, edited in place) naming `dtype` under the key it already uses."""
    if dtype is not None:
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = dtype
    return config


def provenance(
    source: ResolvedSource,
    source_files: dict[str, dict],
    strategy: Strategy,
    seed: int,
    plan: ConversionPlan,
    dtype: str | None,
    grouping: str = "contiguous",
    kv_orders: dict | None = None,
    calibration: dict | None = None,
    budget: dict | None = None,
) -> dict:
    """The `uptrain.json` record of a conversion: where from (with the Hub commit), how, and the
    groups actually merged. The source is named portably (`ResolvedSource.name`: its Hub id, else
    its folder's name), with `base_model` the Hub id it derives from where one is known.

    `kv_orders` (similarity grouping): layer → source KV heads in their new order; an
    encoder–decoder's per attention renumbered (`SiteMergers.kv_orders`). `budget`: how a
    `--kv-budget` was spent (`kv_budget`, `allocation`, and what chose it), recorded as given."""
    geo = plan.geometry
    site_orders: dict[str, dict[int, list[int]]] = {}
    if plan.encoder_decoder:  # the top-level fields are the decoder self-attention's
        site_orders, kv_orders = kv_orders or {}, (kv_orders or {}).get(DECODER_SELF)
    record = {
        **source_record(source, source_files),
        "model_type": geo.model_type,
        "pooling": strategy.name,
        "pooling_reference": strategy.reference,
        "grouping": grouping,
        "seed": seed,
        "dtype": dtype,
        "num_attention_heads": geo.num_heads,
        # The decoder self-attention's (an encoder–decoder's too, as config.json's
        # num_key_value_heads): the cache that grows with each generated token.
        **heads_record(geo, plan.kv_heads_after()[DECODER_SELF], kv_orders),
    }
    if budget is not None:
        record.update(budget)
    if plan.encoder_decoder:
        # Each attention's heads beside the top-level keys (the decoder self-attention's).
        after = plan.kv_heads_after()
        record.update(
            attention=list(plan.attention),
            attentions={
                name: _attention_record(stack.geometry, after[name], site_orders.get(name))
                for name, stack in plan.stacks.items()
            },
        )
    if kv_orders:
        record["kv_head_order"] = {str(k): v for k, v in sorted(kv_orders.items())}
    if calibration:
        # The calibration text as the user named it, each local path by its name (a comma joins several).
        data = calibration.get("data")
        named = ", ".join(portable(part) for part in data.split(", ")) if isinstance(data, str) else data
        record["calibration"] = {**calibration, "data": named}
    return record


def _attention_record(
    geo: AttentionGeometry, kv_heads: int | tuple[int, ...], kv_orders: dict[int, list[int]] | None
) -> dict:
    """One attention's heads and groups in an encoder–decoder's record (`kv_orders`: as `groups_used`'s)."""
    record = {
        "num_layers": geo.num_layers,
        "num_attention_heads": geo.num_heads,
        "head_dim": geo.head_dim,
        **heads_record(geo, kv_heads, kv_orders),
    }
    if kv_orders:
        record["kv_head_order"] = {str(k): v for k, v in sorted(kv_orders.items())}
    return record


def _names(names) -> str:
    """`a`, `a` and `b`, `a`, `b` and `c`: each name once, in order."""
    quoted = [f"`{n}`" for n in dict.fromkeys(names)]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _kv_heads_phrase(a: dict) -> str:
    """'4 KV heads', or 'each layer's own KV heads (8, 4, 4, 2, layer 0 first)' where the layers differ."""
    per_layer = a.get("num_key_value_heads_per_layer")
    if per_layer is None:
        return f"{a['num_key_value_heads']} KV heads"
    return f"each layer's own KV heads ({', '.join(map(str, per_layer))}, layer 0 first)"


def _per_layer_groups_text(a: dict, renumbered: bool, where: str) -> str:
    """How each layer's heads were grouped when the layers' KV heads differ (G_l: layer l's);
    `where` names the record's fields in `uptrain.json`."""
    h, kv = a["num_attention_heads"], a["source_num_key_value_heads"]
    kv = "its source KV heads" if "source_num_key_value_heads_per_layer" in a else f"its {kv} source KV heads"
    similar = "renumbered so that KV heads reading similar input directions share a group, then " if renumbered else ""
    after = "after renumbering, " if renumbered else ""
    return (
        f"in layer l with G_l KV heads, {similar}each {'' if renumbered else 'contiguous '}group of {kv} / G_l "
        f"became one; {after}query head i reads KV head i // ({h} / G_l) (groups and map per layer: "
        f"{where} in `uptrain.json`)"
    )


def _per_layer_layout_text(p: dict, arch) -> str:
    """How a per-layer output of a family transformers reads natively (Llama: the DeciLM layout) loads
    and serves: uptrain's modeling beside the weights, the engines' remote-code switch."""
    if "num_key_value_heads_per_layer" not in p or arch.per_layer_modeling is None:
        return ""
    return (
        " Its layers differ in KV heads, so it is written in the DeciLM / Nemotron-NAS layout "
        "(`model_type` `nemotron-nas`, `block_configs`): load it with `import uptrain.modeling` or with "
        "`trust_remote_code=True` (the modeling files are beside the weights); serve it with "
        "`vllm serve FOLDER --trust-remote-code`."
    )


def _budget_text(p: dict) -> str:
    """What chose the heads, when a `--kv-budget` did."""
    if p.get("kv_budget") is None:
        return ""
    text = f" The KV heads spend `--kv-budget {p['kv_budget']:g}` (`--allocation {p['allocation']}`)."
    if p.get("cross_kv_weight") is not None:
        text += (
            f" In that budget a cross-attention KV head weighs {p['cross_kv_weight']:g} self-attention heads"
            f" (`--cross-kv-weight {p['cross_kv_weight']:g}`: the source positions its cache holds per generated"
            " token)."
        )
    if p.get("allocation_forced"):
        text += (
            " The budget leaves one allocation (one KV head in every layer), so it was taken as it is:"
            " no costs were measured."
        )
    elif "allocation_costs" in p and p.get("allocation_cost") == "loss":
        text += (
            " Each layer's heads were chosen by the model's loss on the calibration blocks with that layer alone"
            " converted to each candidate G, minus the source's (`--allocation-cost loss`), the allocation of least"
            " summed cost within the budget; the costs are `allocation_costs` in `uptrain.json`."
        )
    elif "allocation_costs" in p:
        text += (
            f" Each layer's heads were chosen by what {_priced(p)} of that layer to each candidate G loses on"
            " the calibration data (its share of the attention's value output and logits, weighted as the"
            " calibrated merge weighs them), the allocation of least summed cost within the budget; the costs are"
            " `allocation_costs` in `uptrain.json`."
        )
    return text


def _priced(p: dict) -> str:
    """The pooling a `merge` cost priced, as the card names it: the conversion's own
    (`allocation_cost_pooling`); a record from before that key priced the calibrated merge."""
    pooling = p.get("allocation_cost_pooling", "calibrated")
    return "the calibrated merge" if pooling == "calibrated" else f"`{pooling}` pooling"


def _allocation_costs_table(p: dict) -> str:
    """A calibrated allocation's cost table (per attention and layer, each candidate G's cost), as
    the card shows it; nothing without one."""
    costs = p.get("allocation_costs")
    if not costs:
        return ""
    candidates = sorted({int(g) for layers in costs.values() for layer in layers for g in layer})
    rows = [
        f"| {ATTENTION_NAMES[name]} | {index} | "
        + " | ".join(f"{layer[str(g)]:.4g}" if str(g) in layer else "" for g in candidates)
        + " |"
        for name, layers in costs.items()
        for index, layer in enumerate(layers)
    ]
    head = "| attention | layer | " + " | ".join(f"G = {g}" for g in candidates) + " |"
    rule = "|---|---:|" + "---:|" * len(candidates)
    what = (
        "The model's loss (nats per token) with each layer alone converted to G KV heads, minus the source's"
        if p.get("allocation_cost") == "loss"
        else f"What {_priced(p)} of each layer to G KV heads loses"
    )
    return (
        f"\n\n{what} (the cost `--allocation calibrated` minimised, summed over the layers; a G that no "
        "allocation within the budget can give a layer is not measured):\n\n"
    ) + "\n".join([head, rule, *rows])


def _grouping_text(p: dict, layout: AttentionLayout) -> str:
    h, kv, g = p["num_attention_heads"], p["source_num_key_value_heads"], p["num_key_value_heads"]
    if "num_key_value_heads_per_layer" in p:
        text = _per_layer_groups_text(p, p.get("grouping") == "similarity", "`kv_groups`, `query_to_kv`")
        return text[0].upper() + text[1:] + "."
    if p.get("grouping", "contiguous") == "similarity":
        return (
            f"Heads were first renumbered in each layer (query rows and biases, K/V rows and `{layout.o_proj}` "
            f"columns permuted together, which leaves the model's function unchanged) so that KV heads whose "
            f"projections read similar input directions share a group; then each group of {kv // g} KV heads "
            f"became one. The groups differ per layer: `kv_groups` in `uptrain.json` lists, per layer, the "
            f"source KV heads merged into each new KV head. After renumbering, query head i reads KV head "
            f"i // {h // g}."
        )
    return (
        f"Each contiguous group of {kv // g} source KV heads became one (groups: {p['kv_groups']}); "
        f"query head i reads KV head i // {h // g}."
    )


def _pooling_text(p: dict, arch: Architecture) -> str:
    """What the strategy did, naming the tensors each layer's attention really has (`layout`):
    separate K and V projections, or the K and V parts of a fused Q|K|V projection."""
    layout = arch.site(DECODER_SELF).layout
    cast = "" if p.get("dtype") is None else f" (cast to {p['dtype']})"
    renumbered = p.get("grouping") == "similarity"
    moved = " except for the renumbering of heads" if renumbered else ""
    q, o = layout.q_proj, layout.o_proj
    merge = _merge_strategy(p)
    if merge is not None:
        rewritten = f"{_names([q, *layout.kv_modules])} (weights and biases)"
        data = _calibration_data_text(p)
        moments = "the second moment of each layer's attention input was kept"
        return merge.card_text(MergeCard(arch, q, o, rewritten, data, moments, "every layer", cast))
    how = {
        "mean": "each group's K and V heads (weights, biases and per-head key norms) are averaged",
        "first": "each group keeps the K and V heads (weights, biases and key norms) of its first head",
        "random": f"the K and V heads are freshly initialised (normal(0, {_random_init_text(arch)}) "
        "weights, zero biases)",
    }.get(p["pooling"], f"K and V heads are pooled by `{p['pooling']}`")
    if layout.fused_qkv is not None:  # Q, K and V in one tensor: only its K and V parts change
        fused = layout.fused_qkv.removesuffix(".weight")
        where = (
            f"In each layer's fused `{fused}` (Q, K and V in one tensor) only the K and V parts are rewritten; "
            f"its Q part keeps its values, and `{o}` and every other tensor are copied unchanged"
        )
    else:
        where = (
            f"{_names(layout.kv_modules)} of every layer are rewritten; `{q}`, `{o}` and every other tensor are "
            "copied unchanged"
        )
    return f"`{p['pooling']}` pooling: {how}. {where}{moved}{cast}."


def _merge_strategy(p: dict) -> WholeLayerStrategy | None:
    """The whole-layer strategy of a conversion (it says what it rewrote), or None for row pooling."""
    strategy = STRATEGIES.get(p["pooling"])
    return strategy if isinstance(strategy, WholeLayerStrategy) else None


def _calibration_data_text(p: dict) -> str:
    calibration = p.get("calibration") or {}
    if calibration.get("tokens"):
        return f"{calibration['tokens']:,} tokens of `{calibration.get('data')}`"
    return "calibration text"


def _renames_text(arch: Architecture) -> str:
    """Tensors stored under another name than the source's (values unchanged)."""
    return "".join(
        f" `{old.rstrip('.')}` is stored as `{new.rstrip('.')}`, the name uptrain's modeling reads; its "
        "values are unchanged."
        for old, new in arch.renames
    )


def _random_init_text(arch: Architecture) -> str:
    if arch.init_std_width_key is not None:
        return (
            f"`{arch.init_std_key}` × `{arch.init_std_width_key}`^-½ of config.json, as the "
            "architecture initialises K and V"
        )
    return f"`{arch.init_std_key}` of config.json"


def _encoder_decoder_text(p: dict, arch: Architecture) -> str:
    """What a conversion did to each attention of an encoder–decoder, naming its tensors."""
    cast = "" if p.get("dtype") is None else f" (cast to {p['dtype']})"
    attentions, chosen = p["attentions"], p["attention"]
    renumbered = p.get("grouping") == "similarity"
    shown = attentions["decoder-self" if "decoder-self" in chosen else chosen[0]]
    per_layer = any("num_key_value_heads_per_layer" in attentions[name] for name in chosen)
    lines = []
    for name in chosen:
        a = attentions[name]
        h, kv, new = a["num_attention_heads"], a["source_num_key_value_heads"], a["num_key_value_heads"]
        site = arch.site(name).layout
        modules = ",".join(site.kv_modules)
        if "num_key_value_heads_per_layer" in a:
            lines.append(
                f"- {ATTENTION_NAMES[name]} ({a['num_layers']} layers, {h} query heads, head_dim {a['head_dim']}): "
                f"{kv} → {_kv_heads_phrase(a)}; "
                f"{_per_layer_groups_text(a, renumbered, f'`attentions.{name}.kv_groups`, `.query_to_kv`')}. "
                f"Rewritten: `{site.attn_prefix.format(layer='{i}')}.{{{modules}}}`."
            )
            continue
        groups = (
            f"in each layer its heads were renumbered so that KV heads reading similar input directions share "
            f"a group, then each group of {kv // new} source KV heads became one (groups per layer: "
            f"`attentions.{name}.kv_groups` in `uptrain.json`); after renumbering"
            if renumbered
            else f"each contiguous group of {kv // new} source KV heads became one (groups: {a['kv_groups']});"
        )
        lines.append(
            f"- {ATTENTION_NAMES[name]} ({a['num_layers']} layers, {h} query heads, head_dim {a['head_dim']}): "
            f"{kv} → {new} KV heads; {groups} query head i reads KV head i // {h // new}. Rewritten: "
            f"`{site.attn_prefix.format(layer='{i}')}.{{{modules}}}`."
        )
    kept = [n for n in attentions if n not in chosen]
    for name in kept:
        lines.append(
            f"- {ATTENTION_NAMES[name]}: unchanged, {attentions[name]['num_key_value_heads']} KV heads "
            f"(`uptrain convert --attention` chooses which attentions are pooled)."
        )
    site = arch.site(chosen[0]).layout
    # Renumbering moves whole query heads: q and o rows/columns, and a per-layer position bias's columns.
    moved = (
        f" except for the renumbering of heads (`{site.q_proj}` rows, `{site.o_proj}` columns"
        + (", the columns of a layer's own relative position bias where it has one" if site.query_head_tensors else "")
        + ")"
        if renumbered
        else ""
    )
    parts = "weights and biases" if any(rel.endswith(".bias") for rel in site.kv_rows) else "weights"
    how = {
        "mean": f"each group's K and V heads ({parts}) are averaged",
        "first": f"each group keeps the K and V heads ({parts}) of its first head",
        "random": f"the K and V heads are freshly initialised (normal(0, {_random_init_text(arch)}) weights"
        + (", zero biases)" if parts != "weights" else ")"),
    }.get(p["pooling"], f"K and V heads are pooled by `{p['pooling']}`")
    q, o = site.q_proj, site.o_proj
    done = f"`{p['pooling']}` pooling: {how}. `{q}`, `{o}` and every other tensor are copied unchanged{moved}{cast}."
    merge = _merge_strategy(p)
    if merge is not None:
        moments = (
            "the second moment of each pooled attention's own inputs was kept (cross-attention: its queries' the "
            "decoder's states, its keys' and values' the encoder's output)"
        )
        if (p.get("calibration") or {}).get("weighting") == "attention":
            moments += (
                "; the decoder's self- and cross-attention were solved from attention-weighted moments instead "
                "(each key's error weighed by the attention its position receives, each value's by the "
                "attention-pooled inputs the output reads)"
            )
        if (p.get("calibration") or {}).get("value_fit") == "output":
            moments += (
                "; a second pass over the same calibration batches, the merged queries and keys in place, refit "
                "each merged layer's shared values and per-head output maps to its heads' attention output "
                f"(`--value-fit output`, blend {p['calibration'].get('value_fit_blend')})"
            )
        rewritten = f"`{q}` and the K and V projections ({parts})"
        data = _calibration_data_text(p)
        done = merge.card_text(MergeCard(arch, q, o, rewritten, data, moments, "each pooled attention", cast))
    heads = "per-layer KV heads" if per_layer else f"{shown['num_key_value_heads']} KV heads"
    return (
        f"Grouped-query attention with {heads} in the "
        + " and the ".join(ATTENTION_NAMES[n] for n in chosen)
        + ":\n\n"
        + "\n".join(lines)
        + f"\n\n{done}{_budget_text(p)} Layout: {arch.notes}."
        + _allocation_costs_table(p)
    )


def model_card(p: dict, source_card: dict | None = None) -> str:
    """README.md of a converted checkpoint: Hub metadata and what the conversion did."""
    arch = architecture(p["model_type"])
    base = p.get("base_model")
    if base is not None and base == p["source"]:
        source = f"`{p['source']}`"
    else:  # a local folder, named by its folder name, and the Hub model it derives from where known
        source = f"the local folder `{p['source']}`"
        if base:
            source += f" (derived from {_names([base] if isinstance(base, str) else base)})"
    source += f" (revision `{p['source_revision']}`)" if p.get("source_revision") else ""
    heads = "per-layer" if "num_key_value_heads_per_layer" in p else p["num_key_value_heads"]
    if arch.encoder_decoder and any("num_key_value_heads_per_layer" in p["attentions"][n] for n in p["attention"]):
        heads = "per-layer"  # the decoder's self-attention may be uniform while the cross-attention is not
    if arch.encoder_decoder:
        body = f"""# {p["model_type"]} with {heads} KV heads in its decoder (converted by uptrain)

Converted from {source}, an encoder–decoder.

{_encoder_decoder_text(p, arch)} Strategy: {p["pooling_reference"]}. Seed {p["seed"]}.

The weights have not been trained since conversion: uptrain them (`uptrain train`) before use.
`uptrain.json` records the source files' digests, the groups of each attention and the uptrain version \
({p["uptrain_version"]}).
"""
        tags = [p["model_type"], "encoder-decoder"]
        return front_matter(base, source_card or {}, tags, arch.pipeline_tag) + "\n" + body
    body = f"""# {p["model_type"]} with {heads} KV heads (converted by uptrain)

Converted from {source} ({p["num_attention_heads"]} query heads, {p["source_num_key_value_heads"]} KV heads) \
to grouped-query attention with {_kv_heads_phrase(p)}.{_budget_text(p)}{_per_layer_layout_text(p, arch)}\
{_allocation_costs_table(p)}

{_grouping_text(p, arch.site(DECODER_SELF).layout)}

{_pooling_text(p, arch)}{_renames_text(arch)} Strategy: {p["pooling_reference"]}. Seed {p["seed"]}.

The weights have not been trained since conversion: uptrain them (`uptrain train`) before use.
`uptrain.json` records the source files' digests, the groups and the uptrain version ({p["uptrain_version"]}).
"""
    return front_matter(base, source_card or {}, [p["model_type"]], arch.pipeline_tag) + "\n" + body
