"""Commands from schemas (`uptrain.options`): every key in `--help` with its default, one-line
refusals naming every bad key, and no pydantic on `uptrain convert`'s start-up."""

from __future__ import annotations

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


def command_keys(command: str):
    if command == "train":
        from uptrain.train.config import config_keys

        return config_keys(), True
    return flag_keys(COMMANDS[command].schema()), False


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_every_key_with_its_default(command, capsys):
    keys, file_keys = command_keys(command)
    entries = help_entries(command, capsys)
    assert len(keys) >= 2
    for key in keys:
        flag = (
            (key.option.metavar or key.name)
            if key.option.positional
            else "--" + (key.name if file_keys else key.name.replace("_", "-"))
        )
        assert flag in entries, (command, flag, sorted(entries))
        text = entries[flag]
        # argparse wraps after hyphens too (decoder-self): compare without whitespace.
        assert "".join(key.option.help.split()) in "".join(text.split()), (flag, text)
        if key.required:
            assert key.option.positional or "[required]" in text, (flag, text)
        elif key.default is not None and (key.default is not False or file_keys):
            # argparse wraps long lines at spaces and after hyphens (a path like /tmp/ci-clone/…):
            # compare without whitespace.
            assert "".join(f"(default: {shown(key.default)})".split()) in "".join(text.split()), (flag, text)
        else:
            assert "(default: None)" not in text and "(default: False)" not in text, (flag, text)


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
        "`num_kv_heads`: must be a whole number, not '2'",
        "`pooling`: unknown pooling 'meen'",
        "`calibration_tokens`: must be at least 1 (got 0)",
        "`max_shard_size`: cannot read size '5XB'",
    ):
        assert part in message, message
    with pytest.raises(InvalidOptions, match="`num_kv_heads` is required"):
        conversion_spec(source="s")
    assert conversion_spec(source="s", num_kv_heads=2, calibration_data=["a", "b"]).calibration_data == ["a", "b"]
    assert isinstance(conversion_spec(source="s", num_kv_heads=2), ConversionSpec)


def test_train_embeds_the_conversion_keys_and_their_checks(tmp_path):
    from uptrain import UptrainError
    from uptrain.convert.spec import ConversionOptions
    from uptrain.options import keys_of
    from uptrain.train.config import TrainConfig, load_config

    for key in keys_of(ConversionOptions):
        field = TrainConfig.model_fields[key.name]
        assert (field.default, field.description) == (key.default, key.option.help)
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


def test_convert_never_imports_pydantic(tmp_path):
    src = save(build_model("llama"), tmp_path / "src")
    probe = (
        "import sys; from uptrain.cli import main; code = main(sys.argv[1:]); "
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic'))"
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
        build_parser("convert").parse_args(["convert", "src", "out"])
    assert "--num-kv-heads" in capsys.readouterr().err
