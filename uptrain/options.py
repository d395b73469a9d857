"""Command options declared once: a schema gives each command its flags, defaults, choices, help
and validation.

A schema is a stdlib dataclass (`@dataclass(kw_only=True)`, subclassing `Schema`) whose fields
are declared with `option(...)`: the default, the help text, the checks and how the flag is
spelled. `add_arguments` turns a schema into argparse flags; `from_args` and `validated` build
it, refusing unknown keys and naming every bad value in one line (`InvalidOptions`). A new
command is such a schema plus a plain function taking it (see `uptrain/cli.py`).

Stdlib only, and nothing imported until used: `uptrain convert` validates its arguments before
the first byte is read, so its schema's imports are part of every conversion's start-up
(pydantic's were a measured share of it, BENCHMARKS.md). `TrainConfig` stays pydantic and
embeds the conversion and budget schemas' keys (`uptrain/train/config.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Union

from uptrain import UptrainError

REQUIRED: Any = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Option:
    """How one key is spelled on the command line and checked, beside its type and default."""

    help: str
    flags: tuple[str, ...] = ()  # further spellings, e.g. "-g"
    metavar: str | None = None
    positional: bool = False
    # Allowed values; a callable is asked only when a parser is built or a value checked (it may
    # import what lists them). A mapping's values describe each choice in --help.
    choices: Sequence[str] | Mapping[str, str] | Callable[[], Sequence[str] | Mapping[str, str]] | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    check: Callable[[Any], str | None] | None = None  # a problem with the value (each item of a list), or None
    group: str | None = None  # title of the --help section the flag is listed in
    flag: bool = True  # False: a key for other callers (train, compare) that the command line does not set
    # For a nested schema: which of its keys are this command's flags (the rest keep their defaults).
    keys: tuple[str, ...] = ()


def option(default: Any = REQUIRED, **spelling: Any) -> Any:
    """A schema field: `default` (omitted: required) and the `Option` fields as keywords."""
    if isinstance(default, list):  # a fresh list per instance
        return dataclasses.field(default_factory=lambda: list(default), metadata={"option": Option(**spelling)})
    if isinstance(default, type) and issubclass(default, Schema):  # a nested schema at its defaults
        return dataclasses.field(default_factory=default, metadata={"option": Option(**spelling)})
    return dataclasses.field(default=default, metadata={"option": Option(**spelling)})


class Key(NamedTuple):
    """One key of a schema as the parser and the checks see it."""

    name: str
    annotation: Any  # the resolved type
    default: Any  # REQUIRED when required
    option: Option

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


class InvalidOptions(UptrainError):
    """Every problem found in one set of options, reported on one line."""

    def __init__(self, problems: list[str]):
        super().__init__("invalid option: " + "; ".join(problems))


@dataclasses.dataclass(kw_only=True)
class Schema:
    """Base of every options schema: construction checks every field, then `problems()`."""

    def __post_init__(self) -> None:
        found = []
        for key in keys_of(type(self)):
            value = getattr(self, key.name)
            problem, value = key_problem(key, value)
            if problem:
                found.append(f"`{key.name}`: {problem}")
            else:
                object.__setattr__(self, key.name, value)  # ints given for floats become floats
        if not found:
            found = self.problems()
        if found:
            raise InvalidOptions(found)

    def problems(self) -> list[str]:
        """Rules that span several keys; a subclass adds its own (and keeps its bases')."""
        return []

    def to_dict(self) -> dict:
        """The keys and values, nested schemas as nested dicts (JSON-ready)."""
        return dataclasses.asdict(self)


@functools.cache
def keys_of(schema: type) -> tuple[Key, ...]:
    """The keys of a schema class, in declaration order (a base class's first)."""
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED)
        )
        keys.append(Key(f.name, hints[f.name], default, f.metadata.get("option") or Option(help="")))
    return tuple(keys)


def choices_of(option: Option) -> Sequence[str] | Mapping[str, str] | None:
    return option.choices() if callable(option.choices) else option.choices


# Checking values.


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _list_item(annotation: Any) -> Any | None:
    """X for list[X] among the members of `annotation`, else None."""
    for member in _members(annotation):
        if typing.get_origin(member) is list:
            return typing.get_args(member)[0]
    return None


def _describe(annotation: Any) -> str:
    words = []
    for m in _members(annotation):
        if typing.get_origin(m) is Literal:
            words.append("one of " + ", ".join(repr(a) for a in typing.get_args(m)))
        elif typing.get_origin(m) is list:
            words.append(f"a list of ({_describe(typing.get_args(m)[0])})")
        else:
            words.append(
                {bool: "true or false", int: "a whole number", float: "a number", str: "text", type(None): "null"}.get(
                    m, getattr(m, "__name__", str(m))
                )
            )
    return " or ".join(words)


def _fits(annotation: Any, value: Any) -> tuple[bool, Any]:
    """Whether `value` is of type `annotation`, and the value to keep (an int given for a float
    becomes a float)."""
    for m in _members(annotation):
        origin = typing.get_origin(m)
        if m is type(None) and value is None or m is bool and isinstance(value, bool):
            return True, value
        if m is int and isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if m is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if m is str and isinstance(value, str):
            return True, value
        if origin is Literal and any(value == a and type(value) is type(a) for a in typing.get_args(m)):
            return True, value
        if origin is list and isinstance(value, list):
            items = [_fits(typing.get_args(m)[0], v) for v in value]
            if all(ok for ok, _ in items):
                return True, [v for _, v in items]
        if isinstance(m, type) and issubclass(m, Schema) and isinstance(value, m):
            return True, value
    return False, value


def _bound(limit: float) -> str:
    return str(limit) if isinstance(limit, int) else f"{limit:g}"  # 4294967295, not 4.29497e+09


def key_problem(key: Key, value: Any) -> tuple[str | None, Any]:
    """(what is wrong with `value` for `key` or None, the value to keep)."""
    ok, value = _fits(key.annotation, value)
    if not ok:
        return f"must be {_describe(key.annotation)}, not {value!r}", value
    if value is None or isinstance(value, (bool, Schema)):
        return None, value
    o = key.option
    for item in value if isinstance(value, list) else [value]:
        allowed = choices_of(o)
        if allowed is not None and item not in allowed:
            return f"unknown {key.name} {item!r}; choose from {', '.join(sorted(allowed))}", value
        if isinstance(item, (int, float)):
            if o.at_least is not None and item < o.at_least:
                return f"must be at least {_bound(o.at_least)} (got {item!r})", value
            if o.above is not None and item <= o.above:
                return f"must be more than {_bound(o.above)} (got {item!r})", value
            if o.at_most is not None and item > o.at_most:
                return f"must be at most {_bound(o.at_most)} (got {item!r})", value
        if o.check is not None and (problem := o.check(item)):
            return problem, value
    return None, value


def validated(schema: type[Schema], command: str | None = None, **values: Any) -> Any:
    """`schema(**values)`, refusing unknown and missing keys; raises one InvalidOptions naming
    every offending key (and, for an unknown one, the `--help` of `command` that lists them)."""
    keys = {k.name: k for k in keys_of(schema)}
    see = f" (see `uptrain {command} --help`)" if command else ""
    problems = [f"unknown key `{name}`{see}" for name in values if name not in keys]
    problems += [f"`{k.name}` is required" for k in keys.values() if k.required and k.name not in values]
    if problems:
        raise InvalidOptions(problems)
    return schema(**values)


# Flags.


def flag_keys(schema: type[Schema]) -> list[Key]:
    """The keys of `schema` that are flags, nested schemas' chosen keys in their place."""
    found = []
    for key in keys_of(schema):
        if not key.option.flag:
            continue
        if isinstance(key.annotation, type) and issubclass(key.annotation, Schema):
            nested = {k.name: k for k in keys_of(key.annotation)}
            group = key.option.help or None
            found += [
                k._replace(option=dataclasses.replace(k.option, group=group))
                for k in (nested[name] for name in key.option.keys)
            ]
        else:
            found.append(key)
    return found


def _help(key: Key, file_keys: bool) -> str:
    text = key.option.help
    allowed = choices_of(key.option)
    if isinstance(allowed, Mapping):
        text += " (" + "; ".join(f"{name}: {what}" for name, what in allowed.items()) + ")"
    if key.required:
        return text + ("" if key.option.positional else " [required]")
    shown = " ".join(map(str, key.default)) if isinstance(key.default, list) else key.default
    if key.default is None or key.default is False and not file_keys:
        return text
    return f"{text} (default: {shown})"


def _parse_flag_value(text: str) -> Any:
    # YAML scalars, so that `--lr 3e-4`, `--max_grad_norm null` and `--resume true` mean what they
    # mean in a config file.
    import yaml

    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, TypeError, AttributeError, LookupError, ArithmeticError, RecursionError):
        # Not a YAML scalar (or past Python's 4300 digits, or nested too deeply): the text itself,
        # which the schema then refuses in one line naming the key.
        return text


def _is_text(annotation: Any) -> bool:
    """Keys whose flag value is taken verbatim (a path named `123` or `no` stays text)."""
    return any(m is str or typing.get_origin(m) is Literal for m in _members(annotation))


def add_arguments(
    parser: argparse.ArgumentParser, keys: Iterable[Key], file_keys: bool = False, group: str | None = None
) -> None:
    """One flag per key. Plain (`uptrain convert`): `--num-kv-heads`, argparse types and choices,
    `--overwrite` alone for true, required keys required. With `file_keys` (`uptrain train`, whose
    keys can come from a YAML file): `--seq_len` and `--seq-len`, values read as YAML scalars and
    checked by the schema, `--resume [BOOL]`, and nothing required of the command line. Absent
    flags set nothing, so that the schema's defaults (or the file's values) apply. Keys without a
    group of their own are listed under `group` (a title), else among the parser's options."""
    groups: dict[str | None, Any] = {None: parser.add_argument_group(group) if group else parser}
    for key in keys:
        o = key.option
        target = groups.get(o.group) or groups.setdefault(o.group, parser.add_argument_group(o.group))
        kwargs: dict[str, Any] = dict(help=_help(key, file_keys), default=argparse.SUPPRESS)
        item = _list_item(key.annotation)
        if o.positional:
            more = {"nargs": "+"} if item is not None else {}  # `uptrain speed MODEL [MODEL …]`
            target.add_argument(key.name, metavar=o.metavar or key.name, help=kwargs["help"], **more)
            continue
        dashed = "--" + key.name.replace("_", "-")
        if file_keys:
            flags = [f"--{key.name}"] + ([dashed] if "_" in key.name else [])
            kwargs.update(dest=key.name, metavar=o.metavar or key.name.upper())
            if key.annotation is bool:  # `--resume` alone means true; `--resume false` works too
                kwargs.update(nargs="?", const=True, type=_parse_flag_value, metavar="BOOL")
            elif item is not None:
                kwargs.update(nargs="+")
                if not _is_text(item):
                    kwargs.update(type=_parse_flag_value)
            elif not _is_text(key.annotation):
                kwargs.update(type=_parse_flag_value)
        else:
            flags = [dashed, *o.flags]
            kwargs.update(dest=key.name, required=key.required)
            if key.annotation is bool:
                kwargs.update(action="store_true")
            else:
                # One value per flag unless the key takes only lists: `--calibration-data FILE`
                # must not swallow the positional SRC OUT that may follow it.
                one = key.annotation if item is None or str in _members(key.annotation) else item
                if item is not None and one is item:
                    kwargs.update(nargs="+")
                members = [m for m in _members(one) if m is not type(None)]
                literal = next((m for m in members if typing.get_origin(m) is Literal), None)
                allowed = choices_of(o) or (typing.get_args(literal) if literal is not None else None)
                if allowed is not None and "nargs" not in kwargs:  # a list's values: checked by the schema
                    kwargs.update(choices=list(allowed))
                if str not in members and (int in members or float in members):
                    kwargs.update(type=int if int in members else float)
                if o.metavar:
                    kwargs.update(metavar=o.metavar)
        target.add_argument(*flags, **kwargs)


def given(args: argparse.Namespace, keys: Iterable[Key]) -> dict[str, Any]:
    """The values of `keys` given on the command line (a `str | list[str]` key given one value is
    that value)."""
    values = {}
    for key in keys:
        if hasattr(args, key.name):
            value = getattr(args, key.name)
            if isinstance(value, list) and len(value) == 1 and str in _members(key.annotation):
                value = value[0]
            values[key.name] = value
    return values


def from_args(schema: type[Schema], args: argparse.Namespace, command: str) -> Any:
    """The validated schema of a parsed command line (`add_arguments(parser, flag_keys(schema))`)."""
    values = given(args, [k for k in keys_of(schema) if k.option.flag])
    for key in keys_of(schema):
        if key.option.flag and isinstance(key.annotation, type) and issubclass(key.annotation, Schema):
            nested = given(args, [k for k in keys_of(key.annotation) if k.name in key.option.keys])
            values[key.name] = validated(key.annotation, command, **nested)
    return validated(schema, command, **values)
