"""The robustness tests reuse the training tests' tiny corpus, tokenizer and models."""

from tests.train.conftest import assets, base_config, fresh_accelerate_state  # noqa: F401
