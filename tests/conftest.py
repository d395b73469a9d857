"""Shared fixtures: offline environment and tiny real transformers checkpoints."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Before transformers/datasets/wandb are imported anywhere: no network, no prompts, no
# writes to the user's caches.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["WANDB_SILENT"] = "true"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="uptrain-test-hf-")
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def shard_records(tmp_path_factory, monkeypatch) -> Path:
    """A private XDG_CACHE_HOME for a test that reads token folders: uptrain records the shards it
    verified there (`uptrain.data.shard_digests`), and the user's own cache stays untouched."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache
