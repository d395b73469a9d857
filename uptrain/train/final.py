"""`final/`: the uptrained model, written the way `uptrain convert` writes its output.

Not with `save_pretrained`: transformers 5 re-serialises config.json (`rope_theta` and
`rope_scaling` become `rope_parameters`, `torch_dtype` becomes `dtype`) and names a tokenizer
class in tokenizer_config.json that transformers 4.x cannot load; a 4.x user would load the
uptrained model with the wrong RoPE base and no error. Training changes only the weights, so
`final/` is the starting checkpoint with its weights replaced:
- config.json, tokenizer, generation, licence and modeling files copied byte for byte;
- the weights under the starting checkpoint's tensor names, each in its dtype there (a bf16
  model stays bf16), as safetensors, sharded with an index like transformers when large;
  a weight tied to another one (lm_head to the embeddings) is written only where the
  starting checkpoint had it, which is what transformers expects on load;
- `uptrain.json`: this uptraining, with the starting checkpoint's `uptrain.json` embedded
  (provenance as a chain), and a model card (an encoder–decoder's with the Hub task its
  conversion's card names: text2text-generation, translation for Marian, speech recognition
  for Whisper). Both name local paths portably (a folder or file by its name, a Hugging Face
  cache snapshot by its Hub id): `final/` is made to be shared.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import torch

import uptrain
from uptrain.architecture import find_architecture
from uptrain.checkpoint.atomic import atomic_directory
from uptrain.checkpoint.card import CARD, card_metadata, front_matter, is_hub_id
from uptrain.checkpoint.provenance import PROVENANCE, conversion_record, latent_record
from uptrain.checkpoint.reader import SAFETENSORS_INDEX, SourceCheckpoint
from uptrain.checkpoint.source import local_source, portable
from uptrain.checkpoint.writer import write_tensors
from uptrain.convert.plan import ATTENTION_NAMES
from uptrain.model_info import read_config
from uptrain.train.speech_units import card_budget

# Shards as `uptrain convert` writes them by default.
MAX_SHARD_BYTES = 5 * 10**9
# Files of the starting checkpoint that final/ replaces rather than copies: weights (any
# format), the card and the provenance (written anew), and the summary of older uptrain versions.
REPLACED = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    CARD,
    PROVENANCE,
    "uptrain_train.json",
)


def _replaced(path: Path) -> bool:
    return any(path.match(pattern) for pattern in REPLACED)


def _tied_duplicates(model: torch.nn.Module, keep: set[str]) -> set[str]:
    """State-dict names of parameters that are the same tensor as a parameter named in `keep`."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    duplicates = set()
    for names in names_of.values():
        if len(names) > 1 and any(n in keep for n in names):
            duplicates.update(n for n in names if n not in keep)
    return duplicates


def final_tensors(
    state: dict[str, torch.Tensor], model: torch.nn.Module, start: SourceCheckpoint, default_dtype: torch.dtype
) -> dict[str, torch.Tensor] | None:
    """The tensors to write, in the starting checkpoint's order, names and dtypes; a trained
    tensor the starting checkpoint lacked (initialised at load) follows in `default_dtype`.

    None when the model's names are not the checkpoint's: transformers renamed or fused some
    tensors on load (its conversion mappings), and only `save_pretrained` can map them back.
    """
    stored = start.tensors
    if any(name not in state or tuple(state[name].shape) != info.shape for name, info in stored.items()):
        return None
    tied = _tied_duplicates(model, set(stored))
    out = {}
    for info in start.order():
        out[info.name] = _cast(state[info.name], info.dtype)
    for name, tensor in state.items():
        if name not in stored and name not in tied:
            out[name] = _cast(tensor, default_dtype)
    return out


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach().cpu()
    return tensor.to(dtype) if tensor.is_floating_point() and dtype.is_floating_point else tensor


def carry_files(start: Path, folder: Path) -> list[str]:
    """Copy every file of the starting checkpoint that training does not change (config.json,
    tokenizer, generation config, chat template, licences, modeling code), byte for byte."""
    carried = []
    for path in sorted(start.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not _replaced(path):
            shutil.copy2(path, folder / path.name)
            carried.append(path.name)
    return carried


def _save_with_transformers(model, state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    """Weights only, through transformers' own name mapping (its config and tokenizer files are
    discarded: the starting checkpoint's are kept)."""
    scratch = folder / ".weights"
    model.save_pretrained(scratch, state_dict=state, max_shard_size=max_shard_bytes)
    for path in scratch.iterdir():
        if path.name.endswith((".safetensors", SAFETENSORS_INDEX)):
            path.rename(folder / path.name)
    shutil.rmtree(scratch)


def write_final(
    out: Path,
    start: Path,
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    record: dict,
    card: str,
    default_dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write `final/` (whole or not at all; main process only). `state` is the full state dict
    gathered from every process (`accelerator.get_state_dict`, which every process must call),
    `model` the unwrapped model it came from."""
    checkpoint = SourceCheckpoint(start, allow_pickle=True)  # loaded by from_pretrained already: trusted
    try:
        tensors = final_tensors(state, model, checkpoint, default_dtype)
        metadata = {k: str(v) for k, v in checkpoint.metadata.items()}
    finally:
        checkpoint.close()
    with atomic_directory(out, overwrite=True) as tmp:
        carry_files(start, tmp)
        if tensors is not None:
            write_tensors(tensors, tmp, max_shard_bytes, metadata)
        else:
            _save_with_transformers(
                model,
                {
                    k: _cast(v, checkpoint.tensors[k].dtype if k in checkpoint.tensors else default_dtype)
                    for k, v in state.items()
                },
                tmp,
                max_shard_bytes,
            )
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        (tmp / CARD).write_text(card)
    return out


def portable_config(value):
    """The run's config as `final/` records it: every absolute local path (model, data, output_dir,
    teacher) by its name, as `portable` gives it; everything else as it was."""
    if isinstance(value, str):
        return portable(value)
    if isinstance(value, list):
        return [portable_config(v) for v in value]
    if isinstance(value, dict):
        return {k: portable_config(v) for k, v in value.items()}
    return value


def uptraining_record(
    start: Path,
    config: dict,
    *,
    steps: int,
    tokens: int,
    num_processes: int,
    global_batch: int,
    eval_before: dict | None,
    eval_after: dict,
    start_label: str | None = None,
    speech: dict | None = None,
) -> dict:
    """`uptrain.json` of `final/`: the uptraining run and where it started from (`start_label`:
    what the user named, e.g. a Hub id, when not the folder itself), its Hub id and commit where
    known, and the Hub model `final/` derives from (`base_model`, None where no Hub id is known)."""
    given_id = start_label if start_label and not Path(start_label).exists() and is_hub_id(start_label) else None
    started = local_source(start, hub_id=given_id)
    return {
        "uptrain_version": uptrain.__version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "uptraining": {
            "config": portable_config(config),
            "steps": steps,
            "tokens": tokens,
            "num_processes": num_processes,
            "global_batch": global_batch,
            "eval_before": eval_before,
            "eval_after": eval_after,
            # A speech run's clips and audio seconds (`speech_units.SpeechUnits.record`), which the card says.
            **({"speech": speech} if speech is not None else {}),
        },
        "started_from": {
            "name": started.name,
            "revision": started.revision,
            "base_model": started.base_model,
            "provenance": started.provenance,
        },
    }


def _loss(metrics: dict | None) -> str:
    if not metrics or "eval/loss" not in metrics:
        return "not measured"
    return f"{metrics['eval/loss']:.4f} (perplexity {metrics.get('eval/perplexity', float('nan')):.1f})"


def _kv_heads(record: dict) -> str:
    """'2 KV heads', or each layer's where a conversion gave the layers their own."""
    per_layer = record.get("num_key_value_heads_per_layer")
    if isinstance(per_layer, list):
        return f"per-layer KV heads ({', '.join(map(str, per_layer))})"
    return f"{record['num_key_value_heads']} KV heads"


def _encoder_decoder_conversion(conversion: dict) -> str:
    """What uptrain's conversion did to each attention of an encoder–decoder."""
    attentions, chosen = conversion["attentions"], conversion["attention"]
    pooled = "; ".join(
        f"{ATTENTION_NAMES.get(name, name)} {attentions[name]['source_num_key_value_heads']} → "
        f"{_kv_heads(attentions[name])}"
        for name in chosen
    )
    kept = [name for name in attentions if name not in chosen]
    unchanged = "; " + " and ".join(ATTENTION_NAMES.get(name, name) for name in kept) + " unchanged" if kept else ""
    return (
        f"`{portable(str(conversion['source']))}` (an encoder–decoder) converted by uptrain to grouped-query "
        f"attention ({pooled}{unchanged}; `{conversion['pooling']}` pooling; details in the starting "
        "checkpoint's record, embedded in `uptrain.json`), then uptrained."
    )


def uptrained_card(record: dict, start: Path) -> str:
    """README.md of `final/`: Hub metadata (the Hub model it derives from, where one is known; the
    starting checkpoint's licence; an encoder–decoder's Hub task, as `uptrain convert` names it)
    and what was done: conversion, then uptraining."""
    run = record["uptraining"]
    c = run["config"]
    conversion = conversion_record(record["started_from"]["provenance"])
    start_card = card_metadata(start)
    tags = [conversion["model_type"]] if conversion else []
    # The starting checkpoint's own model_type (t5_gqa, or t5 for a model uptrain did not convert).
    arch = find_architecture(read_config(start).get("model_type"))
    encoder_decoder = arch is not None and arch.encoder_decoder
    if encoder_decoder:
        tags.append("encoder-decoder")
    latent = latent_record(record["started_from"]["provenance"])
    if latent is not None:
        tags = [latent["model_type"]]
        what = (
            f"`{portable(str(latent['source']))}` converted by uptrain to multi-head latent attention "
            f"(DeepSeek-V2 layout: a latent of rank {latent['kv_lora_rank']} and a shared rotary key of "
            f"{latent['qk_rope_head_dim']} columns, from {latent['source_num_key_value_heads']} KV heads; "
            f"`{latent['initialisation']}` initialisation; details in the starting checkpoint's record, "
            "embedded in `uptrain.json`), then uptrained."
        )
    elif conversion and encoder_decoder and isinstance(conversion.get("attentions"), dict):
        what = _encoder_decoder_conversion(conversion)
    elif conversion:
        # portable(): records written before sources were named portably hold the absolute path.
        what = (
            f"`{portable(str(conversion['source']))}` converted by uptrain to "
            f"{_kv_heads(conversion)} "
            f"(from {conversion['source_num_key_value_heads']}; `{conversion['pooling']}` pooling, "
            f"`{conversion.get('grouping', 'contiguous')}` grouping; details in the starting checkpoint's "
            "record, embedded in `uptrain.json`), then uptrained."
        )
    else:
        revision = record["started_from"]["revision"]
        what = (
            f"`{record['started_from']['name']}`"
            + (f" (revision `{revision}`)" if revision else "")
            + " uptrained (it was not converted by uptrain)."
        )
    processes = f"{run['num_processes']} process" + ("es" if run["num_processes"] > 1 else "")
    budget = f"{run['tokens']:,} tokens in {run['steps']:,} optimizer steps"
    shape = f"global batch {run['global_batch']} blocks of {c['seq_len']} tokens, {processes}"
    if run.get("speech"):  # clips of audio, not seq_len tokens
        budget, shape = card_budget(run["speech"], run["steps"], processes), None
    if c.get("uptrain_fraction") is not None:
        budget += f": α = {c['uptrain_fraction']} of the {c['pretrain_tokens']:,.0f} tokens the model was pretrained on"
    if shape is not None:
        budget += f" ({shape})"
    train_data, eval_data = (v if isinstance(v, str) else ", ".join(v) for v in (c["train_data"], c["eval_data"]))
    distill = (
        f"\n- Distillation from `{c['teacher']}` (weight {c['distill_weight']}, temperature {c['distill_temperature']})"
        if c.get("teacher")
        else ""
    )
    # Recorded by runs that train an objective (span corruption, pairs, …); older ones trained causal LM.
    objective = f"\n- Objective: `{c['objective']}`" if c.get("objective") else ""
    kind = "multi-head latent attention" if latent is not None else "grouped-query-attention"
    body = f"""# Uptrained {kind} model (uptrain)

{what}

## Uptraining

- Budget: {budget}
- Data: `{train_data}`; evaluation on `{eval_data}`{objective}{distill}
- Optimizer: AdamW, peak lr {c["lr"]}, {c["warmup_steps"]} warmup steps then cosine, seed {c["seed"]}
- Eval loss before uptraining: {_loss(run["eval_before"])}
- Eval loss after uptraining: {_loss(run["eval_after"])}

`config.json`, tokenizer and generation files are the starting checkpoint's, byte for byte; only the weights \
changed (each tensor in its dtype there). `uptrain.json` records the run's full config and the provenance chain \
(uptrain {record["uptrain_version"]}).
"""
    task = arch.pipeline_tag if arch is not None else "text-generation"
    attention = "mla" if latent is not None else "gqa"
    return (
        front_matter(record["started_from"]["base_model"], start_card, tags + ["uptrained"], task, attention)
        + "\n"
        + body
    )
