"""The robustness tests reuse the training tests' tiny corpus, tokenizer and models."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/train/conftest.py imports its helpers as a top-level module, as pytest does for it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from tests.train.conftest import assets, base_config, fresh_accelerate_state  # noqa: E402,F401
