"""`uptrain train`: flags and config file in, one uptraining run out."""

from __future__ import annotations

import argparse

from uptrain.train.config import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per config key to the `train` subcommand."""
    parser.epilog = ("Budget: exactly one of --max_steps, --max_tokens, or --uptrain_fraction with --pretrain_tokens. "
                     "Several processes: accelerate launch [options] -m uptrain train --config FILE.yaml")
    add_config_arguments(parser)


def train(args: argparse.Namespace) -> int:
    """Run `uptrain train`; UptrainError carries user errors to the CLI."""
    config = config_from_args(args)
    from uptrain.train.loop import run_training  # heavy imports only once the config is valid

    run_training(config)
    return 0
