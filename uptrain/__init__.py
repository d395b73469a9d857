"""uptrain: convert multi-head-attention checkpoints to grouped-query attention and uptrain them."""

__version__ = "0.1.0"


class UptrainError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


# Registers gpt2_gqa, gpt_neox_gqa, … with transformers' Auto classes when those are first
# imported (without importing transformers here: see uptrain/modeling/auto_hook.py).
from uptrain.modeling.auto_hook import install as _install_auto_registration  # noqa: E402

_install_auto_registration()
