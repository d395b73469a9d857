"""Every shipped config: its first line is the command that runs it, and that command is valid."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from uptrain.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
EXPECTED_ACCELERATE = {"single_gpu": "NO", "multi_gpu": "MULTI_GPU", "fsdp": "FSDP", "deepspeed_zero3": "DEEPSPEED"}


def header_command(path: Path) -> list[str]:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), f"{path.name}: the first line must be the command that runs it"
    return shlex.split(first[2:])


def uptrain_args(words: list[str]) -> list[str]:
    """The arguments after `uptrain train` / `-m uptrain train`."""
    i = words.index("train")
    assert words[i - 1] == "uptrain", words
    return words[i + 1 :]


def validate_launch(words: list[str]):
    """Parse and validate an `accelerate launch …` line exactly as the accelerate CLI does."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    assert words[:2] == ["accelerate", "launch"], words
    args = launch_command_parser().parse_args(words[2:])
    args, _, _ = _validate_launch_command(args)
    return args


def test_every_accelerate_config_is_shipped():
    assert {p.stem for p in ACCELERATE} == set(EXPECTED_ACCELERATE)


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_config_loads_and_its_command_is_valid(path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file

    monkeypatch.chdir(ROOT)  # the header commands are written from the repository root
    config = load_config_from_file(str(path.relative_to(ROOT)))
    assert config.distributed_type.value == EXPECTED_ACCELERATE[path.stem]
    words = header_command(path)
    args = validate_launch(words)
    assert args.config_file == str(path.relative_to(ROOT))
    assert args.module and args.training_script == "uptrain"
    recipe = ROOT / uptrain_args(words)[uptrain_args(words).index("--config") + 1]
    assert recipe.is_file()
    if path.stem == "fsdp":
        fsdp = config.fsdp_config
        # Full shard (FSDP2 spelling), one unit per decoder layer.
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert args.use_fsdp
    if path.stem == "deepspeed_zero3":
        assert config.deepspeed_config["zero_stage"] == 3 and args.use_deepspeed
    if path.stem != "single_gpu":
        assert args.num_processes > 1


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_uptraining_recipe_is_valid(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    words = header_command(path)
    if words[0] == "accelerate":
        launch = validate_launch(words)
        assert Path(launch.config_file).is_file()
    else:
        assert words[:2] == ["uptrain", "train"], words
    args = uptrain_args(words)
    assert args[args.index("--config") + 1] == f"configs/{path.name}"
    config = TrainConfig(**yaml.safe_load(path.read_text()))
    assert config.eval_data and config.output_dir.startswith("runs/")


def test_llama2_recipe_is_the_papers_budget():
    config = TrainConfig(**yaml.safe_load((ROOT / "configs" / "llama2-7b_gqa8.yaml").read_text()))
    # α = 0.05 of Llama-2's 2T pretraining tokens = 100B tokens.
    assert config.uptrain_fraction == 0.05 and config.pretrain_tokens == 2e12
    assert config.num_kv_heads == 8 and 32 % config.num_kv_heads == 0  # Llama-2-7B has 32 heads
    assert config.seq_len == 4096  # its context
    assert config.tokens_per_step(8) == 2_097_152
    assert config.total_steps(8) == 47_684  # ⌈1e11 / 2,097,152⌉
