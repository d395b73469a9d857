"""`uptrain inspect`: a checkpoint's attention layout and what each G would save in KV cache.

An encoder–decoder caches two things while it generates: its decoder self-attention's K/V, one
entry per generated token, and its cross-attention's K/V of the encoder's output, one entry per
source token (Whisper: per audio frame, 1500 of them whatever the audio's length), computed once.
Both are reported at every G that `uptrain convert -g G` (its default `--attention`, the
decoder's two) can give; the encoder's own K/V are never cached. Its decoder generates at most
its positions (Whisper: 448): the default context is clamped to them, and a larger `--context`
is refused.

A checkpoint whose layers have KV heads of their own (`--kv-heads-per-layer`, `--kv-budget`) shows
each layer's, and its cache is their sum layer by layer; the G rows are what one G for every layer
would give instead (a G dividing every layer's KV heads).

A checkpoint converted by uptrain (or uptrained from one) also shows how its KV heads were
grouped, from its `uptrain.json`: the groups, and under `similarity` grouping each layer's
renumbering of the heads (`kv_head_order`), per attention for an encoder–decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from uptrain import UptrainError
from uptrain.architecture import DECODER_SELF, Architecture, config_geometry, deepseek_v2, find_architecture
from uptrain.checkpoint.provenance import PROVENANCE, conversion_record, read_provenance
from uptrain.checkpoint.reader import SourceCheckpoint
from uptrain.checkpoint.source import resolve_source
from uptrain.inspect_latent import format_latent, latent_report
from uptrain.model_info import DTYPE_BYTES, config_dtype, divisors, read_config, show
from uptrain.options import Schema, option

TP_DEGREES = (2, 4, 8)
DEFAULT_CONTEXT = 4096


@dataclass(kw_only=True)
class InspectOptions(Schema):
    """`uptrain inspect`."""

    src: str = option(positional=True, help="checkpoint folder or Hub id")
    context: int | None = option(
        None,
        help=f"tokens per sequence (default {DEFAULT_CONTEXT}; an encoder–decoder's at most its decoder's "
        "positions, e.g. Whisper's 448)",
    )
    batch: int = option(1, help="sequences")
    dtype: str | None = option(None, help="cache dtype (default: the checkpoint's dtype)")
    json: bool = option(False, help="machine-readable output")


def inspect_checkpoint(src: str, context: int | None = None, batch: int = 1, dtype: str | None = None) -> dict:
    """The report of `uptrain inspect` as a dict (the --json output); `context` None: the default,
    clamped to an encoder–decoder's decoder positions."""
    for name, value in (("--context", context), ("--batch", batch)):
        if value is not None and value < 1:
            raise UptrainError(f"{name} must be at least 1 (got {value})")
    resolved = resolve_source(src)
    folder, label = resolved.folder, resolved.label
    config = read_config(folder)
    model_type = config.get("model_type")
    arch = find_architecture(model_type)
    geo = config_geometry(config)
    dtype = dtype or config_dtype(config)
    if dtype not in DTYPE_BYTES:
        raise UptrainError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    dtype_bytes = DTYPE_BYTES[dtype]
    try:
        weights = SourceCheckpoint(folder)
        parameters = sum(math.prod(t.shape) for t in weights.tensors.values())
        weights.close()
    except UptrainError:  # pickle-only or weightless folders: the layout is still worth showing
        parameters = None
    if model_type == deepseek_v2.MODEL_TYPE:  # the latent and the shared rotary key, not K/V heads
        context = DEFAULT_CONTEXT if context is None else context
        run = {"parameters": parameters, "dtype": dtype, "context": context, "batch": batch}
        return {"source": label, "model_type": model_type, **latent_report(config, dtype_bytes, context, batch), **run}
    grouping = conversion_grouping(folder)
    if arch is not None and arch.encoder_decoder:
        given, (context, limit) = context, _decoder_context(config, arch, context, label)
        report = _encoder_decoder_report(config, arch, dtype_bytes, context, batch)
        run = {"parameters": parameters, "dtype": dtype, "context": context, "batch": batch}
        clamped = given is None and context != DEFAULT_CONTEXT
        return {
            "source": label,
            "model_type": model_type,
            **report,
            **run,
            "decoder_positions": limit,
            "context_clamped": clamped,  # the default context, cut to the decoder's positions
            "conversion": grouping,
        }
    context = DEFAULT_CONTEXT if context is None else context
    current = geo.kv_cache_bytes_per_token(dtype_bytes)
    options = []
    for g in geo.valid_num_kv_heads():
        per_token = geo.kv_cache_bytes_per_token(dtype_bytes, g)
        options.append(
            {
                "num_kv_heads": g,
                "group_size": geo.num_heads // g,
                "kv_cache_bytes_per_token": per_token,
                "kv_cache_bytes": per_token * context * batch,
                "saving": 1 - per_token / current,
                "tensor_parallel_degrees": [tp for tp in TP_DEGREES if g % tp == 0],
            }
        )
    return {
        "source": label,
        "model_type": model_type,
        "encoder_decoder": False,
        "convertible": arch is not None,
        "num_layers": geo.num_layers,
        "num_attention_heads": geo.num_heads,
        "num_key_value_heads": geo.num_kv_heads,
        **_per_layer(geo),
        "head_dim": geo.head_dim,
        "hidden_size": geo.hidden_size,
        "parameters": parameters,
        "dtype": dtype,
        "context": context,
        "batch": batch,
        "kv_cache_bytes_per_token": current,
        "kv_cache_bytes": current * context * batch,
        "options": options,
        "conversion": grouping,
    }


def conversion_grouping(folder) -> dict | None:
    """How uptrain grouped the KV heads of the checkpoint in `folder` (of the conversion its chain
    starts from), from its `uptrain.json`; None for a checkpoint uptrain did not convert.

    `kv_groups`: the source KV heads merged into each new one (per layer under `similarity`
    grouping); `kv_head_order`: layer → source KV heads in their new order (similarity only). An
    encoder–decoder's are per attention, under `attentions`. A value of another shape is one
    UptrainError: the file is not one uptrain wrote."""
    record = conversion_record(read_provenance(folder))
    if record is None:
        return None
    where = f"{folder}/{PROVENANCE}"
    out = {
        "pooling": record["pooling"],
        "grouping": record.get("grouping", "contiguous"),
        "source_num_key_value_heads": record["source_num_key_value_heads"],
        **_groups(record, where),
        **_budget(record, where),
    }
    attentions = record.get("attentions")
    if attentions is not None:
        if not isinstance(attentions, dict) or not all(isinstance(a, dict) for a in attentions.values()):
            raise UptrainError(
                f"{where}: `attentions` is not a mapping of attentions; it is not a record uptrain wrote"
            )
        out["attentions"] = {name: _groups(a, f"{where}: attentions.{name}") for name, a in attentions.items()}
    return out


def _budget(record: dict, where: str) -> dict:
    """`kv_budget` and `allocation` where a `--kv-budget` chose the KV heads, checked; `allocation_costs`
    (the calibrated allocation's table) is named, not shown: it is long and `uptrain.json` holds it."""
    if "kv_budget" not in record:
        return {}
    budget, allocation = record["kv_budget"], record.get("allocation")
    if not isinstance(budget, int | float) or isinstance(budget, bool) or not 0 < budget <= 1:
        raise UptrainError(f"{where}: `kv_budget` is {show(budget)}, not a fraction in (0, 1]")
    if not isinstance(allocation, str):
        raise UptrainError(f"{where}: `allocation` is {show(allocation)}, not a name")
    forced = record.get("allocation_forced", False)
    if not isinstance(forced, bool):
        raise UptrainError(f"{where}: `allocation_forced` is {show(forced)}, not true or false")
    weight = record.get("cross_kv_weight")
    if weight is not None and (
        not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight < math.inf
    ):
        raise UptrainError(f"{where}: `cross_kv_weight` is {show(weight)}, not a positive number")
    return {
        "kv_budget": budget,
        "allocation": allocation,
        "allocation_costs": "allocation_costs" in record,
        "allocation_cost": record.get("allocation_cost"),
        # The pooling the costs priced; a record from before this key priced `merge` for the calibrated
        # merge and `loss` for the conversion's own pooling.
        "allocation_cost_pooling": record.get(
            "allocation_cost_pooling", "calibrated" if record.get("allocation_cost") == "merge" else record["pooling"]
        ),
        "allocation_forced": forced,
        "cross_kv_weight": weight,  # None: every head alike, as before the option
    }


def _groups(record: dict, where: str) -> dict:
    """`kv_groups` and, where there is one, `kv_head_order` of one attention's record, checked."""

    def heads(value) -> bool:
        return isinstance(value, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in value)

    groups, order = record.get("kv_groups"), record.get("kv_head_order")
    per_layer = isinstance(groups, dict) and all(
        isinstance(v, list) and all(heads(g) for g in v) for v in groups.values()
    )
    if not (per_layer or (isinstance(groups, list) and all(heads(g) for g in groups))):
        raise UptrainError(f"{where}: `kv_groups` is not a list of KV head groups; it is not a record uptrain wrote")
    if order is not None and not (isinstance(order, dict) and all(heads(v) for v in order.values())):
        raise UptrainError(
            f"{where}: `kv_head_order` is not a mapping of layers to head orders; it is not a record uptrain wrote"
        )
    return {"kv_groups": groups} | ({} if order is None else {"kv_head_order": order})


def _decoder_context(config: dict, arch: Architecture, context: int | None, label: str) -> tuple[int, int | None]:
    """(the context an encoder–decoder's report is for, its decoder's positions or None): the
    default clamped to the positions, a larger `--context` refused in one line."""
    key = arch.target_positions_key
    limit = config.get(key) if key else None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return (DEFAULT_CONTEXT if context is None else context), None
    if context is None:
        return min(DEFAULT_CONTEXT, limit), limit
    if context > limit:
        raise UptrainError(
            f"--context {context} is beyond the decoder's {limit} positions ({key} of {label}): it generates at most "
            f"{limit} tokens; give --context {limit} or less"
        )
    return context, limit


def _encoder_decoder_report(config: dict, arch: Architecture, dtype_bytes: int, context: int, batch: int) -> dict:
    """The caches of an encoder–decoder generating `context` tokens for `batch` inputs, each
    input `source_positions` long: Whisper's fixed number of audio frames, else `context` tokens."""
    stacks = arch.stacks(config)
    decoder, cross = stacks[DECODER_SELF].geometry, stacks["cross"].geometry
    source = config.get(arch.source_positions_key) if arch.source_positions_key else None
    source_len = source if isinstance(source, int) and not isinstance(source, bool) and source > 0 else context

    def caches(g_self: int | None, g_cross: int | None) -> dict:
        per_token = decoder.kv_cache_bytes_per_token(dtype_bytes, g_self)
        per_source = cross.kv_cache_bytes_per_token(dtype_bytes, g_cross)
        return {
            "kv_cache_bytes_per_token": per_token,
            "cross_kv_cache_bytes_per_source_token": per_source,
            "kv_cache_bytes": (per_token * context + per_source * source_len) * batch,
        }

    current = caches(None, None)  # each layer's own KV heads, summed
    options = []
    # `-g G` pools both decoder attentions: G divides the KV heads of each (every layer's).
    for g in divisors(math.gcd(*decoder.layer_kv_heads(), *cross.layer_kv_heads())):
        at_g = caches(g, g)
        options.append(
            {
                "num_kv_heads": g,
                "group_size": decoder.num_heads // g,
                **at_g,
                "saving": 1 - at_g["kv_cache_bytes"] / current["kv_cache_bytes"],
                "tensor_parallel_degrees": [tp for tp in TP_DEGREES if g % tp == 0],
            }
        )
    return {
        "encoder_decoder": True,
        "convertible": True,
        "num_layers": decoder.num_layers,
        "num_attention_heads": decoder.num_heads,
        "num_key_value_heads": decoder.num_kv_heads,
        **_per_layer(decoder),
        "head_dim": decoder.head_dim,
        "hidden_size": decoder.hidden_size,
        "attentions": {
            name: {
                "num_layers": stack.geometry.num_layers,
                "num_attention_heads": stack.geometry.num_heads,
                "num_key_value_heads": stack.geometry.num_kv_heads,
                **_per_layer(stack.geometry),
                "head_dim": stack.geometry.head_dim,
            }
            for name, stack in stacks.items()
        },
        "source_unit": arch.source_unit,
        "source_positions": source_len,
        **current,
        "options": options,
    }


def _per_layer(geo) -> dict:
    """`num_key_value_heads_per_layer` where the layers' KV heads differ (the scalar is then the largest)."""
    return {} if geo.kv_heads_per_layer is None else {"num_key_value_heads_per_layer": list(geo.kv_heads_per_layer)}


def _kv_text(info: dict) -> str:
    """'4 KV', or each layer's: '8, 4, 4, 2 KV (layer by layer)'."""
    per_layer = info.get("num_key_value_heads_per_layer")
    if per_layer is None:
        return f"{info['num_key_value_heads']} KV"
    return f"{', '.join(map(str, per_layer))} KV (layer by layer)"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_report(info: dict) -> str:
    if info.get("encoder_decoder"):
        return _format_encoder_decoder(info)
    if info.get("latent"):
        return format_latent(info, human_bytes)
    params = "unknown" if info["parameters"] is None else f"{info['parameters']:,}"
    lines = [
        f"source        {info['source']}",
        f"architecture  {info['model_type']}" + ("" if info["convertible"] else "  (not convertible by uptrain yet)"),
        f"layers        {info['num_layers']}",
        f"heads         {info['num_attention_heads']} query, {_kv_text(info)}, head_dim {info['head_dim']}",
        *_grouping_lines(info["conversion"]),
        f"parameters    {params}",
        f"KV cache      {human_bytes(info['kv_cache_bytes_per_token'])} per token, "
        f"{human_bytes(info['kv_cache_bytes'])} for {info['context']} tokens × batch {info['batch']} ({info['dtype']})",
        "",
        f"{'G':>4} {'q/kv':>5} {'per token':>11} {'total':>11} {'saving':>7}  TP degrees it divides",
    ]
    for o in info["options"]:
        tp = ", ".join(map(str, o["tensor_parallel_degrees"])) or "-"
        lines.append(
            f"{o['num_kv_heads']:>4} {o['group_size']:>5} {human_bytes(o['kv_cache_bytes_per_token']):>11} "
            f"{human_bytes(o['kv_cache_bytes']):>11} {o['saving']:>7.1%}  {tp}"
        )
    return "\n".join(lines)


def _grouping_lines(conversion: dict | None) -> list[str]:
    """How uptrain grouped the KV heads: the groups, one line per layer where they differ per
    layer (similarity grouping: each layer's source KV heads in their new order, bracketed by the
    new KV head they became); an encoder–decoder's per attention."""
    if conversion is None:
        return []
    sites = conversion.get("attentions") or {"": conversion}
    lines = [
        f"grouping      {conversion['grouping']} ({conversion['pooling']} pooling) of "
        f"{conversion['source_num_key_value_heads']} source KV heads; [ ] one new KV head"
        + (", source heads in their new order" if conversion["grouping"] == "similarity" else "")
    ]
    if "kv_budget" in conversion:
        costs = ""
        if conversion["allocation_costs"]:
            cost, priced = conversion["allocation_cost"], conversion["allocation_cost_pooling"]
            named = f" ({cost} cost{f', priced for {priced} pooling' if priced else ''})" if cost else ""
            costs = f"; each layer's costs{named} in uptrain.json"
        if conversion["allocation_forced"]:
            costs = "; forced: the only allocation within the budget, no costs measured"
        weight = conversion["cross_kv_weight"]
        weighed = "" if weight is None else f", a cross-attention head weighing {weight:g} self-attention heads"
        lines.append(
            f"budget        {conversion['kv_budget']:g} of the source's KV bytes{weighed} ({conversion['allocation']} "
            f"allocation{costs})"
        )
    for site, record in sites.items():
        name = f"{site} " if site else ""
        groups = record["kv_groups"]
        if isinstance(groups, list):  # the same in every layer
            lines.append(f"  {name}every layer: {_bracketed(groups)}")
            continue
        lines += [f"  {name}layer {layer}: {_bracketed(g)}" for layer, g in groups.items()]
    return lines


def _bracketed(groups: list[list[int]]) -> str:
    return " ".join("[" + " ".join(map(str, g)) + "]" for g in groups)


def _at_most(info: dict) -> str:
    """What the context of an encoder–decoder's report is clamped to, when it is."""
    return " (the decoder's positions: it generates no more)" if info.get("context_clamped") else ""


def _format_encoder_decoder(info: dict) -> str:
    params = "unknown" if info["parameters"] is None else f"{info['parameters']:,}"
    unit = info["source_unit"]
    attentions = [
        f"{name:<13} {a['num_layers']} layers, {a['num_attention_heads']} query, {_kv_text(a)}, "
        f"head_dim {a['head_dim']}"
        for name, a in info["attentions"].items()
    ]
    lines = [
        f"source        {info['source']}",
        f"architecture  {info['model_type']} (encoder–decoder)",
        *(f"{'heads' if i == 0 else '':<14}{line}" for i, line in enumerate(attentions)),
        *_grouping_lines(info["conversion"]),
        f"parameters    {params}",
        f"KV cache      {human_bytes(info['kv_cache_bytes_per_token'])} per generated token (decoder self-attention) "
        f"+ {human_bytes(info['cross_kv_cache_bytes_per_source_token'])} per {unit} (cross-attention); "
        f"{human_bytes(info['kv_cache_bytes'])} for {info['context']} tokens{_at_most(info)} from "
        f"{info['source_positions']} {unit}s × batch {info['batch']} ({info['dtype']})",
        "",
        f"{'G':>4} {'q/kv':>5} {'per token':>11} {'per ' + unit:>16} {'total':>11} {'saving':>7}  "
        "TP degrees it divides",
    ]
    for o in info["options"]:
        tp = ", ".join(map(str, o["tensor_parallel_degrees"])) or "-"
        lines.append(
            f"{o['num_kv_heads']:>4} {o['group_size']:>5} {human_bytes(o['kv_cache_bytes_per_token']):>11} "
            f"{human_bytes(o['cross_kv_cache_bytes_per_source_token']):>16} {human_bytes(o['kv_cache_bytes']):>11} "
            f"{o['saving']:>7.1%}  {tp}"
        )
    return "\n".join(lines)
