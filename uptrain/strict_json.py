"""JSON from files a user gave (configs, indexes, headers, run files), where anything
malformed is one UptrainError rather than a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from uptrain import UptrainError


def parse_json(raw: bytes | str, what: str, unique_keys: bool = True):
    """JSON from a file a user gave; anything malformed is one UptrainError naming `what`.

    With `unique_keys`, a key given twice is refused (json keeps the last one and hides the
    first: two tensors of one name in a safetensors header). Nesting deep enough to exhaust
    Python's recursion limit is refused too.
    """

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
        obj: dict = {}
        for key, value in pairs:
            if key in obj:
                raise UptrainError(f"{what}: the key {key!r} appears twice")
            obj[key] = value
        return obj

    try:
        return json.loads(raw, object_pairs_hook=no_duplicates if unique_keys else None)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's 4300 digits
        if too_many_digits(err):
            raise UptrainError(f"{what}: {too_many_digits(err)}") from None
        raise UptrainError(f"{what} is not valid JSON ({str(err).splitlines()[0]})") from None
    except RecursionError:
        raise UptrainError(f"{what} is not valid JSON (nested too deeply)") from None


def read_json(path: Path, unique_keys: bool = True):
    """`parse_json` of a file; an unreadable file is one UptrainError too."""
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise UptrainError(f"cannot read {path}: {err.strerror or err}") from None
    return parse_json(raw, str(path), unique_keys)


def too_many_digits(err: Exception) -> str | None:
    """What to say when a parser (json, PyYAML) met an integer longer than Python reads, else None."""
    if isinstance(err, ValueError) and "integer string conversion" in str(err):
        return f"a number has more digits than Python reads ({sys.get_int_max_str_digits()})"
    return None
