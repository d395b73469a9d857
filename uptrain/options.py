"""Command options declared once: a schema gives each command its flags, YAML keys, defaults,
choices, help and validation. Every command's options are such a schema, `TrainConfig` too.

A schema is a stdlib dataclass (`@dataclass(kw_only=True)`, subclassing `Schema`) whose fields
are declared with `option(...)`: the default, the help text, the checks and how the flag is
spelled. Schemas are built from groups of keys by inheritance, and the keys stay flat (YAML keys,
flags and `to_dict()` alike): `TrainConfig` is its data, step, optimizer, budget and conversion
groups plus its own keys, and `CompareSpec` embeds the same groups. A key another schema
declares can be taken over with a default of one's own (`option_like`), bounds and checks kept.

`add_arguments` turns a schema's keys into argparse flags (each as `--snake_case` and
`--kebab-case`); `from_args`, `validated` and `load` build it, refusing unknown keys and naming
every bad value in one line (`InvalidOptions`, the one formatter of every command). A new command
is such a schema plus a plain function taking it (see `uptrain/cli.py`).

Stdlib only, and nothing imported until used: `uptrain convert` validates its arguments before
the first byte is read, so its schema's imports are part of every conversion's start-up
(pydantic's were a measured share of it, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union

from uptrain import UptrainError
from uptrain.strict_json import too_many_digits

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
    below: float | None = None
    check: Callable[[Any], str | None] | None = None  # a problem with the value (each item of a list), or None
    # The value as the key means it, before its type is checked (`report_to: wandb` is a list of
    # one); raises ValueError with the problem where no reading fits.
    before: Callable[[Any], Any] | None = None
    group: str | None = None  # title of the --help section the flag is listed in
    flag: bool = True  # False: a key for other callers (train, compare) that the command line does not set


def option(default: Any = REQUIRED, **spelling: Any) -> Any:
    """A schema field: `default` (omitted: required) and the `Option` fields as keywords."""
    return _field(default, Option(**spelling))


def _field(default: Any, spelling: Option) -> Any:
    if isinstance(default, list):  # a fresh list per instance
        return dataclasses.field(default_factory=lambda: list(default), metadata={"option": spelling})
    return dataclasses.field(default=default, metadata={"option": spelling})


def option_like(schema: type, name: str, default: Any = REQUIRED, **changes: Any) -> Any:
    """A field that is `schema`'s key `name` (its help, bounds, choices and checks) with a
    default of its own and any `Option` fields in `changes`: how a command embeds another's key
    without restating it (`uptrain compare`'s `seq_len` is `uptrain train`'s, default 256)."""
    key = next(k for k in keys_of(schema) if k.name == name)
    return _field(default, dataclasses.replace(key.option, **changes))


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
    """Every problem found in one set of options, reported on one line: `invalid option: …`
    (flags), `invalid config: …` (`uptrain train`, whose keys also come from YAML), after the
    file they came from when there is one. The one formatter of every command's options."""

    def __init__(self, problems: list[str], what: str = "option", where: str | Path | None = None):
        self.problems = problems
        super().__init__((f"{where}: " if where else "") + f"invalid {what}: " + "; ".join(problems))


@dataclasses.dataclass(kw_only=True)
class Schema:
    """Base of every options schema: construction checks every field, then `problems()`."""

    # What the keys are called in messages: options (flags) or config (YAML keys and flags).
    WHAT = "option"

    def __post_init__(self) -> None:
        found = []
        for key in keys_of(type(self)):
            problem, value = key_problem(key, getattr(self, key.name))
            if problem:
                found.append(f"`{key.name}`: {problem}")
            else:
                object.__setattr__(self, key.name, value)  # ints given for floats become floats
        if not found:
            found = self.problems()
        if found:
            raise InvalidOptions(found, self.WHAT)

    def problems(self) -> list[str]:
        """Rules that span several keys; a group adds its own and keeps its bases' (`super()`)."""
        return []

    def to_dict(self) -> dict:
        """The keys and values, in declaration order (JSON-ready)."""
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


def names_of(*schemas: type) -> tuple[str, ...]:
    """The key names of `schemas`, in order: what a group contributes to a schema built on it."""
    return tuple(k.name for schema in schemas for k in keys_of(schema))


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


# A number written in a form YAML 1.1 reads as text (`3e-4`, `1e6`, `2.0e12` without the exponent's
# sign): for a key that takes a number it is that number, as in YAML 1.2 and Python.
_NUMBER = re.compile(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?")


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
            return True, _as_float(value)
        if m is str and isinstance(value, str):
            return True, value
        if origin is Literal and any(value == a and type(value) is type(a) for a in typing.get_args(m)):
            return True, value
        if origin is list and isinstance(value, list):
            items = [_fits(typing.get_args(m)[0], v) for v in value]
            if all(ok for ok, _ in items):
                return True, [v for _, v in items]
    if float in _members(annotation) and isinstance(value, str) and len(value) < 100 and _NUMBER.fullmatch(value):
        return True, float(value.replace("_", ""))
    return False, value


def _as_float(value: int | float) -> float:
    # An integer past float's range (a 400-digit one) is as unbounded as inf, and refused as it is.
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _bound(limit: float) -> str:
    return str(limit) if isinstance(limit, int) else f"{limit:g}"  # 4294967295, not 4.29497e+09


def key_problem(key: Key, value: Any) -> tuple[str | None, Any]:
    """(what is wrong with `value` for `key` or None, the value to keep)."""
    o = key.option
    if o.before is not None:
        try:
            value = o.before(value)
        except ValueError as err:
            return str(err), value
    ok, value = _fits(key.annotation, value)
    if not ok:
        return f"must be {_describe(key.annotation)}, not {value!r}", value
    if value is None or isinstance(value, bool):
        return None, value
    for item in value if isinstance(value, list) else [value]:
        allowed = choices_of(o)
        if allowed is not None and item not in allowed:
            return f"unknown {key.name} {item!r}; choose from {', '.join(sorted(allowed))}", value
        if isinstance(item, float) and not math.isfinite(item):
            # NaN passes every bound (each comparison is false) and ±inf makes no key's sense: a
            # learning rate, a timeout, a fraction. Refused here, before anything is written.
            return f"must be a finite number (got {item!r})", value
        if isinstance(item, (int, float)):
            if o.at_least is not None and item < o.at_least:
                return f"must be at least {_bound(o.at_least)} (got {item!r})", value
            if o.above is not None and item <= o.above:
                return f"must be more than {_bound(o.above)} (got {item!r})", value
            if o.at_most is not None and item > o.at_most:
                return f"must be at most {_bound(o.at_most)} (got {item!r})", value
            if o.below is not None and item >= o.below:
                return f"must be less than {_bound(o.below)} (got {item!r})", value
        if o.check is not None and (problem := o.check(item)):
            return problem, value
    return None, value


def validated_values(
    schema: type[Schema], values: Mapping[str, Any], command: str | None = None, where: str | Path | None = None
) -> Any:
    """`schema(**values)`, refusing unknown and missing keys; raises one InvalidOptions naming
    every offending key (and, for an unknown one, the `--help` of `command` that lists them;
    `where`: the file the values came from)."""
    keys = {k.name: k for k in keys_of(schema)}
    see = f" (see `uptrain {command} --help`)" if command else ""
    # An unknown key is most likely a misspelt one: named alone, the others' problems may be its.
    problems = [f"unknown key `{name}`{see}" for name in values if name not in keys]
    if not problems:  # each missing key and each bad value, in the schema's order
        for key in keys.values():
            if key.name not in values:
                problems += [f"`{key.name}` is required"] if key.required else []
            elif problem := key_problem(key, values[key.name])[0]:
                problems.append(f"`{key.name}`: {problem}")
    if problems:
        raise InvalidOptions(problems, schema.WHAT, where)
    try:
        return schema(**values)
    except InvalidOptions as err:
        if where is None:
            raise
        raise InvalidOptions(err.problems, schema.WHAT, where) from None


def validated(schema: type[Schema], command: str | None = None, **values: Any) -> Any:
    """`validated_values` with the values as keywords."""
    return validated_values(schema, values, command)


# Config files: YAML mappings of keys (`uptrain train --config FILE`), and every other YAML a
# command reads (lm-eval task files, model-card front matter, a run's run_config.yaml): all of
# them through `read_yaml`/`parse_yaml`, the one loader.

# What PyYAML's constructors raise, beside YAMLError, on values its own resolver let through.
YAML_CONSTRUCTION_ERRORS = (ValueError, TypeError, AttributeError, LookupError, ArithmeticError)
MAX_CONFIG_BYTES = 1 << 20  # a config is a page of keys; anything larger is not one, and parsing it costs
# A document's size with every alias written out (a node each, and each scalar's characters):
# what a file of MAX_CONFIG_BYTES could hold without aliases. Aliases alone cost nothing to
# parse, but a "billion laughs" of nested ones is 10^9 values to whatever walks or writes them.
MAX_EXPANDED_YAML = MAX_CONFIG_BYTES


def read_yaml(path: Path, *, ignore_tags: bool = False) -> Any:
    """The YAML document in `path`; anything that is not a config file is one UptrainError.
    `ignore_tags`: a tag (`!function utils.process`) reads as null rather than being refused
    (lm-eval's task files use them; they matter to lm-eval only)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # read no more than the bound, whatever the file holds
    except OSError as err:
        raise UptrainError(f"cannot read {path}: {err.strerror or err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UptrainError(f"{path} is larger than a config can be ({MAX_CONFIG_BYTES // 2**20} MiB)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UptrainError(f"{path} is not UTF-8 text (byte {err.start})") from None
    return parse_yaml(text, path, ignore_tags=ignore_tags)


def parse_yaml(text: str, where: str | Path, *, ignore_tags: bool = False) -> Any:
    """The YAML document `text` (from `where`, for messages), with its aliases expanding to no
    more than MAX_EXPANDED_YAML and none referring to itself; else one UptrainError."""
    import yaml

    loader = None
    try:
        loader = _loader(ignore_tags)(text)  # its reader refuses control characters at once
        node = loader.get_single_node()
        if node is None:
            return None
        if problem := _expansion_problem(node):
            raise UptrainError(f"{where}: {problem}")
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise UptrainError(f"{where} is not valid YAML: {_first_line(err)}") from None
    except YAML_CONSTRUCTION_ERRORS as err:  # past Python's 4300 digits; 2024-13-01; `!!int` on nothing
        if too_many_digits(err):
            raise UptrainError(f"{where}: {too_many_digits(err)}") from None
        raise UptrainError(f"{where} is not valid YAML: {_first_line(err)}") from None
    except RecursionError:
        raise UptrainError(f"{where} is not valid YAML (nested too deeply)") from None
    finally:
        if loader is not None:
            loader.dispose()


@functools.cache
def _loader(ignore_tags: bool) -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    if ignore_tags:
        Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return Loader


def _expansion_problem(root: Any) -> str | None:
    """What is wrong with the composed YAML graph `root` once its aliases are written out: a
    size past MAX_EXPANDED_YAML, or an alias inside its own anchor (an endless value). A
    post-order walk that sizes each node once, however many aliases share it."""
    sizes: dict[int, int] = {}  # id(node) -> its size written out
    open_nodes: set[int] = set()  # the nodes whose walk is under way: the path from the root
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = _yaml_children(node)
        if children_done:
            open_nodes.discard(id(node))
            size = sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children) + _scalar_size(node)
            if size > MAX_EXPANDED_YAML:
                return (
                    f"its aliases expand to more than a config can hold ({MAX_EXPANDED_YAML} values and "
                    "characters written out); write the values out or use fewer aliases"
                )
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            return "an alias refers to the value it is inside of (an endless value)"
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return None


def _yaml_children(node: Any) -> list:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _scalar_size(node: Any) -> int:
    import yaml

    return len(node.value) if isinstance(node, yaml.ScalarNode) else 0


def _first_line(err: Exception) -> str:
    # The first line of a parser's message (the rest points into the text); its type where the
    # message is empty, as a bare `ValueError()` is.
    lines = str(err).splitlines()
    return lines[0] if lines else type(err).__name__


def load(schema: type[Schema], path: str | Path | None, overrides: Mapping[str, Any], command: str) -> Any:
    """The keys of a YAML file (optional) with `overrides` on top, validated. Raises UptrainError."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UptrainError(f"config file {path} does not exist")
        loaded = read_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise UptrainError(f"{path} must hold a mapping of config keys, not {type(loaded).__name__}")
        if bad := [k for k in loaded or {} if not isinstance(k, str)]:  # `1: x`, `? [a]: x`, a bare `?`
            raise UptrainError(f"{path}: config keys are names, not {bad[0]!r}")
        values.update(loaded or {})
    values.update(overrides)
    return validated_values(schema, values, command, path)


# Flags.


def flag_keys(schema: type[Schema]) -> list[Key]:
    """The keys of `schema` that are flags."""
    return [key for key in keys_of(schema) if key.option.flag]


def _help(key: Key) -> str:
    text = key.option.help
    allowed = choices_of(key.option)
    if isinstance(allowed, Mapping):
        text += " (" + "; ".join(f"{name}: {what}" for name, what in allowed.items()) + ")"
    if key.required:
        return text + ("" if key.option.positional else " [required]")
    if key.default is None or key.default == []:  # nothing to show: the help says what none means
        return text
    shown = " ".join(map(str, key.default)) if isinstance(key.default, list) else key.default
    return f"{text} (default: {shown})"


def _parse_flag_value(text: str) -> Any:
    # YAML scalars, so that `--lr 3e-4`, `--max_grad_norm null` and `--resume true` mean on the
    # command line what they mean in a config file.
    try:
        return parse_yaml(text, "the flag's value")
    except UptrainError:
        # Not a YAML scalar (or past Python's 4300 digits, nested too deeply, or aliases past the
        # bound): the text itself, which the schema then refuses in one line naming the key.
        return text


def _is_text(annotation: Any) -> bool:
    """Keys whose flag value is taken verbatim (a path named `123` or `no` stays text)."""
    return any(m is str or typing.get_origin(m) is Literal for m in _members(annotation))


def _literal_metavar(annotation: Any) -> str | None:
    """`{line,paragraph,document}` for a key that takes one of fixed words (true/false among them),
    as argparse writes choices."""
    words = [a for m in _members(annotation) if typing.get_origin(m) is Literal for a in typing.get_args(m)]
    words += ["true", "false"] if bool in _members(annotation) else []
    return "{" + ",".join(map(str, words)) + "}" if words else None


def spellings(key: Key) -> list[str]:
    """A key's flags: `--seq_len` and `--seq-len` (one where they agree), then its short ones."""
    names = [f"--{key.name}"] + ([f"--{key.name.replace('_', '-')}"] if "_" in key.name else [])
    return names + list(key.option.flags)


def add_arguments(
    parser: argparse.ArgumentParser, keys: Iterable[Key], group: str | None = None, file_keys: bool = False
) -> None:
    """One flag per key, the same way for every command: `--seq_len` and `--seq-len` both; the
    value read as a YAML scalar (`--lr 3e-4`, `--max_grad_norm null`) unless the key takes text,
    and checked by the schema, so that a bad one is the schema's one-line message; a list key
    takes several values; a true/false key alone means true. Where positional arguments follow
    the flags (`uptrain convert --overwrite SRC OUT`) a flag takes no more than its own value: a
    true/false key no value, a key that takes text or a list of it one. Absent flags set nothing,
    so that the schema's defaults (or the file's values) apply; required keys are required of the
    command line unless `file_keys` (they may come from a config file). Keys without a group of
    their own are listed under `group` (a title), else among the parser's options."""
    keys = list(keys)
    bounded = any(k.option.positional for k in keys)
    groups: dict[str | None, Any] = {None: parser.add_argument_group(group) if group else parser}
    for key in keys:
        o = key.option
        target = groups.get(o.group) or groups.setdefault(o.group, parser.add_argument_group(o.group))
        item = _list_item(key.annotation)
        if o.positional:
            more = {"nargs": "+"} if item is not None else {}  # `uptrain speed MODEL [MODEL …]`
            target.add_argument(key.name, metavar=o.metavar or key.name, help=_help(key), **more)
            continue
        kwargs: dict[str, Any] = dict(
            help=_help(key),
            default=argparse.SUPPRESS,
            dest=key.name,
            metavar=o.metavar or _literal_metavar(item if item is not None else key.annotation) or key.name.upper(),
            required=key.required and not file_keys,
        )
        if key.annotation is bool:
            if bounded:
                kwargs = {k: v for k, v in kwargs.items() if k != "metavar"} | {"action": "store_true"}
            else:  # `--resume` alone means true; `--resume false` works too
                kwargs.update(nargs="?", const=True, type=_parse_flag_value, metavar="BOOL")
        else:
            one = item if item is not None and not (bounded and str in _members(key.annotation)) else None
            if one is not None:
                kwargs.update(nargs="+")
            if not _is_text(one if one is not None else key.annotation):
                kwargs.update(type=_parse_flag_value)
        target.add_argument(*spellings(key), **kwargs)


CONFIG_TITLE = "config keys (each also a YAML key; flags override the file)"


def add_schema_arguments(parser: argparse.ArgumentParser, schema: type[Schema], config_file: bool = False) -> None:
    """The flags of a command: one per key of `schema`; with `config_file`, `--config FILE.yaml`
    first, whose keys the flags override (`from_args(..., config=args.config)`)."""
    if config_file:
        parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of config keys; flags override it")
    add_arguments(parser, flag_keys(schema), group=CONFIG_TITLE if config_file else None, file_keys=config_file)


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


def from_args(schema: type[Schema], args: argparse.Namespace, command: str, config: str | Path | None = None) -> Any:
    """The validated schema of a parsed command line (`add_arguments(parser, flag_keys(schema))`),
    on top of the keys of the YAML file `config` when one is given."""
    values = given(args, flag_keys(schema))
    if config is not None:
        return load(schema, config, values, command)
    return validated_values(schema, values, command)
