"""`uptrain.json`: where a checkpoint came from, as a chain.

A converted checkpoint's record describes the conversion (`uptrain.convert.outputs`); the
`final/` of `uptrain train` records the uptraining and embeds the record of the checkpoint it
started from (`uptrain.train.final`).
"""

from __future__ import annotations

import json
from pathlib import Path

PROVENANCE = "uptrain.json"


def read_provenance(folder: str | Path) -> dict | None:
    """A checkpoint's `uptrain.json`, or None when it has none (or an unreadable one)."""
    path = Path(folder) / PROVENANCE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def conversion_record(record: dict | None) -> dict | None:
    """The conversion at the root of a provenance chain: the record itself for a converted
    checkpoint, the one its uptraining started from for a `final/` (followed back through
    uptrainings of uptrained models)."""
    while record is not None:
        if "pooling" in record:
            return record
        record = (record.get("started_from") or {}).get("provenance")
    return None
