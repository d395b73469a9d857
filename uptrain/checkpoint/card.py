"""The model card (`README.md`) of a checkpoint uptrain writes: Hub metadata in YAML front matter."""

from __future__ import annotations

from pathlib import Path

import yaml

CARD = "README.md"
# Card metadata that follows the weights from source to output: the licence terms.
CARRIED_CARD_KEYS = ("license", "license_name", "license_link")
CARD_TAGS = ["uptrain", "grouped-query-attention", "gqa"]


def card_metadata(folder: str | Path) -> dict:
    """The YAML front matter of a checkpoint's model card ({} without a card or front matter)."""
    path = Path(folder) / CARD
    if not path.is_file():
        return {}
    try:
        from huggingface_hub import metadata_load

        return metadata_load(path) or {}
    except (ValueError, yaml.YAMLError, UnicodeDecodeError):
        return {}  # a card we cannot parse carries nothing; the weights are still worth converting


def hub_id(source: str) -> str:
    """The Hub id of a source: itself for an id, `org/name` for a folder inside a Hugging Face
    cache (…/models--org--name/snapshots/<commit>), else the path unchanged."""
    path = Path(source)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return source


def front_matter(base_model: str, source_card: dict, extra_tags: list[str]) -> str:
    """Hub metadata: base model, library, task, the source's licence terms, tags."""
    meta = {"base_model": hub_id(base_model), "library_name": "transformers", "pipeline_tag": "text-generation"}
    meta.update({k: source_card[k] for k in CARRIED_CARD_KEYS if source_card.get(k) is not None})
    meta["tags"] = list(dict.fromkeys(CARD_TAGS + extra_tags))
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"
