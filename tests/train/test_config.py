"""The config schema: YAML + flags, refusal of unknown keys, budgets, `--help`."""

from __future__ import annotations

import pytest
import yaml

from uptrain import UptrainError
from uptrain.cli import build_parser, main
from uptrain.options import keys_of
from uptrain.train.config import TrainConfig, config_from_args, load_config

MINIMAL = {
    "model": "m",
    "train_data": "t.txt",
    "eval_data": "e.txt",
    "output_dir": "out",
    "seq_len": 32,
    "batch_size": 2,
    "lr": 1e-3,
    "max_steps": 10,
}


def write(tmp_path, values: dict):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def parse(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, {**MINIMAL, "lr": 1e-3, "report_to": "wandb"})
    config = parse(
        "--config",
        str(path),
        "--lr",
        "3e-4",
        "--seq-len",
        "64",
        "--resume",
        "--report_to",
        "jsonl",
        "--max_grad_norm",
        "null",
        "--mixed_precision",
        "no",
    )
    assert config.lr == 3e-4 and config.seq_len == 64 and config.resume is True
    assert config.report_to == ["jsonl"]
    assert config.max_grad_norm is None and config.mixed_precision == "no"
    assert load_config(path, {}).lr == 1e-3 and load_config(path, {}).report_to == ["wandb"]


def test_none_is_exclusive(tmp_path):
    with pytest.raises(UptrainError, match="cannot be combined"):
        load_config(write(tmp_path, MINIMAL), {"report_to": ["jsonl", "none"]})


def test_string_flags_stay_strings_and_yaml_no_means_no(tmp_path):
    config = load_config(write(tmp_path, {**MINIMAL, "mixed_precision": False}), {})
    assert config.mixed_precision == "no"
    assert parse("--config", str(write(tmp_path, MINIMAL)), "--model", "123", "--run_name", "no").model == "123"


def test_unknown_key_in_file_is_refused_on_one_line(tmp_path):
    path = write(tmp_path, {**MINIMAL, "learning_rate": 1e-3})
    with pytest.raises(UptrainError) as err:
        load_config(path, {})
    assert "unknown key `learning_rate`" in str(err.value) and "\n" not in str(err.value)


def test_unknown_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--learning_rate", "1"])
    assert exit_.value.code == 2 and "--learning_rate" in capsys.readouterr().err


def test_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    path = write(tmp_path, {**MINIMAL, "seq_lenn": 3})
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key `seq_lenn`" in err and err.startswith("uptrain train: error:")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_steps": None}, "exactly one budget"),
        ({"max_tokens": 100}, "exactly one budget"),
        ({"pretrain_tokens": 1e6}, "only applies with `uptrain_fraction`"),
        ({"model": None}, "exactly one of `model`"),
        ({"source": "s"}, "exactly one of `model`"),
        ({"model": None, "source": "s"}, "needs `num_kv_heads`"),
        ({"num_kv_heads": 2}, "only applies with `source`"),
        ({"kv_budget": 0.25}, "`kv_budget` only applies with `source`"),
        ({"allocation": "calibrated"}, "`allocation` only applies with `source`"),
        ({"cross_kv_weight": 37.5}, "`cross_kv_weight` only applies with `source`"),
        ({"model": None, "source": "s", "num_kv_heads": 2, "cross_kv_weight": 4}, "weighs cross-attention heads"),
        ({"model": None, "source": "s", "num_kv_heads": 2, "kv_budget": 0.5}, "give exactly one of -g/--num-kv-heads"),
        ({"model": None, "source": "s", "kv_heads_per_layer": "4,x"}, "'4,x' is not a comma list"),
        # The conversion's calibrated-merge keys with a pooling that solves no merge: refused, not ignored.
        ({"model": None, "source": "s", "num_kv_heads": 2, "value_fit": "output"}, "--pooling mean solves none"),
        ({"model": None, "source": "s", "num_kv_heads": 2, "calibration_weighting": "attention"}, "solves none"),
        ({"model": None, "source": "s", "num_kv_heads": 2, "value_fit_blend": 1.0}, "give it with that"),
        ({"resume": True, "overwrite": True}, "exclude each other"),
        ({"seq_len": 1}, "seq_len"),
        ({"train_data": None}, "train_data"),
    ],
)
def test_invalid_combinations(tmp_path, change, message):
    values = {k: v for k, v in {**MINIMAL, **change}.items() if v is not None}
    with pytest.raises(UptrainError, match=message):
        load_config(write(tmp_path, values), {})


def test_budget_from_uptrain_fraction():
    values = {k: v for k, v in MINIMAL.items() if k != "max_steps"}
    config = TrainConfig(**values, uptrain_fraction=0.05, pretrain_tokens=1e6, grad_accum=2)
    # 5% of 1M tokens = 50,000; each step is 32 × 2 × 2 × 4 processes = 512 tokens → 98 steps (rounded up).
    assert config.tokens_per_step(4) == 512 and config.total_steps(4) == 98
    assert TrainConfig(**values, max_tokens=1000).total_steps(1) == 16  # 1000 / 64 = 15.6 → 16


def test_help_documents_every_key(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for key in keys_of(TrainConfig):
        assert f"--{key.name}" in text, key.name
        assert key.option.help.split()[0] in text, key.name


def test_the_keys_a_resume_may_change_are_keys():
    from uptrain.train.config import OPERATIONAL_KEYS

    assert OPERATIONAL_KEYS <= {k.name for k in keys_of(TrainConfig)}


@pytest.mark.parametrize(
    "written, read",
    [([8, 4, 4, 2], "8,4,4,2"), ([[4, 2], [8, 1]], "4,2/8,1"), ("4,2", "4,2"), (2, "2")],
)
def test_kv_heads_per_layer_reads_a_yaml_list_as_the_flag_spells_it(tmp_path, written, read):
    values = {**MINIMAL, "model": None, "source": "s", "kv_heads_per_layer": written}
    config = load_config(write(tmp_path, {k: v for k, v in values.items() if v is not None}), {})
    assert config.kv_heads_per_layer == read and config.conversion_spec().kv_heads_per_layer == read
