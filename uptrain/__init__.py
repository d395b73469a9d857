"""uptrain: convert multi-head-attention checkpoints to grouped-query attention and uptrain them."""

__version__ = "0.1.0"


class UptrainError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


def exception_line(err: BaseException) -> str:
    """`Type: first line of the message` of an exception another library raised: what a user needs
    of it, on the one line an `UptrainError` gives it (the rest is usually a traceback's worth)."""
    message = str(err).strip()
    return f"{type(err).__name__}: {message.splitlines()[0] if message else ''}"
