"""`uptrain train --config FILE` and its flags: whatever the file or the flag holds, a config or
one line, exit 2, before anything is written (issue #17); and a seed no run can take is refused
by every command's schema, so that the corrected command is not refused for lacking --overwrite."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.train.train_helpers import reset_accelerate
from uptrain import UptrainError
from uptrain.cli import main
from uptrain.train.config import MAX_CONFIG_BYTES, TrainConfig, load_config

HUGE = "9" * 5000
REFERENCE = Path(__file__).resolve().parents[2] / "uptrain" / "assets" / "reference"


def error_line(capsys, command: str = "train") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith(f"uptrain {command}: error: "), err
    return err


BAD_FILES = {
    "an integer past 4300 digits": (f"lr: 1\nseed: {HUGE}\n".encode(), "more digits than Python reads"),
    "one written with underscores": (f"seed: {'9_' * 4500}9\n".encode(), "more digits than Python reads"),
    "not UTF-8": (b"lr: 0.1\nrun_name: caf\xe9\n", "is not UTF-8 text (byte 21)"),
    "UTF-16": ("lr: 0.1\n".encode("utf-16"), "is not UTF-8 text"),
    "nested too deeply (flow)": (("a: " + "[" * 50_000 + "]" * 50_000).encode(), "nested too deeply"),
    "nested too deeply (mappings)": (("a: " + "{b: " * 20_000 + "1" + "}" * 20_000).encode(), "nested too deeply"),
    "nested too deeply (block)": (("- " * 5000 + "1").encode(), "nested too deeply"),
    "larger than a config": (b"lr: 0.1\n" + b"#" * MAX_CONFIG_BYTES, "larger than a config can be (1 MiB)"),
    "a date that is none": (b"run_name: 2024-13-45\n", "month must be in 1..12"),
    "a tag that cannot be": (b"seed: !!int 1.5\n", "is not valid YAML"),
    "a timestamp tag on text": (b"run_name: !!timestamp soon\n", "is not valid YAML"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_config_file_that_is_not_a_config_is_one_line(tmp_path, capsys, case):
    data, message = BAD_FILES[case]
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    assert main(["train", "--config", str(path), "--output_dir", str(tmp_path / "run")]) == 2
    line = error_line(capsys)
    assert str(path) in line and message in line, line
    assert not (tmp_path / "run").exists()


def test_a_config_of_the_largest_size_is_read(tmp_path, base_config):
    import yaml

    text = yaml.safe_dump(base_config)
    path = tmp_path / "config.yaml"
    path.write_text(text + "#" * (MAX_CONFIG_BYTES - len(text.encode()) - 1) + "\n")
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert load_config(path, {}).lr == base_config["lr"]


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.text(max_size=300),
        # YAML-looking documents: keys, flow and block collections, tags, anchors, numbers.
        st.lists(
            st.sampled_from(
                [
                    "lr",
                    "seed",
                    ":",
                    " ",
                    "\n",
                    "- ",
                    "[",
                    "]",
                    "{",
                    "}",
                    ",",
                    "!!int",
                    "!!float",
                    "!!timestamp",
                    "!!binary",
                    "&a",
                    "*a",
                    "<<",
                    "0x",
                    "1e",
                    "2024-",
                    "13",
                    "'",
                    '"',
                    "\\",
                    "#",
                    "?",
                    "\t",
                    "%YAML",
                    "---",
                    HUGE,
                ]
            ),
            max_size=40,
        ).map("".join),
    )
)
def test_generated_config_files_are_a_config_or_one_line(tmp_path, data):
    path = tmp_path / "config.yaml"
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    try:
        config = load_config(path, {})
    except UptrainError as err:
        assert "\n" not in str(err), str(err)
    else:
        assert isinstance(config, TrainConfig)


def test_a_flag_value_no_parser_reads_is_one_line(tmp_path, capsys):
    for flag, value in (("--seq_len", HUGE), ("--lr", "[" * 60_000), ("--max_grad_norm", "!!timestamp x")):
        assert main(["train", "--output_dir", str(tmp_path / "run"), flag, value]) == 2
        assert f"`{flag[2:]}`" in error_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_out_of_range_is_refused_before_anything_is_written(tmp_path, base_config, capsys, seed):
    out = Path(base_config["output_dir"])
    argv = (
        ["train"]
        + [f"--{k}={v if not isinstance(v, list) else v[0]}" for k, v in base_config.items() if k != "seed"]
        + ["--max_steps=1"]
    )
    assert main(argv + [f"--seed={seed}"]) == 2
    assert "`seed`" in error_line(capsys) and not out.exists()
    # The corrected command runs, without --overwrite: the refusal left nothing to overwrite.
    reset_accelerate()
    assert main(argv + ["--seed=1"]) == 0
    assert (out / "final" / "config.json").is_file()


@pytest.mark.parametrize("command", ["convert", "compare"])
def test_the_other_commands_refuse_that_seed_too(tmp_path, assets, capsys, command):
    out = tmp_path / "out"
    if command == "convert":
        argv = ["convert", str(REFERENCE), str(out), "-g", "2", "--pooling", "random", "--seed", "-1"]
    else:
        argv = [
            "compare",
            "--model",
            str(assets["mha"]),
            "--num-kv-heads",
            "2",
            "--train-data",
            str(assets["train"]),
            "--eval-data",
            str(assets["eval"]),
            "--output-dir",
            str(out),
            "--max-steps",
            "1",
            "--report-to",
            "jsonl",
            "--seed",
            "-1",
        ]
    assert main(argv) == 2
    assert "`seed`: must be at least 0 (got -1)" in error_line(capsys, command)
    assert not out.exists()
