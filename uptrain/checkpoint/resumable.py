"""A resumable folder: which recorded settings identify the work it holds, the check a rerun
passes before it continues that work, and the one way a refusal is worded.

`uptrain train` (`run_config.yaml`), `uptrain compare` (`compare.json`) and `uptrain tokenize`
(`progress.json` of its partial folder) each record in their folder the settings the work
started with, and continue only work made the same way. Each command names its *operational*
keys: those that change how the work is run or reported but not what it computes, which a rerun
may change. Every other key identifies the work. A changed identifying key is refused in one
line, the same for the three commands:

    cannot resume the run in D: its settings changed (lr: 0.003 → 1.0); rerun with the earlier
    value to continue it, or pass --overwrite to start over (or use another output_dir)

Nested settings count key by key (`conversion.grouping`). A path to one of uptrain's own
shipped files or asset folders (the default corpus, the reference models) counts by its place in
the package, so a checkout or an installation that moved still continues the work it recorded,
and so does a folder made before the assets themselves moved within the package (`MOVED`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uptrain
from uptrain import UptrainError
from uptrain.options import keys_of

PACKAGE = Path(uptrain.__file__).resolve().parent
SHIPPED = "<uptrain>/"  # how an identity names a path into the package
ASSETS = "assets"  # the shipped corpus, tokenizer and reference models: files and folders alike
# Where the shipped assets were before (old place inside the package → new): uptrain/data/ became
# uptrain/assets/ (commit 8b6848f); compare and demo folders made before record the old paths.
MOVED = {"data": ASSETS}
_DIGEST = re.compile(r"[0-9a-f]{32,}")


@dataclass(frozen=True)
class Change:
    """One identifying key whose value differs from the recorded one."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {_shown(self.old)} → {_shown(self.new)}"


@dataclass(frozen=True)
class ResumeRule:
    """Which settings identify the work of a resumable folder: all but `operational` (dotted
    names, as `flatten` spells nested keys). `defaults` holds what each key held before uptrain
    recorded it: a folder made by an earlier uptrain lacks the keys added since."""

    operational: frozenset[str] = frozenset()
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def for_schema(cls, schema: type, operational: Iterable[str]) -> ResumeRule:
        """The rule of a folder whose record holds the keys of `schema` (an `uptrain.options`
        schema): every key but `operational` identifies the work, and a key the record lacks held
        its default (required keys have none: every record holds them)."""
        return cls(frozenset(operational), {k.name: k.default for k in keys_of(schema) if not k.required})

    def identity(self, settings: Mapping) -> dict:
        """The identifying settings of `settings`, flat, each as it is compared."""
        return {k: settled(v) for k, v in flatten(settings).items() if k not in self.operational}

    def changes(self, recorded: Mapping, current: Mapping) -> list[Change]:
        """Each identifying key of `current` whose value differs from `recorded`'s, in
        `current`'s order. A key `recorded` lacks held its default there."""
        old = self.identity({**flatten(self.defaults), **flatten(recorded)})
        return [Change(k, old.get(k), v) for k, v in self.identity(current).items() if old.get(k) != v]

    def check(self, recorded: Mapping, current: Mapping, *, what: str, place: str) -> None:
        """Refuse (`settings_changed`) a rerun of `what` whose identifying settings changed."""
        if changed := self.changes(recorded, current):
            raise settings_changed(what, changed, place)


def settings_changed(what: str, changes: Sequence[Change], place: str) -> UptrainError:
    """The one refusal of a rerun whose settings changed: each key with its recorded and its new
    value, and the two ways on. `what` names the work and its folder ("the run in D"), `place`
    the setting naming the folder ("output_dir", "OUT")."""
    earlier = "value" if len(changes) == 1 else "values"
    return UptrainError(
        f"cannot resume {what}: its settings changed ({'; '.join(map(str, changes))}); rerun with the earlier "
        f"{earlier} to continue it, or pass --overwrite to start over (or use another {place})"
    )


def unreadable_record(problem: str, place: str) -> UptrainError:
    """The refusal of a folder whose record cannot be read (`problem` names the file and what is
    wrong with it): nothing says what the work was, so nothing is continued or deleted."""
    return UptrainError(f"cannot resume: {problem}; use another {place} or --overwrite")


def flatten(settings: Mapping, prefix: str = "") -> dict:
    """Nested settings as dotted keys: {"conversion": {"grouping": g}} → {"conversion.grouping": g}."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + str(key)] = value
    return flat


def settled(value: Any) -> Any:
    """`value` as an identity compares it: lists and tuples alike (YAML and JSON give lists),
    and a path to a file uptrain ships, or to a folder of its assets (a reference model), as
    `<uptrain>/` and its place in the package, wherever the package was when the path was recorded
    (a moved checkout names the same corpus), and wherever in the package the asset was then
    (`MOVED`: a folder made before the assets moved names the same reference model)."""
    if isinstance(value, (list, tuple)):
        return [settled(v) for v in value]
    if not isinstance(value, str) or not os.path.isabs(value):
        return value
    parts = Path(value).parts
    for i in range(len(parts) - 2, -1, -1):  # the innermost folder of the package's name
        if parts[i] == PACKAGE.name and (place := _shipped(parts[i + 1 :])) is not None:
            return SHIPPED + place
    return value


def _shipped(inner: tuple[str, ...]) -> str | None:
    """The place in the package (`assets/corpus/train.jsonl.gz`) of what `inner`, a path inside a
    package folder, names: a file uptrain ships or a folder of its assets, now or before it moved;
    None when it names neither."""
    if PACKAGE.joinpath(*inner).is_file() or (inner[0] == ASSETS and PACKAGE.joinpath(*inner).is_dir()):
        return "/".join(inner)
    if inner[0] in MOVED and len(inner) > 1 and not PACKAGE.joinpath(*inner).exists():
        now = (MOVED[inner[0]], *inner[1:])
        if PACKAGE.joinpath(*now).exists():
            return "/".join(now)
    return None


def _shown(value: Any) -> str:
    # Digests are told apart by their first 12 hex digits; the whole 64 would drown the message.
    return _DIGEST.sub(lambda m: m[0][:12] + "…", repr(value))
