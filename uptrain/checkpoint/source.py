"""Where a conversion reads from: a local checkpoint folder, or a Hub id fetched (or found in the
local cache when offline)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from uptrain import UptrainError

# What a conversion needs from a Hub repository: weights, configs, tokenizer, card and licence.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*", "*.jinja", "*.md", "LICENSE*",
                "USE_POLICY*", "NOTICE*"]


@dataclass(frozen=True)
class ResolvedSource:
    folder: Path
    label: str  # what the user named: the absolute folder, or the Hub id
    revision: str | None = None  # the Hub commit the files came from


def resolve_source(src: str | Path) -> ResolvedSource:
    """A local folder, or a Hub id fetched (or found in the cache when offline)."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise UptrainError(f"{src} is not a checkpoint folder")
        return ResolvedSource(path.absolute(), str(path.absolute()))
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)) and not str(src).startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            local = Path(snapshot_download(str(src), allow_patterns=HUB_PATTERNS))
        except Exception as err:
            offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
            raise UptrainError(f"{src} is not a local folder and could not be fetched from the Hub{offline}: "
                               f"{type(err).__name__}") from None
        # huggingface_hub lays snapshots out as …/snapshots/<commit sha>/
        return ResolvedSource(local, str(src), local.name if re.fullmatch(r"[0-9a-f]{40}", local.name) else None)
    raise UptrainError(f"{src} does not exist")
