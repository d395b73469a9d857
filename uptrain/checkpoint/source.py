"""Where a conversion reads from: a local checkpoint folder, or a Hub id fetched (or found in the
local cache when offline); and how records written for others name it.

A checkpoint uptrain writes is meant to be shared (uploaded to the Hub, copied to a cluster), so
its `uptrain.json` and card name a source portably: by its Hub id when it has one, else by its
folder's name; never by an absolute path of the machine it was converted on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from uptrain import UptrainError
from uptrain.checkpoint.card import hub_base_model
from uptrain.checkpoint.provenance import read_provenance

# What a conversion needs from a Hub repository: weights, configs, tokenizer, card and licence.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*", "*.jinja", "*.md", "LICENSE*",
                "USE_POLICY*", "NOTICE*"]
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ResolvedSource:
    folder: Path
    label: str  # what the user named: the absolute folder, or the Hub id (for messages on this machine)
    revision: str | None = None  # the Hub commit the files came from
    hub_id: str | None = None  # the Hub repository: given as an id, or a snapshot folder of a Hugging Face cache
    provenance: dict | None = field(default=None, compare=False)  # its uptrain.json (chain checked), if any
    # The Hub model(s) a checkpoint made from it derives from; None where no Hub id is known.
    base_model: str | list[str] | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        """How records meant for others name the source: its Hub id when known, else its folder's name."""
        return self.hub_id or folder_name(self.folder)


def folder_name(folder: str | Path) -> str:
    """The last component of a folder (`..` and `.` resolved lexically, links kept as named)."""
    return Path(os.path.abspath(folder)).name


def snapshot_of(folder: str | Path) -> tuple[str, str | None] | None:
    """(Hub id, commit) of a folder of a Hugging Face cache (…/models--org--name/snapshots/<commit>),
    else None: huggingface_hub lays snapshots out this way, so the path says which repository and
    commit the files are."""
    path = Path(os.path.abspath(folder))
    if path.parent.name != "snapshots" or not path.parent.parent.name.startswith("models--"):
        return None
    repo = path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return repo, path.name if COMMIT.fullmatch(path.name) else None


def local_source(folder: str | Path, label: str | None = None, hub_id: str | None = None) -> ResolvedSource:
    """A checkpoint folder on this machine; named by its Hub id and commit when it is a snapshot in a
    Hugging Face cache (`hub_id`: the id it was fetched by, where the caller knows it)."""
    folder = Path(folder).absolute()
    repo, revision = snapshot_of(folder) or (None, None)
    return _described(folder, label or str(folder), revision, hub_id or repo)


def _described(folder: Path, label: str, revision: str | None, hub_id: str | None) -> ResolvedSource:
    # Its uptrain.json is read here, where every command resolves its checkpoints before writing
    # anything: a malformed one is refused then, not when a card is written after the work.
    provenance = read_provenance(folder)
    return ResolvedSource(folder, label, revision, hub_id, provenance, hub_base_model(hub_id, provenance, folder))


def portable(value: str) -> str:
    """`value` as a record meant for others keeps it: an absolute local path (or one under `~`)
    becomes what `ResolvedSource.name` would call it (its folder's or file's name, the Hub id of a
    cache snapshot); a Hub id, a dataset name or a relative path is kept."""
    expanded = os.path.expanduser(value)
    if not os.path.isabs(expanded):
        return value
    snapshot = snapshot_of(expanded)
    return snapshot[0] if snapshot else folder_name(expanded)


def resolve_source(src: str | Path) -> ResolvedSource:
    """A local folder, or a Hub id fetched (or found in the cache when offline)."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise UptrainError(f"{src} is not a checkpoint folder")
        return local_source(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)) and not str(src).startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            local = Path(snapshot_download(str(src), allow_patterns=HUB_PATTERNS))
        except Exception as err:
            offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
            raise UptrainError(f"{src} is not a local folder and could not be fetched from the Hub{offline}: "
                               f"{type(err).__name__}") from None
        # huggingface_hub lays snapshots out as …/snapshots/<commit sha>/
        return _described(local, str(src), local.name if COMMIT.fullmatch(local.name) else None, str(src))
    raise UptrainError(f"{src} does not exist")
