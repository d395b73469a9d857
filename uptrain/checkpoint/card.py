"""The model card (`README.md`) of a checkpoint uptrain writes: Hub metadata in YAML front matter."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from uptrain import UptrainError
from uptrain.checkpoint.provenance import conversion_record
from uptrain.options import parse_yaml

CARD = "README.md"
# Card metadata that follows the weights from source to output: the licence terms.
CARRIED_CARD_KEYS = ("license", "license_name", "license_link")
CARD_TAGS = ["uptrain"]
# The Hub's tags for the attention an output has: grouped-query, or (`--target mla`) latent.
ATTENTION_TAGS = {
    "gqa": ["grouped-query-attention", "gqa"],
    "mla": ["multi-head-latent-attention", "mla"],
}


# A card's YAML front matter: a `---` line opening the file, then the YAML, then a `---` line.
_FRONT_MATTER = re.compile(r"\A\s*---[ \t]*\r?\n(.*?)^---[ \t]*\r?$", re.DOTALL | re.MULTILINE)


def card_metadata(folder: str | Path) -> dict:
    """The YAML front matter of a checkpoint's model card ({} without a card or front matter,
    or with one that is not a mapping uptrain's one YAML loader reads: a card we cannot parse
    carries nothing, and the weights are still worth converting)."""
    path = Path(folder) / CARD
    if not path.is_file():
        return {}
    try:
        found = _FRONT_MATTER.match(path.read_text(encoding="utf-8-sig"))
        # The bounded loader: licence keys are written into the output's card, and an alias bomb
        # there would be written out in full.
        meta = parse_yaml(found.group(1), path) if found else {}
    except (OSError, UnicodeDecodeError, UptrainError):
        return {}
    return meta if isinstance(meta, dict) else {}


def is_hub_id(value: object) -> bool:
    """A string the Hub accepts as a model id (`name` or `org/name`): not a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except (HFValidationError, TypeError, ValueError):
        return False
    return isinstance(value, str)


def hub_base_model(hub_id: str | None, provenance: dict | None, folder: str | Path) -> str | list[str] | None:
    """The Hub model a checkpoint made from a source derives from (its card's `base_model`): the
    source itself when it is a Hub repository (`hub_id`); else the one its `provenance` or the
    card in `folder` names (a folder uptrain converted or uptrained from a Hub model, a fine-tune
    whose card names its base); else None, and the card names no base model: the Hub refuses a
    local path there, and a folder's name is no Hub id."""
    if hub_id is not None:
        return hub_id
    conversion = conversion_record(provenance)
    if conversion is not None:
        # Records of uptrain versions before `base_model` name a Hub source by its id in `source`.
        named = conversion["base_model"] if "base_model" in conversion else conversion["source"]
        if _hub_ids(named):
            return named
    named = card_metadata(folder).get("base_model")
    return named if _hub_ids(named) else None


def _hub_ids(value: object) -> bool:
    """A Hub id, or a non-empty list of them (a merge names several base models)."""
    return is_hub_id(value) or (isinstance(value, list) and bool(value) and all(map(is_hub_id, value)))


def front_matter(
    base_model: str | list[str] | None,
    source_card: dict,
    extra_tags: list[str],
    pipeline_tag: str = "text-generation",
    attention: str = "gqa",
) -> str:
    """Hub metadata: base model (when a Hub id is known), library, task, the source's licence
    terms, tags (uptrain's, the `attention`'s of ATTENTION_TAGS, then `extra_tags`)."""
    meta = {} if base_model is None else {"base_model": base_model}
    meta.update({"library_name": "transformers", "pipeline_tag": pipeline_tag})
    meta.update({k: source_card[k] for k in CARRIED_CARD_KEYS if source_card.get(k) is not None})
    meta["tags"] = list(dict.fromkeys(CARD_TAGS + ATTENTION_TAGS[attention] + extra_tags))
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"
