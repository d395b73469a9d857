"""NaN and ±inf (and numbers past float's range) are refused by every float key of every
command's schema, at parse time, on the command line and in YAML: NaN passes every bound (each
comparison with it is false), and no key means anything by an infinite learning rate, timeout or
fraction. `uptrain train --lr .nan` left run.json and run_config.yaml and ended in the
optimizer's traceback (issue #34, item 7)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from uptrain.cli import COMMANDS, build_parser, main
from uptrain.options import InvalidOptions, keys_of, parse_yaml, validated_values

NOT_FINITE = [".nan", ".NaN", ".inf", "-.inf", "+.inf", "1e999", "-1.0e999", "9" * 400]


def float_keys(schema: type) -> list:
    return [k for k in keys_of(schema) if float in typing.get_args(k.annotation) or k.annotation is float]


def stand_in(key) -> str:
    """A value of the right type for a required key, so that the command line parses."""
    members = typing.get_args(key.annotation) or (key.annotation,)
    return "1" if int in members else "x"


CASES = [(command, key.name) for command in COMMANDS for key in float_keys(COMMANDS[command].schema())]


def test_every_command_with_float_keys_is_covered():
    assert {command for command, _ in CASES} >= {"train", "compare", "speed"}
    assert ("train", "lr") in CASES and ("train", "uptrain_fraction") in CASES


@pytest.mark.parametrize("command, name", CASES)
def test_a_float_flag_that_is_not_finite_is_refused_at_parse(command, name):
    schema = COMMANDS[command].schema()
    argv = [command]
    for key in keys_of(schema):
        if key.required and key.option.flag and key.name != name:
            argv += [stand_in(key)] if key.option.positional else [f"--{key.name}", stand_in(key)]
    for text in NOT_FINITE:
        args = build_parser(command).parse_args(argv + [f"--{name}={text}"])  # `=`: argparse takes -.inf for a flag
        with pytest.raises(InvalidOptions) as err:
            COMMANDS[command].options(args, command)
        assert f"`{name}`: must be a finite number" in str(err.value), (text, str(err.value))


@pytest.mark.parametrize("command, name", CASES)
def test_a_float_yaml_value_that_is_not_finite_is_refused(command, name):
    schema = COMMANDS[command].schema()
    listed = typing.get_origin(next(k for k in keys_of(schema) if k.name == name).annotation) is list
    for text in NOT_FINITE:
        values = parse_yaml(f"{name}: {f'[{text}]' if listed else text}\n", "config.yaml")  # a list key: one entry
        with pytest.raises(InvalidOptions) as err:
            validated_values(schema, values, command, "config.yaml")
        assert f"`{name}`: must be a finite number" in str(err.value), (text, str(err.value))


def test_finite_values_still_read(tmp_path):
    schema = COMMANDS["train"].schema()
    args = build_parser("train").parse_args(["train", "--lr", "3e-4"])
    assert "`lr`" not in _problems(lambda: COMMANDS["train"].options(args, "train"))
    assert "`max_grad_norm`" not in _problems(lambda: validated_values(schema, {"max_grad_norm": 1e300}, "train"))


def _problems(call) -> str:
    with pytest.raises(InvalidOptions) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("where", ["flag", "yaml"])
def test_train_with_a_nan_learning_rate_writes_nothing(tmp_path, base_config, capsys, where):
    out = Path(base_config["output_dir"])
    config = {k: v for k, v in base_config.items() if k != "lr"}
    if where == "yaml":
        path = tmp_path / "config.yaml"
        path.write_text(
            "".join(f"{k}: {v!r}\n" if not isinstance(v, str) else f"{k}: '{v}'\n" for k, v in config.items())
            + "lr: .nan\n"
        )
        argv = ["train", "--config", str(path)]
    else:
        argv = ["train", "--lr", ".nan"] + [
            f"--{k}={v if not isinstance(v, list) else v[0]}" for k, v in config.items()
        ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`lr`: must be a finite number (got nan)" in err, err
    assert not out.exists()
