"""wandb: never a prompt, never a half-made run; a run config that says what was trained.

`ensure_wandb_never_prompts` runs before anything is written: without credentials it switches
wandb offline, and with `WANDB_MODE=online` but no key it refuses in one line. `run_config`
is what the run's wandb config records: the training config, the conversion actually done to
the model (read from its `uptrain.json`, not the training config's conversion defaults; for an
encoder–decoder each attention's KV heads and groups too), the number of processes, the global
batch and the uptrain version. `start_trackers` starts the trackers and makes tokens seen the
x-axis of every curve.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlsplit

import uptrain
from uptrain import UptrainError
from uptrain.checkpoint.provenance import conversion_record, read_provenance

TOKENS_SEEN = "train/tokens_seen"
# Modes in which wandb talks to the server and so needs an API key.
ONLINE_MODES = ("online", "run", "shared")
# The conversion fields worth a column in wandb's run table (per-file digests and per-head maps are not).
CONVERSION_FIELDS = (
    "source",
    "source_revision",
    "base_model",
    "model_type",
    "pooling",
    "grouping",
    "seed",
    "dtype",
    "num_attention_heads",
    "source_num_key_value_heads",
    "num_key_value_heads",
    "calibration",
    "uptrain_version",
)
# An encoder–decoder's conversion also records which attentions were pooled (`attention`) and
# each attention's heads and groups (`attentions`; the top-level fields above are its decoder
# self-attention's). A decoder-only record has neither and logs CONVERSION_FIELDS alone.
ATTENTION_FIELDS = (
    "num_layers",
    "num_attention_heads",
    "head_dim",
    "source_num_key_value_heads",
    "num_key_value_heads",
    "kv_groups",
)


def _wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def ensure_wandb_never_prompts() -> str | None:
    """Without credentials and without WANDB_MODE, make wandb run offline instead of failing or
    asking for a key. Returns a note for the user when it did so. `WANDB_MODE=online` without
    credentials is refused here, before any file is written (wandb itself would fail only once
    the run folder exists)."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ONLINE_MODES and not _wandb_has_credentials():
        raise UptrainError(
            f"WANDB_MODE={mode} but no wandb API key is configured: run `wandb login`, set "
            "WANDB_API_KEY, or use WANDB_MODE=offline (or report_to: jsonl)"
        )
    if mode or _wandb_has_credentials():
        return None
    os.environ["WANDB_MODE"] = "offline"
    return "wandb: no credentials configured, logging offline (sync later with `wandb sync`)"


# Logged only where a record has them (a conversion with per-layer KV heads, or one that spent a
# --kv-budget): runs converted with one G log exactly the fields above.
PER_LAYER_FIELDS = ("num_key_value_heads_per_layer", "kv_budget", "allocation")


def _per_layer_fields(record: dict) -> dict:
    return {k: record[k] for k in PER_LAYER_FIELDS if k in record}


def conversion_fields(conversion: dict) -> dict:
    """The conversion as the run config logs it: CONVERSION_FIELDS, and for an encoder–decoder
    the attentions pooled and, per attention (encoder, decoder-self, cross), ATTENTION_FIELDS, so
    that runs can be filtered by e.g. `conversion.attentions.cross.num_key_value_heads`."""
    values = {k: conversion.get(k) for k in CONVERSION_FIELDS}
    values |= _per_layer_fields(conversion)
    attentions = conversion.get("attentions")
    if "attention" in conversion or isinstance(attentions, dict):
        values["attention"] = conversion.get("attention")
        values["attentions"] = (
            {
                name: {k: a.get(k) for k in ATTENTION_FIELDS} | _per_layer_fields(a) if isinstance(a, dict) else None
                for name, a in attentions.items()
            }
            if isinstance(attentions, dict)
            else None
        )
    return values


def run_config(config, model_path: str | Path, num_kv_heads: int, num_processes: int, global_batch: int) -> dict:
    """The wandb config of a run. `pooling`, `grouping` and `num_kv_heads` are those of the model
    trained (from its provenance; `pooling: null` for a model uptrain did not convert), so that
    runs can be grouped and filtered by them whichever way the model was made."""
    values = config.to_dict()
    conversion = conversion_record(read_provenance(model_path))
    values.update(
        {
            "pooling": conversion["pooling"] if conversion else None,
            "grouping": conversion.get("grouping", "contiguous") if conversion else None,
            "num_kv_heads": num_kv_heads,
            "conversion": conversion_fields(conversion) if conversion else None,
            "model_path": str(model_path),
            "num_processes": num_processes,
            "global_batch": global_batch,
            "tokens_per_step": global_batch * config.seq_len,
            "uptrain_version": uptrain.__version__,
        }
    )
    return values


def start_trackers(accelerator, config, values: dict, run_id: str, out: Path) -> None:
    """Start the configured trackers (wandb) on the main process with `values` as the run config;
    every metric is plotted against tokens seen, which stays comparable across batch sizes and
    process counts where the step does not."""
    name = config.run_name or out.name
    accelerator.init_trackers(
        config.wandb_project,
        config=values,
        init_kwargs={
            "wandb": {"dir": str(out), "name": name, "id": run_id, "resume": "allow", "group": config.wandb_group}
        },
    )
    if "wandb" in config.trackers and accelerator.is_main_process:
        run = accelerator.get_tracker("wandb", unwrap=True)
        run.define_metric(TOKENS_SEEN)
        run.define_metric("*", step_metric=TOKENS_SEEN)
