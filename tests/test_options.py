"""Commands from schemas (`uptrain.options`): every key in `--help` with its default, every flag
as `--snake_case` and `--kebab-case`, one-line refusals naming every bad key, compare embedding
train's keys with their bounds, and no pydantic or train module on `uptrain convert`'s start-up."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.convert.tiny_models import build_model, save
from uptrain.cli import COMMANDS, build_parser
from uptrain.convert.spec import ConversionSpec, conversion_spec
from uptrain.options import InvalidOptions, flag_keys

ROOT = Path(__file__).resolve().parents[1]


def help_entries(command: str, capsys) -> dict[str, str]:
    """`uptrain COMMAND --help` as {first spelling of each flag or positional: its help, one line}."""
    with pytest.raises(SystemExit):
        build_parser(command).parse_args([command, "--help"])
    entries: dict[str, str] = {}
    name = None
    for line in capsys.readouterr().out.splitlines():
        if m := re.match(r"  (-{0,2}[\w-]+)", line):
            name = m.group(1)
            entries[name] = line[m.end() :]
        elif name is not None and line.startswith("    "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def shown(default) -> str:
    return " ".join(map(str, default)) if isinstance(default, list) else str(default)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_every_key_with_its_default(command, capsys):
    keys = flag_keys(COMMANDS[command].schema())
    entries = help_entries(command, capsys)
    assert len(keys) >= 2
    for key in keys:
        flag = (key.option.metavar or key.name) if key.option.positional else f"--{key.name}"
        assert flag in entries, (command, flag, sorted(entries))
        text = entries[flag]
        # argparse wraps after hyphens too (decoder-self): compare without whitespace.
        assert "".join(key.option.help.split()) in "".join(text.split()), (flag, text)
        if key.required:
            assert key.option.positional or "[required]" in text, (flag, text)
        elif key.default not in (None, []):  # no default to show: the help says what none means
            # argparse wraps long lines at spaces and after hyphens (a path like /tmp/ci-clone/…):
            # compare without whitespace.
            assert "".join(f"(default: {shown(key.default)})".split()) in "".join(text.split()), (flag, text)
        else:
            assert "(default: None)" not in text and "(default: )" not in text, (flag, text)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_takes_both_spellings(command):
    """`--seq_len` and `--seq-len` are one flag of every command (convert's `--num_kv_heads` too)."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = {s: a.dest for a in sub._actions for s in a.option_strings}
    for key in flag_keys(COMMANDS[command].schema()):
        if not key.option.positional:
            assert flags[f"--{key.name}"] == flags[f"--{key.name.replace('_', '-')}"] == key.name, (command, key)


def test_both_spellings_mean_the_same():
    for spelling in ("--num_kv_heads", "--num-kv-heads", "-g"):
        args = build_parser("convert").parse_args(["convert", "src", "out", spelling, "2", "--max_shard_size", "1GB"])
        options = COMMANDS["convert"].options(args, "convert")
        assert (options.num_kv_heads, options.max_shard_size) == (2, "1GB")
    for spelling in ("--num_kv_heads", "--num-kv-heads"):
        argv = ["compare", "--model", "m", spelling, "4", "2", "--output_dir", "d", "--max-tokens", "64"]
        spec = COMMANDS["compare"].options(build_parser("compare").parse_args(argv), "compare")
        assert spec.num_kv_heads == [4, 2] and spec.max_tokens == 64
    argv = ["speed", "a", "b", "--new_tokens", "4", "--new-tokens", "5"]
    assert COMMANDS["speed"].options(build_parser("speed").parse_args(argv), "speed").new_tokens == 5


def test_flag_spellings_that_scripts_use():
    args = build_parser("convert").parse_args(["convert", "src", "out", "-g", "2", "--calibration-data", "f.txt"])
    options = COMMANDS["convert"].options(args, "convert")
    assert (options.source, options.out, options.num_kv_heads, options.calibration_data) == ("src", "out", 2, "f.txt")
    assert options.pooling == "mean" and options.max_shard_size == "5GB" and options.overwrite is False
    assert options.spec() == conversion_spec(source="src", num_kv_heads=2, calibration_data="f.txt")
    args = build_parser("convert").parse_args(["convert", "--num-kv-heads", "4", "--overwrite", "a", "b"])
    assert COMMANDS["convert"].options(args, "convert").overwrite is True
    compare = ["compare", "--model", "m", "--num-kv-heads", "4", "2", "--output-dir", "d", "--max-tokens", "64"]
    spec = COMMANDS["compare"].options(build_parser("compare").parse_args(compare), "compare")
    assert spec.num_kv_heads == [4, 2] and spec.pooling == ["mean", "first", "random"] and spec.max_tokens == 64


def test_every_bad_key_named_on_one_line():
    with pytest.raises(InvalidOptions) as err:
        conversion_spec(source="s", num_kv_heads="2", pooling="meen", calibration_tokens=0, bogus=1)
    assert str(err.value) == "invalid option: unknown key `bogus` (see `uptrain convert --help`)"
    with pytest.raises(InvalidOptions) as err:
        conversion_spec(source="s", num_kv_heads="2", pooling="meen", calibration_tokens=0, max_shard_size="5XB")
    message = str(err.value)
    assert "\n" not in message and message.startswith("invalid option: ")
    for part in (
        "`num_kv_heads`: must be a whole number or null, not '2'",
        "`pooling`: unknown pooling 'meen'",
        "`calibration_tokens`: must be at least 1 (got 0)",
        "`max_shard_size`: cannot read size '5XB'",
    ):
        assert part in message, message
    with pytest.raises(InvalidOptions, match="`source` is required"):
        conversion_spec(num_kv_heads=2)
    with pytest.raises(InvalidOptions, match="give exactly one of -g/--num-kv-heads G, --kv-heads-per-layer"):
        conversion_spec(source="s")
    assert conversion_spec(source="s", num_kv_heads=2, calibration_data=["a", "b"]).calibration_data == ["a", "b"]
    assert isinstance(conversion_spec(source="s", num_kv_heads=2), ConversionSpec)


def test_train_embeds_the_conversion_keys_and_their_checks(tmp_path):
    from uptrain import UptrainError
    from uptrain.convert.spec import ConversionOptions
    from uptrain.options import keys_of
    from uptrain.train.config import TrainConfig, load_config

    train_keys = {k.name: k for k in keys_of(TrainConfig)}
    for key in keys_of(ConversionOptions):
        assert train_keys[key.name] == key  # the same key: type, default, help, checks
    values = {
        "source": "s",
        "num_kv_heads": 2,
        "train_data": "t",
        "eval_data": "e",
        "output_dir": "o",
        "seq_len": 8,
        "batch_size": 1,
        "lr": 1.0,
        "max_steps": 1,
    }
    with pytest.raises(UptrainError) as err:
        load_config(None, {**values, "pooling": "meen", "calibration_device": "gpu"})
    assert "`pooling`: unknown pooling 'meen'" in str(err.value)
    assert "`calibration_device`: 'gpu' is not auto, cpu, cuda or cuda:N" in str(err.value)
    spec = load_config(None, {**values, "grouping": "similarity"}).conversion_spec()
    assert (spec.source, spec.grouping, spec.calibration_data, spec.calibration_seq_len) == ("s", "similarity", "t", 8)


def test_compare_embeds_train_keys_with_their_bounds():
    from uptrain.compare.spec import CompareSpec
    from uptrain.options import keys_of
    from uptrain.train.config import TrainConfig

    train_keys = {k.name: k for k in keys_of(TrainConfig)}
    shared = [k for k in keys_of(CompareSpec) if k.name in train_keys]
    assert len(shared) >= 40  # data, step, optimizer, budget, execution, reporting, timeouts, conversion
    checks = ("at_least", "above", "at_most", "below", "choices", "check", "before")
    for key in shared:
        train = train_keys[key.name]
        assert [getattr(key.option, c) for c in checks] == [getattr(train.option, c) for c in checks], key.name
        # Several G, budgets, allocations, strategies, targets and latent initialisations to try, each as
        # train takes one; the model is required.
        if key.name not in ("num_kv_heads", "kv_budget", "allocation", "pooling", "target", "mla_init", "model"):
            assert key.annotation == train.annotation, key.name
    values = {"model": "m", "num_kv_heads": [2], "output_dir": "o", "max_steps": 1}
    for bad, message in (
        ({"lr": 0}, "`lr`: must be more than 0 (got 0"),
        ({"adam_beta2": 1}, "`adam_beta2`: must be less than 1 (got 1"),
        ({"seq_len": 1}, "`seq_len`: must be at least 2 (got 1)"),
        ({"num_kv_heads": [2, 0]}, "`num_kv_heads`: must be at least 1 (got 0)"),
        ({"kv_budget": [0.25, 0]}, "`kv_budget`: must be more than 0 (got 0"),
        ({"kv_budget": [0.25], "allocation": ["calibrated", "even"]}, "`allocation`: must be a list of"),
        ({"objective": "causall"}, "`objective`: unknown objective 'causall'; choose from causal, pairs"),
        ({"report_to": ["none", "jsonl"]}, "`report_to: none` cannot be combined"),
    ):
        with pytest.raises(InvalidOptions, match=re.escape(message)):
            CompareSpec(**{**values, **bad})


def test_compare_runs_are_train_configs_of_its_keys(tmp_path):
    from uptrain.compare.spec import TRAINED_ALIKE, CompareSpec
    from uptrain.options import names_of

    spec = CompareSpec(
        model="m", num_kv_heads=[2], output_dir=str(tmp_path / "cmp"), max_steps=3, grad_accum=2, weight_decay=0.0
    )
    config = spec.train_config("converted/g2", tmp_path / "run", "g2-mean", "group")
    assert all(getattr(config, name) == getattr(spec, name) for name in names_of(*TRAINED_ALIKE))
    assert (config.grad_accum, config.weight_decay, config.seq_len, config.lr) == (2, 0.0, 256, 1e-3)
    assert (config.save_every, config.run_name, config.wandb_group) == (10, "cmp/g2-mean", "group")
    assert config.resume is False  # its folder does not exist yet


def test_the_keys_a_compare_rerun_may_change_are_keys():
    from uptrain.compare.spec import CompareSpec
    from uptrain.compare.study import OWN_OPERATIONAL_KEYS, resume_rule
    from uptrain.options import keys_of

    names = {k.name for k in keys_of(CompareSpec)}
    assert OWN_OPERATIONAL_KEYS <= names
    # compare's keys of how its runs run (compile, fused AdamW, data workers, …) are train's.
    assert {"compile", "fused_adamw", "data_workers", "report_to", "speed_batch"} <= resume_rule().operational


def test_convert_never_imports_pydantic_or_train(tmp_path):
    src = save(build_model("llama"), tmp_path / "src")
    probe = (
        "import sys; from uptrain.cli import main; code = main(sys.argv[1:]); "
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' or m.startswith('uptrain.train')))"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe, "convert", str(src), str(tmp_path / "out"), "-g", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "0 []", done.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_required_keys_are_required_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser("convert").parse_args(["convert", "src"])
    assert "out" in capsys.readouterr().err


def test_a_bad_flag_value_is_the_schemas_one_line(capsys):
    from uptrain.cli import main

    assert main(["convert", "src", "out", "-g", "two", "--grouping", "nearest"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("uptrain convert: error: invalid option: "), err
    assert "`num_kv_heads`: must be a whole number or null, not 'two'" in err and "`grouping`: must be one of" in err


def test_a_parser_error_without_a_message_is_named_by_its_type():
    """read_yaml quotes the first line of a parser's message: an empty one (a bare ValueError)
    gives its type, not an IndexError."""
    from uptrain.options import _first_line

    assert _first_line(ValueError()) == "ValueError"
    assert _first_line(ValueError("\n")) == ""
    assert _first_line(ValueError("while parsing\n  in line 1")) == "while parsing"
