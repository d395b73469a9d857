"""Placeholder until the training loop lands (issue 3)."""

from uptrain import UptrainError


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="YAML config")


def train(args) -> int:
    raise UptrainError("uptrain train is not implemented yet")
