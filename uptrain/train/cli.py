"""`uptrain train`'s flags: `--config` and one flag per config key."""

from __future__ import annotations

import argparse

from uptrain.train.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per config key to the `train` subcommand."""
    parser.epilog = ("Budget: exactly one of --max_steps, --max_tokens, or --uptrain_fraction (with --pretrain_tokens "
                     "unless the model's card or family gives it). "
                     "Several processes: accelerate launch [options] -m uptrain train --config FILE.yaml")
    add_config_arguments(parser)
