"""uptrain: convert multi-head-attention checkpoints to grouped-query attention and uptrain them."""

__version__ = "0.1.0"


class UptrainError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""
