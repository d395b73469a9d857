"""`uptrain.json`: where a checkpoint came from, as a chain.

A converted checkpoint's record describes the conversion (`uptrain.convert.outputs`); the
`final/` of `uptrain train` records the uptraining and embeds the record of the checkpoint it
started from (`uptrain.train.final`).
"""

from __future__ import annotations

import os
from pathlib import Path

from uptrain import UptrainError
from uptrain.strict_json import read_json

PROVENANCE = "uptrain.json"
# What the cards, the budget rule and the trackers read from a conversion record.
CONVERSION_KEYS = ("source", "model_type", "pooling", "source_num_key_value_heads", "num_key_value_heads")


def read_provenance(folder: str | Path) -> dict | None:
    """A checkpoint's `uptrain.json` (its chain checked), or None when it has none.

    One that is there but is no provenance record (not JSON, not an object, a `started_from`
    that is not a mapping, a conversion without the fields above) is one UptrainError: read as
    no provenance, it would make the next card and wandb run say the model was not converted
    by uptrain, which the file itself says it was.
    """
    path = Path(folder) / PROVENANCE
    if not os.path.lexists(path):
        return None
    record = read_json(path)
    conversion_record(record, str(path))
    return record


def conversion_record(record: dict | None, where: str = PROVENANCE) -> dict | None:
    """The conversion at the root of a provenance chain: the record itself for a converted
    checkpoint, the one its uptraining started from for a `final/` (followed back through
    uptrainings of uptrained models); None for a chain that starts at a model uptrain did not
    convert. A malformed chain is one UptrainError naming `where` and the key."""
    keys: list[str] = []  # where in the file `record` is, for the message
    while record is not None:
        if not isinstance(record, dict):
            raise _malformed(where, keys, record)
        if "pooling" in record:
            if missing := [k for k in CONVERSION_KEYS if k not in record]:
                raise UptrainError(
                    f"{where}: {_at(keys)} names a conversion but lacks {', '.join(missing)}; it is "
                    "not a record uptrain wrote: restore or remove the file"
                )
            return record
        started = record.get("started_from")
        keys.append("started_from")
        if started is None:
            return None
        if not isinstance(started, dict):
            raise _malformed(where, keys, started)
        record = started.get("provenance")
        keys.append("provenance")
    return None


def latent_record(record: dict | None) -> dict | None:
    """The multi-head latent attention conversion (`uptrain convert --target mla`) at the root of a
    provenance chain, else None. Apart from `conversion_record`, whose readers (cards, budgets,
    trackers) read a GQA conversion's pooling and KV heads, which an MLA record has not."""
    while isinstance(record, dict):
        if record.get("target") == "mla":
            return record
        started = record.get("started_from")
        record = started.get("provenance") if isinstance(started, dict) else None
    return None


def _at(keys: list[str]) -> str:
    return f"`{'.'.join(keys)}`" if keys else "the record"


def _malformed(where: str, keys: list[str], value: object) -> UptrainError:
    return UptrainError(
        f"{where}: {_at(keys)} must be a mapping (a provenance record), not {type(value).__name__}; "
        "it is not a record uptrain wrote: restore or remove the file"
    )
