"""Fixtures shared by the calibration tests: the shipped tokenizer and a little calibration text."""

from __future__ import annotations

import json

import pytest

from uptrain.data.corpus import load_tokenizer, read_documents


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def calibration_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibration") / "text.jsonl"
    docs = [d["text"][:3000] for _, d in zip(range(6), read_documents("validation"))]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path
